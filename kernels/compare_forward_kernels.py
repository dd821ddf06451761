"""The FlashMHF forward: the Triton kernel against the warp-specialised Gluon kernel, in alternating rounds (one GPU
call).

    PYTHONPATH=. python kernels/compare_forward_kernels.py --out DIR    # DIR/forward_kernels.{json,md}

Shapes: the paper's (B=8, H=16, E=15, d_e=384 at L=4032 and 16128) and the FFN layer of the 370M and 1.3B presets at
their benchmark batches. Kernels: ``triton`` is ``triton_forward`` held to the Triton kernel (autotuned, weights
through tensor descriptors, as it runs on Hopper), ``gluon`` is ``gluon_forward`` (three computing warp groups of 64
rows, three column blocks in flight; the row blocks of a last, partly filled round of programs split into column
ranges, see ``flash_mhf_gluon.forward_splits``), ``gluon no split`` the same kernel with every row block whole. Every round times each kernel once with ``do_bench`` (median, L2 flushed), in
an order rotated from round to round so that no kernel always runs first or last as the GPU warms; the table gives
the median over rounds, each round's SM clock, and each output's relative difference from the Triton kernel's.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import environment, markdown_table, median, rel_err, timed, write_report  # noqa: E402

from hf_memffn import flash_mhf_gluon, flash_mhf_triton  # noqa: E402

# (name, batch, heads, seq_len, subnetworks, subnetwork_size); d_h = 128 and one weight group per head throughout
SHAPES = [
    ("paper L=4032", 8, 16, 4032, 15, 384),
    ("paper L=16128", 8, 16, 16128, 15, 384),
    ("370M layer (8 x 2048 tokens)", 8, 8, 2048, 7, 384),
    ("1.3B layer (4 x 2048 tokens)", 4, 16, 2048, 15, 384),
]


def inputs(batch, heads, seq_len, subnetworks, subnetwork_size):
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, heads, seq_len, 128, device="cuda", generator=generator).bfloat16()
    k, u, v = ((torch.randn(heads, subnetworks, subnetwork_size, 128, device="cuda", generator=generator)
                * 128**-0.5).bfloat16() for _ in range(3))
    r = torch.rand(batch, heads, seq_len, subnetworks, device="cuda", generator=generator)
    return q, k, u, v, r / r.sum(-1, keepdim=True)


def compare(shape, rounds: int) -> dict:
    name, batch, heads, seq_len, subnetworks, subnetwork_size = shape
    q, k, u, v, r = inputs(batch, heads, seq_len, subnetworks, subnetwork_size)
    flops = 6 * batch * heads * seq_len * subnetworks * subnetwork_size * 128
    weights = flash_mhf_gluon.weight_descriptors(k, u, v)
    outputs = {}

    def triton():  # (each launch allocates its output, as the op does)
        outputs["triton"] = flash_mhf_triton.triton_forward(q, k, u, v, r, descriptors=True)

    def gluon():
        outputs["gluon"] = flash_mhf_gluon.gluon_forward(q, k, u, v, r, weights=weights)[0]

    def gluon_no_split():
        outputs["gluon no split"] = flash_mhf_gluon.gluon_forward(q, k, u, v, r, weights=weights, split=False)[0]

    launches = {"triton": triton, "gluon": gluon, "gluon no split": gluon_no_split}
    for launch in launches.values():
        launch()
    torch.cuda.synchronize()
    labels = list(launches)
    times = {label: [] for label in labels}
    for round_ in range(rounds):
        for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
            times[label].append(timed(launches[label]))
    rows = {}
    for label in labels:
        ms = median(t["ms"] for t in times[label])
        rows[label] = {"ms": ms, "tflops": flops / ms * 1e-9, "rounds_ms": [t["ms"] for t in times[label]],
                       "rounds_sm_clock_mhz": [t["sm_clock_mhz"] for t in times[label]],
                       "rel_diff_from_triton": rel_err(outputs[label], outputs["triton"])}
    for label in labels:
        rows[label]["speedup_over_triton"] = rows["triton"]["ms"] / rows[label]["ms"]
    return {"shape": name, "batch": batch, "heads": heads, "seq_len": seq_len, "subnetworks": subnetworks,
            "subnetwork_size": subnetwork_size, "kernels": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not (torch.cuda.is_available() and flash_mhf_gluon.gluon_reason_for(torch.device("cuda"), torch.bfloat16, 128,
                                                                             384) is None):
        sys.exit("compare_forward_kernels.py needs a Hopper GPU and triton's Gluon API")
    results = {**environment(), "rounds": args.rounds, "shapes": [compare(shape, args.rounds) for shape in SHAPES]}
    rows = []
    for shape in results["shapes"]:
        for label, row in shape["kernels"].items():
            clocks = [c for c in row["rounds_sm_clock_mhz"] if c]
            rows.append([shape["shape"], label, f"{row['ms']:.3f}", f"{row['tflops']:.0f}",
                         f"{row['speedup_over_triton']:.3f}", " / ".join(f"{x:.3f}" for x in row["rounds_ms"]),
                         f"{min(clocks):.0f}-{max(clocks):.0f}" if clocks else None,
                         f"{row['rel_diff_from_triton']:.1e}"])
    text = "\n".join([
        f"# FlashMHF forward kernels on {results['device']}", "",
        f"torch {results['torch']}, triton {results['triton']}; bf16, d_h = 128; median of {args.rounds} rounds, the "
        "order rotated every round.", "",
        *markdown_table(["shape", "kernel", "ms", "TFLOP/s", "x Triton", "rounds (ms)", "SM clock MHz",
                         "rel. diff. from Triton"], rows), ""])
    write_report(args.out, "forward_kernels", results, text)


if __name__ == "__main__":
    main()
