"""Backward pass of the FFN-on-X0 readout (MemoryLLM, FlexMemoryLLM): the layers' outputs handed out by `unbind` of
a layer-major tensor (`ComputedMemoryReadout`) against one index per layer of a [B, L, N, d] tensor (the earlier
readout, whose backward adds a zero-filled [B, L, N, d] gradient per layer).

    PYTHONPATH=. python kernels/bench_memory_readout.py [--device cuda] [--layers 24 --tokens 2048 --hidden 512]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import bench_ms, environment, log, measure_on, refuse_counts_below  # noqa: E402

from hf_memffn.modeling_memffn import ComputedMemoryReadout  # noqa: E402


def backward_ms(layer_outputs_of, shape, device, dtype) -> float:
    """Time of the backward pass alone (the graph is built once and kept)."""
    outputs = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    parts = layer_outputs_of(outputs)
    total = sum(part.sum() * (i + 1) for i, part in enumerate(parts))
    return bench_ms(lambda: total.backward(retain_graph=True), grad_to_none=[outputs], warmup=3, rep=50)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--tokens", type=int, default=2048, help="B * L")
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, layers=1, tokens=1, hidden=1)
    try:
        measure_on(args.device)  # (timed and named as the device the tensors are on, a GPU or not)
    except ValueError as error:
        parser.error(f"--device: {error}")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    shape = (1, args.tokens, args.layers, args.hidden)  # [B, L, N, d] as TokenMemory.forward returns it
    mib = torch.finfo(dtype).bits // 8 * args.tokens * args.layers * args.hidden / 2**20
    indexed = backward_ms(lambda out: [out[:, :, i] for i in range(args.layers)], shape, args.device, dtype)
    unbound = backward_ms(lambda out: ComputedMemoryReadout(out).layer_outputs, shape, args.device, dtype)
    log(f"{environment()['device']}: readout backward over {args.layers} layers, {mib:.0f} MiB of outputs "
        f"({dtype}): one index per layer {indexed:.1f} ms, unbind {unbound:.1f} ms")


if __name__ == "__main__":
    main()
