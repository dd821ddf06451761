"""What one autotuning of the Triton forward for every size would cost, against its tuning per size class.

    PYTHONPATH=. python kernels/compare_inference_tuning.py --out DIR [--rounds 5]   # a CUDA GPU

The autotuned Triton forward is tuned per power-of-two size class (`flash_mhf_triton._tune_bucket`), in inference as
in training, so the first prompt of a new class waits while the autotuner benchmarks each configuration. Tuning once
and keeping that pick for every size would spare that wait. This script measures what the single pick would cost,
where the Triton forward runs every size (head sizes without the Gluon forward, 64 and 256, and float32 at 128). For
each case it tunes the smallest class (2048 tokens of 8 heads, 2 ** 14 rows); then, at each size, it tunes that size's
class and times the inference forward with the class's own pick and with the smallest class's, in turn over
``--rounds`` rounds (``harness.bench_ms``), comparing the two outputs.

Writes <out>/inference_tuning.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import torch  # noqa: E402

from harness import (  # noqa: E402
    bench_ms, environment, log, markdown_table, median, output_folder, refuse_counts_below, rel_err, write_report,
)

from hf_memffn import flash_mhf_triton  # noqa: E402

# (head size, dtype): the shapes at which the Triton forward, not the Gluon one, runs every size on Hopper
CASES = [(64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)]
HEADS, NUM_SUBNETWORKS, SUBNETWORK_SIZE = 8, 4, 512
# tokens of one sequence: 8 heads x 2048 = 2 ** 14 rows (the smallest tuned size) up to 2 ** 18, one per size class
TOKENS = [2048, 4096, 8192, 16384, 32768]


def layer_inputs(head_dim: int, dtype: torch.dtype, tokens: int, seed: int = 0):
    """q ``[1, HEADS, tokens, head_dim]``, K, U, V and float32 gates normalised over the sub-networks."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    q = randn(1, HEADS, tokens, head_dim)
    weights = [randn(HEADS, NUM_SUBNETWORKS, SUBNETWORK_SIZE, head_dim, scale=head_dim**-0.5) for _ in range(3)]
    gates = torch.rand(1, HEADS, tokens, NUM_SUBNETWORKS, device="cuda", generator=generator)
    return q, *weights, gates / gates.sum(-1, keepdim=True)


def picked_key(head_dim: int, dtype: torch.dtype, bucket: int) -> tuple:
    """The launch key of `flash_mhf_triton._PICKED` for this case's forward in ``bucket``."""
    keys = [key for key in flash_mhf_triton._PICKED
            if key[:4] == ("forward", head_dim, SUBNETWORK_SIZE, bucket) and key[4] == dtype]
    if len(keys) != 1:
        raise RuntimeError(f"expected one tuned forward for d_h={head_dim}, {dtype}, bucket {bucket}: {keys}")
    return keys[0]


def describe(picked) -> str:
    config = picked[0]
    return (f"BLOCK_L {config['BLOCK_L']}, BLOCK_N {config['BLOCK_N']}, {config['num_warps']} warps, "
            f"{config['num_stages']} stages")


def compare_case(head_dim: int, dtype: torch.dtype, rounds: int) -> list[dict]:
    def forward(inputs):
        return flash_mhf_triton.triton_forward(*inputs, inference=True)

    first = layer_inputs(head_dim, dtype, TOKENS[0])
    forward(first)  # tunes the smallest class
    smallest = flash_mhf_triton._tune_bucket(TOKENS[0] * HEADS)
    single = flash_mhf_triton._PICKED[picked_key(head_dim, dtype, smallest)]
    rows = []
    for tokens in TOKENS:
        inputs = layer_inputs(head_dim, dtype, tokens, seed=tokens)
        problem = flash_mhf_triton._problem(inputs[0], inputs[1])
        if not flash_mhf_triton._autotuned(problem) or flash_mhf_triton.forward_kernel(*inputs[:2]) != "triton":
            raise RuntimeError(f"d_h={head_dim}, {dtype}, {tokens} tokens: not the autotuned Triton forward")
        bucket = flash_mhf_triton._tune_bucket(problem["total_rows"] * problem["kv_heads"])
        forward(inputs)  # tunes this size class
        key = picked_key(head_dim, dtype, bucket)
        per_class = flash_mhf_triton._PICKED[key]
        times, outputs = {"single": [], "per_class": []}, {}
        for round_index in range(rounds):
            for name in (("single", "per_class") if round_index % 2 == 0 else ("per_class", "single")):
                flash_mhf_triton._PICKED[key] = single if name == "single" else per_class
                outputs[name] = forward(inputs)
                times[name].append(bench_ms(lambda: forward(inputs)))
        flash_mhf_triton._PICKED[key] = per_class
        ratios = [c / s for c, s in zip(times["per_class"], times["single"])]
        row = {"head_dim": head_dim, "dtype": str(dtype).replace("torch.", ""), "tokens": tokens, "bucket": bucket,
               "single_pick": describe(single), "per_class_pick": describe(per_class),
               "same_pick": single[0] == per_class[0], "single_ms": median(times["single"]),
               "per_class_ms": median(times["per_class"]), "ratio": median(ratios), "ratio_low": min(ratios),
               "ratio_high": max(ratios), "rel_err": rel_err(outputs["per_class"], outputs["single"])}
        log(f"d_h={head_dim} {row['dtype']} {tokens}: {row['single_pick']} {row['single_ms']:.4f} ms, "
            f"{row['per_class_pick']} {row['per_class_ms']:.4f} ms")
        rows.append(row)
    return rows


def to_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# One autotuning of the inference forward for every size, against one per size class, {env['device']}",
             "",
             f"torch {env.get('torch')}, triton {env.get('triton')}; `{results['command']}`; {HEADS} heads, "
             f"{NUM_SUBNETWORKS} sub-networks of {SUBNETWORK_SIZE}, one sequence; x = per-class pick's time / the "
             "single pick's (median of the rounds' ratios, lowest-highest; below 1: tuning per class would be "
             "faster)", ""]
    lines += markdown_table(
        ["d_h", "dtype", "tokens", "single pick (the 2048 tokens' class)", "the size class's pick", "single ms",
         "per-class ms", "x", "rel. err. between the two"],
        [[r["head_dim"], r["dtype"], r["tokens"], r["single_pick"], "same" if r["same_pick"] else r["per_class_pick"],
          f"{r['single_ms']:.4f}", f"{r['per_class_ms']:.4f}",
          f"{r['ratio']:.3f} ({r['ratio_low']:.3f}-{r['ratio_high']:.3f})", f"{r['rel_err']:.1e}"]
         for r in results["rows"]])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, rounds=1)
    if not torch.cuda.is_available() or flash_mhf_triton.triton_interpreting():
        raise SystemExit("compare_inference_tuning.py times the autotuned Triton forward: it needs a CUDA GPU")
    results = {"environment": environment(), "command": "python kernels/compare_inference_tuning.py "
               + " ".join(sys.argv[1:] if argv is None else argv), "rows": []}
    for head_dim, dtype in CASES:
        results["rows"] += compare_case(head_dim, dtype, args.rounds)
    markdown = to_markdown(results)
    write_report(args.out, "inference_tuning", results, markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    main()
