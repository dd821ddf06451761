"""What adding dq's shares across column blocks would cost a one-kernel FlashMHF backward, on one GPU.

    PYTHONPATH=. python kernels/bench_dq_reduction.py --out DIR        # DIR/dq_reduction.{json,md}

The backward runs two kernels today: the weight kernel (one program per column block of ``BLOCK_N`` sub-network
units, the row blocks streamed through: dK, dU, dV; six products) and the dq/dr kernel (one program per row block,
the column blocks streamed through: five products, three of them recomputing what the weight kernel computed). One
kernel would add ``dq += [dM | dN] [K | U]`` to the weight kernel (eight products instead of eleven), but each of its
programs holds only its column block's share of a row's dq: the shares of every column block have to be added in
memory, ``E * d_e / BLOCK_N`` float32 tiles of ``[BLOCK_L, d_h]`` per row block.

This script times that reduction alone, at the presets' layer shapes, in the order such a kernel would issue it (one
program per column block of each weight group, its row blocks in turn, each adding one ``[BLOCK_L, d_h]`` float32
tile), three ways: element atomics (``tl.atomic_add``), the bulk tensor copy engine's reduction (a tensor
descriptor's ``atomic_add``) and plain stores of the same bytes (the traffic without the additions). Beside them, in
the same process, the production Gluon weight and dq/dr kernels on the same shapes. Lower bound of the one-kernel
backward, if its two extra products ran at the weight kernel's rate and its reduction hid entirely under its products:
``weights * 8 / 6``. (The weight kernel built that way, each program adding its shares of dq and dr with element
atomics into float32 buffers zeroed first, was timed and checked against the two kernels by this script at commit
65fa0a7, where the kernel has it as ``ROWS_TOO``: `results/gluon/h100_dq_reduction_one_kernel.*`, its report reads
those columns from the JSON. It ran 1.47x / 1.48x slower than the two kernels and was taken out again.)

Every way's sums are checked at a small shape first; on a machine without a GPU (`--device cpu`, Triton's
interpreter, which has no bulk-copy reduction) the other two ways only.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    bench_ms, environment, log, markdown_table, measure_on, on_cuda, output_folder, write_report,
)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

HEAD_DIM, BLOCK_L = 128, 128
# (tokens, heads, sub-networks, sub-network size) of the presets' layers, as compare_triton_builds.LAYERS
LAYERS = {"370M": (8 * 2048, 8, 7, 384), "1.3B": (4 * 2048, 16, 15, 384)}
WAYS = ("element atomics", "bulk-copy reduction", "plain stores")


@triton.jit
def _add_shares_kernel(DQ, ROW_BLOCKS: tl.constexpr, MODE: tl.constexpr, BLOCK_L: tl.constexpr,
                       D_H: tl.constexpr):
    """Program (column block, head): for each of the head's row blocks, one float32 [BLOCK_L, D_H] share (here the
    value ``column block + 1``) added into DQ [heads * ROW_BLOCKS * BLOCK_L, D_H]. MODE 0: element atomics, 1: the
    bulk copy engine's reduction through a tensor descriptor, 2: plain stores (no addition). (ROW_BLOCKS is a
    constant: Triton 3.6's interpreter with NumPy 2.4 or later cannot loop up to an argument.)"""
    column_block = tl.program_id(0)
    head = tl.program_id(1)
    share = tl.full([BLOCK_L, D_H], 1.0, tl.float32) * (column_block + 1).to(tl.float32)
    first_row = head.to(tl.int64) * ROW_BLOCKS * BLOCK_L
    if MODE == 1:
        desc = tl.make_tensor_descriptor(DQ, shape=[tl.num_programs(1) * ROW_BLOCKS * BLOCK_L, D_H],
                                         strides=[D_H, 1], block_shape=[BLOCK_L, D_H])
        for row_block in range(ROW_BLOCKS):
            desc.atomic_add([(head * ROW_BLOCKS + row_block) * BLOCK_L, 0], share)
    else:
        offsets = tl.arange(0, BLOCK_L)[:, None] * D_H + tl.arange(0, D_H)[None, :]
        for row_block in range(ROW_BLOCKS):
            pointers = DQ + (first_row + row_block * BLOCK_L) * D_H + offsets
            if MODE == 0:
                tl.atomic_add(pointers, share, sem="relaxed")
            else:
                tl.store(pointers, share)


