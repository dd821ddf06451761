"""`hf-memffn analyze`'s command line: its arguments, which import neither torch nor the models (its `--help` and
argument errors answer at once); `run` imports the analysis itself (hf_memffn/analysis/cli.py)."""

from __future__ import annotations

import argparse
import json

from .cli_args import (existing_file, model_source, nonempty_int_list, output_dir, positive_float, positive_int,
                       tokenizer_source, torch_device)

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _edit(value: str) -> tuple[str, str]:
    if "=>" not in value:
        raise argparse.ArgumentTypeError(f"--edit {value!r}: expected 'PROMPT=>TARGET', e.g. 'The capital is=> Paris'")
    prompt, target = value.rsplit("=>", 1)
    if not target:
        raise argparse.ArgumentTypeError(f"--edit {value!r}: TARGET is empty; expected 'PROMPT=>TARGET', e.g. "
                                         "'The capital is=> Paris'")
    return prompt, target


def _override(value: str) -> tuple[str, object]:
    if "=" not in value:
        raise argparse.ArgumentTypeError(f"--override {value!r}: expected KEY=VALUE, e.g. ffn_kernel=torch")
    key, raw = value.split("=", 1)
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError:
        parsed = raw  # a plain string
    return key.strip(), parsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=model_source,
                        help="a saved model directory (or hub id already cached)")
    parser.add_argument("--texts", required=True, type=existing_file,
                        help="texts to analyse: one per line, or .jsonl with a 'text' field")
    parser.add_argument("--out", required=True, type=output_dir,
                        help="report directory (created; files in it are replaced)")
    parser.add_argument("--tokenizer", type=tokenizer_source,
                        help="tokenizer directory or hub id (default: MODEL_DIR's own)")
    parser.add_argument("--dataset", type=existing_file,
                        help="texts streamed for the top-triggering prefixes (default: --texts)")
    parser.add_argument("--device", default="auto", type=torch_device,
                        help="auto (cuda when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--layers", type=nonempty_int_list,
                        help="comma-separated layers to analyse (default: all), e.g. 0,11,23")
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--override", action="append", type=_override, default=[], metavar="KEY=VALUE",
                        help="config field set when loading (repeatable), e.g. ffn_kernel=torch")
    parser.add_argument("--max-length", type=positive_int, default=128,
                        help="tokens per text (longer texts are truncated)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--top-triggers", type=positive_int, default=8, help="top-triggering prefixes kept per cell")
    parser.add_argument("--cells-per-bank", type=positive_int, default=4, help="cells shown per memory bank")
    parser.add_argument("--top-tokens", type=positive_int, default=10, help="tokens shown per value projection")
    parser.add_argument("--clusters", type=positive_int, default=12, help="token clusters per token-memory layer")
    parser.add_argument("--edit-strength", type=positive_float, default=2.0,
                        help="residual move of an edit, in units of the final residual norm (default 2)")
    parser.add_argument("--cluster-vocabulary", action="store_true",
                        help="cluster the whole vocabulary, not only the tokens that occur in the texts")
    parser.add_argument(
        "--edit", action="append", type=_edit, metavar="PROMPT=>TARGET",
        help="memory edit to demonstrate (repeatable); default: one edit on the first text",
    )


def run(args: argparse.Namespace) -> int:
    from .analysis.cli import run as run_analysis

    return run_analysis(args)
