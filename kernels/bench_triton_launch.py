"""Host time of our Triton launches in an eager decoding step: as `hf_memffn.triton_launch` launches them (the
compiled kernel kept per argument signature, grids computed in plain Python) against Triton's own launch on every
call with Triton's `cdiv` / `next_power_of_2` for the grids (`bench_models.tritons_own_launch`, the code before).

    PYTHONPATH=. python kernels/bench_triton_launch.py --out DIR          # on a GPU, about a minute

Each part is what an eager decoding step of the 370M preset runs once per layer, at one token per row (batch 1 and
16): the decoder's RMSNorm and the rotary embedding of the queries and keys (one Triton kernel each), the FlashMHF
FFN block (its projections, and the norm, gates and sub-networks in the Triton decode kernel and the sum of its
column splits), the KV-FFN block (two matrix products around a Triton activation kernel) and, for comparison,
transformers' `LlamaRMSNorm` and Llama's MLP (PyTorch operations only, so both columns time the same code). A part's time is the host's: `--calls` calls are
issued back to back, each a few microseconds of GPU work, so the GPU waits for the host and the wall time per call
is the host's time to issue one. The two modes alternate over `--rounds` rounds, so the host's slow and fast minutes
fall on both; each row gives the medians and the median of the rounds' ratios. Before timing, each part's outputs
under both modes are compared: the same compiled kernels run, so they agree bitwise. Writes
triton_launch.{json,md} into --out.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    back_to_back_us, environment, log, markdown_table, median, output_folder, refuse_counts_below, write_report,
)
from bench_models import build_config, get_preset, tritons_own_launch  # noqa: E402

DECODE_BATCHES = (1, 16)


def parts(size: str, batch: int) -> dict:
    """{name: function of no arguments} for one decoding step's pieces at `size`, `batch` rows of one token."""
    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

    from hf_memffn import FlashMHFLlamaModel, KVFFNModel
    from hf_memffn.decoder_triton import rms_norm, rotate_pair

    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    llama_config = build_config("llama", size)
    hidden, heads = llama_config.hidden_size, llama_config.num_attention_heads
    head_dim = hidden // heads
    x = torch.randn(batch, 1, hidden, device=device, dtype=dtype)
    norm_weight = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    queries = torch.randn(batch, 1, heads, head_dim, device=device, dtype=dtype)
    keys = torch.randn(batch, 1, llama_config.num_key_value_heads, head_dim, device=device, dtype=dtype)
    angles = torch.rand(1, 1, head_dim, device=device, dtype=dtype)
    cos, sin = angles.cos(), angles.sin()
    flash = FlashMHFLlamaModel.build_residual_ffn(build_config("flash_mhf", size))
    kv_ffn = KVFFNModel.build_residual_ffn(build_config("kvffn", size))
    llama_norm, llama_mlp = LlamaRMSNorm(hidden, llama_config.rms_norm_eps), LlamaMLP(llama_config)
    for module in (flash, kv_ffn, llama_norm, llama_mlp):
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn_like(param) * 0.02 + (1.0 if param.dim() == 1 else 0.0))
        module.to(device, dtype).eval()
    return {
        "RMSNorm (Triton kernel)": lambda: rms_norm(x, norm_weight, 1e-6),
        "rotary embedding of the queries and keys (one Triton kernel)": lambda: rotate_pair(queries, keys, cos, sin)[1],
        "FlashMHF FFN block (projections + Triton decode kernel)": lambda: flash(x),
        "KV-FFN block (products + Triton activation kernel)": lambda: kv_ffn(x),
        "transformers' LlamaRMSNorm (PyTorch operations)": lambda: llama_norm(x),
        "transformers' Llama MLP (PyTorch operations)": lambda: llama_mlp(x),
    }


def largest_difference(fn) -> float:
    """The largest absolute difference between `fn`'s output with the kept compiled kernels and with Triton's launch
    (0: the same compiled kernels run, and none of them adds in an order that varies between launches)."""
    direct = fn()
    direct = fn()  # (the first call of a signature goes through Triton; the second launches the kept kernel)
    with tritons_own_launch():
        plain = fn()
    return (direct.float() - plain.float()).abs().max().item()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True, help="directory for triton_launch.{json,md}")
    parser.add_argument("--size", default="370M")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=200, help="calls per part, mode and round")
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, rounds=1, calls=1)  # (no round or call: no time per call, no median)
    try:
        get_preset(args.size)
    except ValueError as error:
        parser.error(f"--size: {error}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_triton_launch.py times launches on a CUDA GPU; none is visible")
    results = {"environment": environment(), "args": vars(args), "rows": []}
    with torch.no_grad():
        for batch in DECODE_BATCHES:
            for name, fn in parts(args.size, batch).items():
                difference = largest_difference(fn) if "Triton" in name else None
                reference = fn().float().abs().max().item()
                if difference is not None and difference > 1e-2 * reference:
                    raise RuntimeError(f"{name}, batch {batch}: the kept compiled kernel and Triton's launch disagree "
                                       f"by {difference} (largest output {reference})")
                kept, plain = [], []
                for _ in range(args.rounds):
                    kept.append(back_to_back_us(fn, args.calls))
                    with tritons_own_launch():
                        plain.append(back_to_back_us(fn, args.calls))
                ratios = [p / k for p, k in zip(plain, kept)]
                row = {"part": name, "batch": batch, "kept_kernel_us": median(kept), "triton_launch_us": median(plain),
                       "saved_us": median(plain) - median(kept), "plain_over_kept": median(ratios),
                       "kept_kernel_rounds_us": kept, "triton_launch_rounds_us": plain,
                       "largest_difference": difference, "largest_output": reference}
                results["rows"].append(row)
                log(f"b{batch} {name}: {row['kept_kernel_us']:.1f} us kept kernel, {row['triton_launch_us']:.1f} us "
                    f"Triton's launch ({row['plain_over_kept']:.2f}x)")
    write_report(args.out, "triton_launch", results, report(results))
    return results


def report(results: dict) -> str:
    env, args = results["environment"], results["args"]
    lines = [f"# Host time per call of our Triton launches on {env.get('device', 'unknown device')}", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}; {args['size']} preset's widths, bf16, one token "
             f"per row; {args['calls']} calls back to back per part and mode, {args['rounds']} alternating rounds "
             "(medians). `python kernels/bench_triton_launch.py`.", ""]
    rows = [[r["part"], r["batch"], f"{r['triton_launch_us']:.1f}", f"{r['kept_kernel_us']:.1f}",
             f"{r['saved_us']:.1f}", f"{r['plain_over_kept']:.2f}",
             "-" if r["largest_difference"] is None else f"{r['largest_difference']:.2g} ({r['largest_output']:.2g})"]
            for r in results["rows"]]
    lines += markdown_table(["part", "batch", "Triton's launch, us", "kept compiled kernel, us", "saved, us",
                             "ratio (median of rounds)", "largest difference (largest output)"], rows)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
