"""Scale check of the memory analysis: a randomly initialised Llama of real size (default ~1B parameters) analysed
end to end, timing each stage. Weights are random, so only the cost is meaningful, not the findings.

    python -m hf_memffn.analysis.scale_check --device cuda --out scale.json

Prints a table and writes JSON (device, model shape, seconds per stage, peak GPU memory).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_memffn.atomic_write import write_atomic
from hf_memffn.cli_args import output_dir, positive_int, torch_device
from hf_memffn.run_records import run_record_json
from hf_memffn.testing import tiny_tokenizer

from .analyze import analyze
from .report import write_report

HEAD_DIM = 64  # attention heads of 64 dimensions; 4 key-value heads (fewer where the heads are not a multiple of 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", type=torch_device,
                        help="cpu, cuda, cuda:1, ... (default: cuda when available)")
    parser.add_argument("--hidden-size", type=int, default=2048)
    parser.add_argument("--intermediate-size", type=positive_int, default=5632)
    parser.add_argument("--num-layers", type=positive_int, default=16)
    parser.add_argument("--vocab-size", type=positive_int, default=32000)
    parser.add_argument("--num-texts", type=positive_int, default=16)
    parser.add_argument("--dataset-texts", type=positive_int, default=256)
    parser.add_argument("--text-words", type=positive_int, default=100)
    parser.add_argument("--out", default="analysis-scale.json")
    parser.add_argument("--report-dir", type=output_dir, help="also write the HTML report here")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.hidden_size < HEAD_DIM or args.hidden_size % HEAD_DIM:
        parser.error(f"--hidden-size {args.hidden_size} is invalid; allowed: a multiple of {HEAD_DIM} (heads of "
                     f"{HEAD_DIM} dimensions), e.g. 2048")
    folder = os.path.dirname(os.path.abspath(args.out))
    if os.path.isdir(args.out) or not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        what = ("is a directory" if os.path.isdir(args.out) else "is in a folder that does not exist"
                if not os.path.isdir(folder) else f"is in a folder that is not writable by this user ({folder})")
        parser.error(f"--out {args.out} {what}; allowed: a file path in an existing folder, e.g. scale.json")
    tokenizer = tiny_tokenizer()
    if args.vocab_size < len(tokenizer):
        parser.error(f"--vocab-size {args.vocab_size} is invalid; allowed: an integer >= {len(tokenizer)} (the "
                     "texts' tokenizer has that many ids)")

    torch.manual_seed(0)
    num_heads = args.hidden_size // HEAD_DIM
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers, num_attention_heads=num_heads, num_key_value_heads=math.gcd(num_heads, 4),
        max_position_embeddings=2048,
    )
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    words = ["memory", "key", "value", "token", "layer", "head", "the", "a", "of", "is", "reads", "stores"]
    generator = torch.Generator().manual_seed(0)

    def text() -> str:
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (args.text_words,), generator=generator))

    texts = [text() for _ in range(args.num_texts)]
    dataset = [text() for _ in range(args.dataset_texts)]
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    start = time.perf_counter()
    report = analyze(model, tokenizer, texts, dataset=dataset, max_length=args.text_words * 2, batch_size=16)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    analyze_seconds = time.perf_counter() - start
    start = time.perf_counter()
    if args.report_dir:
        write_report(report, args.report_dir)
    report_seconds = time.perf_counter() - start
    num_cells = sum(bank["num_cells"] for bank in report["model"]["banks"])
    result = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": str(dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": args.num_layers,
        "memory_cells": num_cells,
        "dataset_tokens": sum(len(tokenizer(t)["input_ids"]) for t in dataset),
        "analyze_seconds": round(analyze_seconds, 2),
        "report_seconds": round(report_seconds, 2),
        "peak_gpu_memory_gib": (
            round(torch.cuda.max_memory_allocated() / 2**30, 2) if args.device.startswith("cuda") else None
        ),
        "model_gpu_memory_gib": round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, 2),
    }
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    write_atomic(args.out, run_record_json(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
