"""The FlashMHF forward: the Triton kernel against the warp-specialised Gluon kernel, in alternating rounds (one GPU
call); with ``--kernel weights``, the Gluon weight-gradient kernel with and without its split tiles.

    PYTHONPATH=. python kernels/compare_forward_kernels.py --out DIR    # DIR/forward_kernels.{json,md}
    PYTHONPATH=. python kernels/compare_forward_kernels.py --kernel weights --out DIR    # DIR/weight_kernels.*

Shapes: the paper's (B=8, H=16, E=15, d_e=384 at L=4032 and 16128) and the FFN layer of the 370M and 1.3B presets at
their benchmark batches. Forward kernels: ``triton`` is ``triton_forward`` held to the Triton kernel (autotuned,
weights through tensor descriptors, as it runs on Hopper), ``gluon`` is ``gluon_forward`` (three computing warp
groups of 64 rows, three column blocks in flight; the row blocks of a last, partly filled round of programs split
into column ranges, see ``flash_mhf_gluon.forward_splits``), ``gluon no split`` the same kernel with every row block
whole. Weight kernels: ``gluon`` is ``gluon_weight_gradients`` (the tiles of a last, partly filled round of programs
split into row ranges whose float32 shares a second kernel adds, see ``flash_mhf_gluon.weight_splits``), ``gluon no
split`` the same kernel with every tile whole. Every round times each kernel once with ``do_bench`` (median, L2
flushed), in an order rotated from round to round so that no kernel always runs first or last as the GPU warms; the
table gives the median over rounds, each round's SM clock, and each output's relative difference from the first
kernel's (dK, dU and dV together for the weight kernels). ``--package OLD`` times OLD's Gluon kernel too, with its
own defaults (OLD: a folder holding another commit's ``hf_memffn/flash_mhf_gluon.py``); ``--weight-ranges 3 5 9``
times the weight kernel with the last round's tiles split into each number of row ranges.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import (  # noqa: E402
    environment, markdown_table, median, output_folder, refuse_counts_below, rel_err, timed, write_report,
)
from ptxas_report import load_gluon_module  # noqa: E402

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


def forward_launches(q, k, u, v, r, outputs: dict, other=None) -> dict:
    weights = flash_mhf_gluon.weight_descriptors(k, u, v)

    def triton():  # (each launch allocates its output, as the op does)
        outputs["triton"] = flash_mhf_triton.triton_forward(q, k, u, v, r, descriptors=True)

    def gluon():
        outputs["gluon"] = flash_mhf_gluon.gluon_forward(q, k, u, v, r, weights=weights)[0]

    def gluon_no_split():
        outputs["gluon no split"] = flash_mhf_gluon.gluon_forward(q, k, u, v, r, weights=weights, split=False)[0]

    launches = {"triton": triton, "gluon": gluon, "gluon no split": gluon_no_split}
    if other is not None:
        def gluon_other():
            outputs[other.label] = other.module.gluon_forward(q, k, u, v, r, weights=weights)[0]

        launches[other.label] = gluon_other
    return launches


def weight_launches(q, k, u, v, r, outputs: dict, other=None, range_counts=()) -> dict:
    weights = flash_mhf_gluon.weight_descriptors(k, u, v)
    grad_out = torch.randn_like(q)

    def launch(label, module, **options):
        def run():  # (dK, dU and dV as one tensor, for the relative difference)
            grads = module.gluon_weight_gradients(grad_out, q, k, u, v, r, weights=weights, **options)
            outputs[label] = torch.stack(grads[:3])
        return run

    launches = {"gluon": launch("gluon", flash_mhf_gluon, split=True),
                "gluon no split": launch("gluon no split", flash_mhf_gluon, split=False)}
    if other is not None:  # (its own defaults)
        launches[other.label] = launch(other.label, other.module)
    tiles = k.shape[0] * k.shape[1] * k.shape[2] // flash_mhf_gluon.BLOCK_N
    row_blocks = q.shape[0] * (q.shape[1] // k.shape[0]) * -(-q.shape[2] // flash_mhf_gluon.BLOCK_L)
    for count in range_counts:  # where the shape has a last round to split, and 4 row blocks per range
        if tiles % flash_mhf_gluon.multiprocessor_count(q.device) and row_blocks // 4 >= count:
            launches[f"gluon, {count} ranges"] = launch(f"gluon, {count} ranges", flash_mhf_gluon, splits=count)
    return launches


# kernel: (its launches, products per row and column (2 FLOPs each), report name)
KERNELS = {"forward": (forward_launches, 3, "forward_kernels"), "weights": (weight_launches, 6, "weight_kernels")}


class OtherPackage(NamedTuple):
    """``--package``: another commit's Gluon module, timed beside this checkout's kernels."""

    label: str
    module: object


def compare(shape, rounds: int, kernel: str = "forward", other: OtherPackage | None = None,
            range_counts=()) -> dict:
    name, batch, heads, seq_len, subnetworks, subnetwork_size = shape
    q, k, u, v, r = inputs(batch, heads, seq_len, subnetworks, subnetwork_size)
    make_launches, products, _ = KERNELS[kernel]
    flops = 2 * products * batch * heads * seq_len * subnetworks * subnetwork_size * 128
    outputs = {}
    launches = make_launches(q, k, u, v, r, outputs, other, **({"range_counts": range_counts} if range_counts else {}))
    for launch in launches.values():
        launch()
    torch.cuda.synchronize()
    labels = list(launches)
    times = {label: [] for label in labels}
    for round_ in range(rounds):
        for label in labels[round_ % len(labels):] + labels[:round_ % len(labels)]:
            times[label].append(timed(launches[label]))
    rows = {}
    first = labels[0]
    for label in labels:
        ms = median(t["ms"] for t in times[label])
        rows[label] = {"ms": ms, "tflops": flops / ms * 1e-9, "rounds_ms": [t["ms"] for t in times[label]],
                       "rounds_sm_clock_mhz": [t["sm_clock_mhz"] for t in times[label]],
                       f"rel_diff_from_{first}": rel_err(outputs[label], outputs[first])}
    for label in labels:
        rows[label][f"speedup_over_{first}"] = rows[first]["ms"] / rows[label]["ms"]
    return {"shape": name, "batch": batch, "heads": heads, "seq_len": seq_len, "subnetworks": subnetworks,
            "subnetwork_size": subnetwork_size, "kernels": rows}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="forward")
    parser.add_argument("--package", help="a folder holding another commit's hf_memffn/flash_mhf_gluon.py, whose "
                        "kernel is timed too (as 'gluon at FOLDER')")
    parser.add_argument("--weight-ranges", type=int, nargs="+", default=[],
                        help="--kernel weights: also time the last round's tiles split into each of these numbers of "
                        "row ranges, where a shape has such a round")
    args = parser.parse_args()
    refuse_counts_below(parser, args, rounds=1)  # (no round: no median, after every kernel has compiled)
    if args.weight_ranges and args.kernel != "weights":
        parser.error("--weight-ranges needs --kernel weights")
    if not (torch.cuda.is_available() and flash_mhf_gluon.gluon_reason_for(torch.device("cuda"), torch.bfloat16, 128,
                                                                             384) is None):
        sys.exit("compare_forward_kernels.py needs a Hopper GPU and triton's Gluon API")
    other = None
    if args.package:
        other = OtherPackage(f"gluon at {os.path.basename(os.path.normpath(args.package))}",
                             load_gluon_module(args.package, {}))
    results = {**environment(), "kernel": args.kernel, "rounds": args.rounds, "package": args.package,
               "shapes": [compare(shape, args.rounds, args.kernel, other, args.weight_ranges) for shape in SHAPES]}
    rows = []
    for shape in results["shapes"]:
        first = next(iter(shape["kernels"]))
        for label, row in shape["kernels"].items():
            clocks = [c for c in row["rounds_sm_clock_mhz"] if c]
            rows.append([shape["shape"], label, f"{row['ms']:.3f}", f"{row['tflops']:.0f}",
                         f"{row[f'speedup_over_{first}']:.3f}", " / ".join(f"{x:.3f}" for x in row["rounds_ms"]),
                         f"{min(clocks):.0f}-{max(clocks):.0f}" if clocks else None,
                         f"{row[f'rel_diff_from_{first}']:.1e}"])
    first = next(iter(results["shapes"][0]["kernels"]))
    text = "\n".join([
        f"# FlashMHF {args.kernel} kernels on {results['device']}", "",
        f"torch {results['torch']}, triton {results['triton']}; bf16, d_h = 128; median of {args.rounds} rounds, the "
        "order rotated every round; TFLOP/s counts the products the kernel runs.", "",
        *markdown_table(["shape", "kernel", "ms", "TFLOP/s", f"x {first}", "rounds (ms)", "SM clock MHz",
                         f"rel. diff. from {first}"], rows), ""])
    write_report(args.out, KERNELS[args.kernel][2], results, text)


if __name__ == "__main__":
    main()