def add_shares(dq: torch.Tensor, heads: int, column_blocks: int, way: str) -> None:
    """Every column block's shares added into ``dq`` [heads * ROW_BLOCKS * BLOCK_L, d_h] (float32) ``way``."""
    row_blocks = dq.shape[0] // (heads * BLOCK_L)
    _add_shares_kernel[(column_blocks, heads)](dq, ROW_BLOCKS=row_blocks, MODE=WAYS.index(way), BLOCK_L=BLOCK_L,
                                               D_H=dq.shape[1], num_warps=8)


def _allocator(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda" if on_cuda() else "cpu")


def check_sums(device: str, ways=WAYS) -> list[dict]:
    """Each way's result at a small shape against the expected sum (plain stores: the last share written)."""
    heads, column_blocks, row_blocks = 2, 3, 2
    rows = []
    for way in ways:
        dq = torch.zeros(heads * row_blocks * BLOCK_L, HEAD_DIM, device=device)
        add_shares(dq, heads, column_blocks, way)
        expected = column_blocks * (column_blocks + 1) / 2 if way != "plain stores" else None
        values = sorted(set(dq.unique().tolist()))
        # (plain stores race: each element holds one of the shares, whichever program wrote it last)
        allowed = [expected] if expected is not None else [float(c + 1) for c in range(column_blocks)]
        ok = set(values) <= set(allowed)
        rows.append({"way": way, "values": values, "ok": ok})
        if not ok:
            raise AssertionError(f"{way}: dq holds {values}, expected only {allowed}")
    return rows


def measure(preset: str, block_n: int) -> dict:
    """The reduction's three ways at ``preset``'s layer shape with ``block_n``-unit column blocks, in ms."""
    tokens, heads, subnetworks, subnetwork_size = LAYERS[preset]
    column_blocks = subnetworks * subnetwork_size // block_n
    dq = torch.zeros(heads * tokens, HEAD_DIM, device="cuda")
    times = {way: bench_ms(lambda way=way: add_shares(dq, heads, column_blocks, way)) for way in WAYS}
    shares_bytes = column_blocks * dq.numel() * 4
    return {"preset": preset, "block_n": block_n, "column_blocks_per_head": column_blocks,
            "shares_gb": shares_bytes / 1e9, "ms": times,
            "tb_per_s": {way: shares_bytes / (ms * 1e-3) / 1e12 for way, ms in times.items()}}


def production_kernels(preset: str) -> dict:
    """The Gluon weight and dq/dr kernels' times (ms) on the layer's shape, as the layer's backward calls them."""
    import compare_triton_builds as builds

    from hf_memffn import flash_mhf_gluon

    case = builds.Case(f"weights:{preset}", "cuda")
    grad_out, q, k, u, v, r = case.op_inputs
    weights = flash_mhf_gluon.weight_descriptors(k, u, v)
    return {"weights": bench_ms(lambda: flash_mhf_gluon.gluon_weight_gradients(grad_out, q, k, u, v, r,
                                                                                  weights=weights)),
            "rows": bench_ms(lambda: flash_mhf_gluon.gluon_rows_gradients(grad_out, q, k, u, v, r, weights=weights))}


def report(results: dict) -> str:
    lines = [f"# dq's shares added across column blocks, {results['environment']['device']}", "",
             f"torch {results['environment']['torch']}, triton {results['environment']['triton']}. Float32 "
             f"[{BLOCK_L}, {HEAD_DIM}] shares, one per (row block, column block); ms (median of do_bench) and TB/s "
             "of shares added.", ""]
    rows = [[r["preset"], r["block_n"], r["column_blocks_per_head"], f"{r['shares_gb']:.2f}",
             *(f"{r['ms'][way]:.3f} ({r['tb_per_s'][way]:.2f})" for way in WAYS)] for r in results["reductions"]]
    lines += markdown_table(["layer", "BLOCK_N", "shares per dq element", "GB added",
                             *(f"{way} ms (TB/s)" for way in WAYS)], rows)
    if not results["reductions"]:
        lines += ["", "No GPU: the sums were checked, nothing was timed."]
    if results["kernels"]:
        lines += ["", "The production kernels on the same shapes (ms), and the one-kernel backward: at least its "
                  "products at the weight kernel's rate (weights x 8 / 6), with its reduction hidden under them; "
                  "\"share\": the reduction's time alone (BLOCK_N 64 / 128, bulk copies) over that bound, what it "
                  "would have to overlap.", ""]
        rows = []
        for preset, kernels in results["kernels"].items():
            bound = kernels["weights"] * 8 / 6
            reductions = [r["ms"]["bulk-copy reduction"] for r in results["reductions"] if r["preset"] == preset]
            rows.append([preset, f"{kernels['weights']:.3f}", f"{kernels['rows']:.3f}",
                         f"{kernels['weights'] + kernels['rows']:.3f}", f"{bound:.3f}",
                         f"{kernels['weights'] + kernels['rows'] - bound:.3f}",
                         " / ".join(f"{ms:.3f} ({ms / bound:.0%})" for ms in reductions),
                         *([f"{kernels['one_kernel']:.3f}", f"{kernels['one_kernel_dq_rel_err']:.1e} / "
                            f"{kernels['one_kernel_dr_rel_err']:.1e}", kernels["one_kernel_weight_grads_equal"]]
                           if "one_kernel" in kernels else [])])
        lines += markdown_table(["layer", "weights", "dq/dr", "both", "one kernel, at least", "it would save",
                                 "its reduction alone (share)",
                                 *(["the weight kernel adding dq and dr too", "its dq / dr against dq/dr's",
                                    "its dK, dU, dV equal"] if "one_kernel" in kernels else [])], rows)
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda (the measurement) or cpu (the sums' check only, in Triton's interpreter)")
    parser.add_argument("--presets", default="370M,1.3B")
    parser.add_argument("--block-n", default="64,128", help="column block widths to time (64: the weight kernel's)")
    args = parser.parse_args(argv)
    presets = args.presets.split(",")
    unknown = [name for name in presets if name not in LAYERS]
    if unknown:
        parser.error(f"--presets: {unknown} unknown; allowed: {', '.join(LAYERS)}")
    try:
        block_ns = [int(b) for b in args.block_n.split(",")]
    except ValueError:
        parser.error(f"--block-n: expected comma-separated integers, got {args.block_n!r}")
    for block_n in block_ns:
        widths = {name: LAYERS[name][2] * LAYERS[name][3] for name in presets}
        if block_n < 16 or block_n % 16 or any(width % block_n for width in widths.values()):
            parser.error(f"--block-n: {block_n} must be a multiple of 16 dividing E * d_e of every preset {widths}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; --device cpu checks the sums in Triton's interpreter")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1")
    measure_on(args.device)
    triton.set_allocator(_allocator)  # (the device-side tensor descriptors' scratch)
    # (Triton's interpreter has no bulk-copy reduction: on the CPU the other two ways are checked)
    ways = WAYS if on_cuda() else tuple(way for way in WAYS if way != "bulk-copy reduction")
    results = {"environment": environment(), "checks": check_sums(args.device, ways), "reductions": [],
               "kernels": {}}
    log("sums:", [(row["way"], row["ok"]) for row in results["checks"]])
    if on_cuda():
        for preset in presets:
            for block_n in block_ns:
                results["reductions"].append(measure(preset, block_n))
            results["kernels"][preset] = production_kernels(preset)
    write_report(args.out, "dq_reduction", results, report(results))
    return results


if __name__ == "__main__":
    main()
