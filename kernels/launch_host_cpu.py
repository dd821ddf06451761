"""The host's time of the FlashMHF layer's launches, on a CPU, for an H100 (no GPU needed).

    PYTHONPATH=. python kernels/launch_host_cpu.py --out DIR      # DIR/launch_host_cpu.{json,md}

Under `compare_triton_builds.py`'s stand-in for Triton's CUDA driver (CPU tensors at the 370M preset's layer shape,
kernels compiled for sm_90, nothing launched), `timeit` medians of microseconds per call:
- the layer's training forward and backward, with our kernels launched through the compiled kernel kept per argument
  signature (`triton_launch.launch`) and with `CACHED` off (Triton's own launch on every call);
- the Gluon forward kernel launched through Triton (`kernel[grid](...)`) and directly (`compiled[grid](...)`), and
  the signature `triton_launch` builds for its arguments;
- the weights' three Gluon tensor descriptors built and checked by Gluon, and as copies of one checked descriptor
  (`flash_mhf_gluon.tensor_descriptor`).
What the stand-in does not run is Triton's launcher itself (the tensor descriptors' encoding, the driver's launch),
which both ways share. The host's speed sets the numbers; their ratios are what carries to another machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_triton_builds as builds  # noqa: E402
from harness import (  # noqa: E402
    environment, markdown_table, measure_on, median, output_folder, refuse_counts_below, write_report,
)

from hf_memffn import flash_mhf_gluon, triton_launch  # noqa: E402


def per_call_us(fn, number: int, repeat: int) -> float:
    """The median over ``repeat`` runs of ``number`` calls, in µs per call, after one call."""
    fn()
    return median([t / number * 1e6 for t in timeit.repeat(fn, number=number, repeat=repeat)])


def measure(number: int, repeat: int) -> list[dict]:
    rows = []

    def row(name: str, fn, cached=None):
        if cached is not None:
            triton_launch.CACHED = cached
        try:
            rows.append({"what": name, "us_per_call": per_call_us(fn, number, repeat)})
        finally:
            triton_launch.CACHED = True

    forward, backward = (builds.Case(name, "cpu") for name in ("forward:370M", "backward:370M"))
    for case, name in ((forward, "layer training forward"), (backward, "layer backward")):
        row(f"{name}, kept launches", case.run, cached=True)
        row(f"{name}, Triton's launch on every call", case.run, cached=False)

    op = builds.Case("forward_op:370M", "cpu")
    q, k, u, v, r = op.op_inputs[1:]
    weights = flash_mhf_gluon.weight_descriptors(k, u, v)
    out = torch.empty_like(q)
    shares = q.new_empty((1, q.shape[-1]), dtype=torch.float32)
    kernel = flash_mhf_gluon._warp_specialised_forward_kernel
    # the forward's arguments with no row block split (one head per weight group: total rows B * L)
    total_rows = q.shape[0] * q.shape[2]
    row_blocks = -(-total_rows // flash_mhf_gluon.FORWARD_BLOCK_L)
    tiles = row_blocks * k.shape[0]
    args = (q, *weights, r, out, shares, *q.stride()[:3], *out.stride()[:3], total_rows, q.shape[2], 1, q.shape[1],
            k.shape[1], row_blocks, tiles, 1)
    options = dict(D_H=q.shape[-1], D_E=k.shape[2], BLOCK_N=flash_mhf_gluon.BLOCK_N,
                   STAGES=flash_mhf_gluon.FORWARD_STAGES, CONSUMER_REGISTERS=flash_mhf_gluon.FORWARD_REGISTERS,
                   num_warps=flash_mhf_gluon.ROWS_WARPS, **triton_launch.COMPILE_OPTIONS)
    grid = (tiles,)
    compiled = kernel[grid](*args, **options)
    constants = [options[name] for name in kernel.arg_names[len(args):]]
    row("Gluon forward kernel, Triton's launch", lambda: kernel[grid](*args, **options))
    row("Gluon forward kernel, compiled[grid](...)", lambda: compiled[(*grid, 1, 1)](*args, *constants))
    row(f"triton_launch's signature of its {len(args)} arguments", lambda: triton_launch._signature(kernel, args))

    flat = [flash_mhf_gluon.descriptor_ready(w.reshape(-1, w.shape[-1])) for w in (k, u, v)]
    block = (flash_mhf_gluon.BLOCK_N, k.shape[-1])
    layout = flash_mhf_gluon._shared_layout(block, k.dtype)
    row("the weights' 3 descriptors, built and checked by Gluon", lambda: [flash_mhf_gluon.GluonTensorDescriptor(
        w, list(w.shape), list(w.stride()), list(block), layout) for w in flat])
    row("the weights' 3 descriptors, copies of a checked one", lambda: [
        flash_mhf_gluon.tensor_descriptor(w, block) for w in flat])
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--number", type=int, default=100, help="calls per timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings per row (their median is reported)")
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, number=1, repeat=1)  # (no call or timing: no time per call, no median)
    if not flash_mhf_gluon.GLUON_AVAILABLE:
        parser.error(f"needs Triton's Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    current_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: 0  # (the stand-in's device; a CPU build of torch has none)
    try:
        with builds.compiling_for_hopper():
            triton_launch.CACHED = True  # (the stand-in block switches it off, and puts it back after)
            rows = measure(args.number, args.repeat)
    finally:
        torch.cuda.current_device = current_device
    measure_on("cpu")  # (the host's time on CPU tensors: named as the CPU on a machine with a GPU too)
    results = {"environment": environment(), "cpu_count": os.cpu_count(), "number": args.number,
               "repeat": args.repeat, "rows": rows}
    text = "\n".join([f"# Host µs per call of the FlashMHF layer's launches, stand-in H100 driver on "
                      f"{results['environment']['device']} (triton {results['environment'].get('triton')})", "",
                      *markdown_table(["what", "µs per call"],
                                      [[row["what"], f"{row['us_per_call']:.1f}"] for row in rows]), ""])
    write_report(args.out, "launch_host_cpu", results, text)
    return results


if __name__ == "__main__":
    main()
