"""Where the FlashMHF module's forward+backward peak memory goes (bf16, paper shape, B=8, L=16128).

Measures the peak of: the fused op alone, the module as is, and the module with token-chunked recompute for several
chunk sizes; and what the op allocates beyond its inputs and outputs. Writes flash_mhf_memory_profile.json to --out.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import GIB as GiB  # noqa: E402
from harness import (  # noqa: E402
    environment, output_folder, peak_memory_gib, refuse_counts_below, reset_peak_memory, synchronize, write_json,
)

from hf_memffn import FlashMHFLlamaConfig, flash_mhf  # noqa: E402
from hf_memffn.ffn_multihead import FlashMHFFeedForward, recompute_in_token_chunks  # noqa: E402


def peak(fn):
    """(GiB allocated at the peak of ``fn`` above what was allocated before it, GiB allocated before it)."""
    synchronize()
    reset_peak_memory()
    base = torch.cuda.memory_allocated() / GiB
    fn()
    synchronize()
    return peak_memory_gib() - base, base


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=output_folder, required=True, help="folder for flash_mhf_memory_profile.json")
    parser.add_argument("--length", type=int, default=16128)
    args = parser.parse_args()
    refuse_counts_below(parser, args, length=1)
    if not torch.cuda.is_available():
        sys.exit("profile_flash_mhf_memory.py needs a CUDA GPU")
    config = FlashMHFLlamaConfig(hidden_size=2048, intermediate_size=15 * 384, num_attention_heads=16,
                                 ffn_num_heads=16, ffn_num_subnetworks=15, ffn_kernel="triton")
    module = FlashMHFFeedForward(config).to("cuda", torch.bfloat16)
    x = torch.randn(8, args.length, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    rows = {**environment(), "L": args.length, "token_bytes_GiB": x.numel() * 2 / GiB}

    def run(forward):
        def step():
            forward(x).backward(grad)
        step()  # warm up / autotune
        x.grad = None
        for p in module.parameters():
            p.grad = None
        result = peak(step)
        x.grad = None
        for p in module.parameters():
            p.grad = None
        return result

    rows["module_plain"] = run(module._forward)
    for chunk in (4096, 8192, 16384, 32768):
        rows[f"module_chunked_{chunk}"] = run(lambda t, c=chunk: recompute_in_token_chunks(module, t, c))
    # the op alone on one chunk's worth of tokens: what it allocates beyond its inputs/outputs
    for tokens in (16384, 8 * args.length):
        q = torch.randn(1, 16, tokens, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        r = torch.rand(1, 16, tokens, 15, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        out_grad = torch.randn_like(q)
        step = lambda: flash_mhf(q, module.key, module.up, module.value, r, impl="triton").backward(out_grad)  # noqa: E731
        step()
        rows[f"op_{tokens}_tokens"] = peak(step)
        rows[f"op_{tokens}_tokens_q_GiB"] = q.numel() * 2 / GiB
        q = r = out_grad = None
    print(json.dumps(rows, indent=1))
    write_json(os.path.join(args.out, "flash_mhf_memory_profile.json"), rows)


if __name__ == "__main__":
    main()
