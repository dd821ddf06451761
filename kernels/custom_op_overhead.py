"""What a compiled training step adds around the FlashMHF layer's custom operators, measured without a GPU.

    PYTHONPATH=. python kernels/custom_op_overhead.py --out DIR     # DIR/custom_op_overhead.{json,txt}

1. Dispatch: host microseconds per call of a no-op `torch.library.custom_op` with the layer's signature, against the
   same function called directly.
2. Inductor's code around the operators: a tiny FlashMHFLlama training step compiled on the CPU with the fused layer
   forced (its kernels replaced by stand-ins of the right shapes, since the CPU runs the unfused reference), and the
   lines of inductor's output code that call `memffn_v2.flash_mhf_layer` and its backward, with their neighbours:
   whether anything is copied or re-laid out for the operators.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import environment, log, measure_on, output_folder, write_json, write_text  # noqa: E402

CALLS = 20000


def dispatch_us() -> dict:
    namespace = "memffn_overhead_probe"

    @torch.library.custom_op(f"{namespace}::layer", mutates_args=())
    def layer(p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None, k: torch.Tensor,
              u: torch.Tensor, v: torch.Tensor, head_dim: int, eps: float, gate_eps: float) -> torch.Tensor:
        return torch.empty_like(p)

    def direct(p, norm_weight, router, k, u, v, head_dim, eps, gate_eps):
        return torch.empty_like(p)

    p, weight, k = torch.randn(4, 8), torch.randn(8), torch.randn(2, 2, 2, 2)
    args = (p, weight, weight, k, k, k, 128, 1e-6, 1e-6)
    results = {}
    for name, fn in (("plain function", direct), ("custom operator", getattr(torch.ops, namespace).layer.default)):
        for _ in range(1000):
            fn(*args)
        start = time.perf_counter()
        for _ in range(CALLS):
            fn(*args)
        results[name] = (time.perf_counter() - start) / CALLS * 1e6
    return results


def compiled_output_code() -> list[str]:
    """The output code's lines that call the layer's operators, each with the three lines before and after it."""
    from torch._inductor.utils import run_and_get_code

    from hf_memffn import flash_mhf_op
    from hf_memffn.testing import tiny_config
    from transformers import AutoModelForCausalLM

    def forward(p, norm_weight, router, weights, head_dim, eps, gate_eps):
        return p * 1.0

    def backward(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps):
        return grad_out * 1.0, torch.zeros_like(norm_weight), torch.zeros_like(router), torch.zeros_like(weights)

    saved = (flash_mhf_op._fused_layer_unsupported_reason, flash_mhf_op._layer_forward_impl,
             flash_mhf_op._layer_backward_impl)
    flash_mhf_op._fused_layer_unsupported_reason = lambda p, k, impl: None
    flash_mhf_op._layer_forward_impl, flash_mhf_op._layer_backward_impl = forward, backward
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", num_hidden_layers=1))
        ids = torch.randint(3, 300, (1, 32))
        compiled = torch.compile(model)

        def step():
            compiled(input_ids=ids, labels=ids).loss.backward()

        _, sources = run_and_get_code(step)
    finally:
        (flash_mhf_op._fused_layer_unsupported_reason, flash_mhf_op._layer_forward_impl,
         flash_mhf_op._layer_backward_impl) = saved
    excerpts = []
    for source in sources:
        lines = source.splitlines()
        for i, line in enumerate(lines):
            if f"= torch.ops.{flash_mhf_op.OP_NAMESPACE}.flash_mhf_layer" in line:  # the call itself
                excerpts.append("\n".join(lines[max(0, i - 3):i + 4]))
    return excerpts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    args = parser.parse_args(argv)
    measure_on("cpu")  # (CPU tensors throughout: named as the CPU on a machine with a GPU too)
    dispatch = dispatch_us()
    for name, us in dispatch.items():
        log(f"{name}: {us:.1f} us per call")
    excerpts = compiled_output_code()
    copies = [e for e in excerpts if ".clone(" in e or "copy_(" in e or ".contiguous(" in e]
    log(f"{len(excerpts)} calls of the layer's operators in the output code, {len(copies)} next to a copy")
    env = environment()
    write_json(os.path.join(args.out, "custom_op_overhead.json"),
               {"environment": env, "dispatch_us_per_call": dispatch, "operator_calls": len(excerpts),
                "calls_next_to_a_copy": len(copies)})
    write_text(os.path.join(args.out, "custom_op_overhead.txt"),
               f"# {env['device']}, torch {env['torch']}\n\n"
               + "".join(f"{name}: {us:.1f} us per call\n" for name, us in dispatch.items())
               + "\n" + "\n\n----\n\n".join(excerpts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
