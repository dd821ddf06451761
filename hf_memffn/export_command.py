"""`hf-memffn export-tols`'s command line: its arguments, which import neither torch nor the models (its `--help`
and argument errors answer at once); `run` imports the export itself (hf_memffn/conversion/export.py)."""

from __future__ import annotations

import argparse
import re

from .cli_args import existing_file, int_list, model_source, output_dir, positive_int, torch_device
from .hub import check_repo_id

FLOAT_DTYPE_NAMES = ("fp32", "fp16", "bf16")  # token_lookup.FLOAT_DTYPES's (tests/test_packaging.py checks them)
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's units


def shard_size_bytes(max_shard_size) -> int:
    """A shard size in bytes: a positive integer, or a string of a positive number with an optional unit (B, KB, MB,
    GB, TB, decimal as in huggingface_hub and transformers): 500000, "500000", "2GB", "1.5 MB"."""
    nbytes = None
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
        nbytes = max_shard_size
    elif isinstance(max_shard_size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]?B)?\s*", max_shard_size, flags=re.IGNORECASE)
        if match:
            nbytes = int(float(match.group(1)) * SIZE_UNITS[(match.group(2) or "").upper()])
    if nbytes is None or nbytes < 1:
        raise ValueError(f"max_shard_size={max_shard_size!r} is invalid; allowed: a positive number of bytes or a "
                         "size such as '2GB', '500MB', '64KB'")
    return nbytes


def _shard_size_argument(text: str) -> int:
    try:
        return shard_size_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("max_shard_size=", "")) from None


def _repo_id_argument(text: str) -> str:
    try:
        return check_repo_id(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).replace("repo_id=", "")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", type=model_source,
                        help="checkpoint directory of a MemoryLLM / FlexMemoryLLM model")
    parser.add_argument("out_dir", metavar="OUT_DIR", type=output_dir,
                        help="directory for the table (may be the checkpoint directory itself)")
    parser.add_argument("--format", default="bf16", choices=["fp32", "fp16", "bf16", "int8", "int4", "lowrank"])
    parser.add_argument("--group-size", type=positive_int, default=None,
                        help="int8/int4: values per scale (default 128/64)")
    parser.add_argument("--rank", type=positive_int, default=None, help="lowrank: rank of every layer")
    parser.add_argument("--energy", type=float, default=None, help="lowrank: keep this fraction of each layer's energy")
    parser.add_argument("--factor-dtype", default=None, choices=list(FLOAT_DTYPE_NAMES),
                        help="lowrank: stored dtype (default bf16)")
    parser.add_argument("--drop-layers", type=int_list, default=[],
                        help="comma-separated layers not stored, e.g. 8,9,10")
    parser.add_argument("--batch-size", type=positive_int, default=1024, help="tokens per batch (= rows per block)")
    parser.add_argument("--max-shard-size", default="2GB", type=_shard_size_argument,
                        help="tensor bytes per shard file (its header adds about 1KB): a number of bytes or a size "
                             "such as 2GB, 500MB (default 2GB)")
    parser.add_argument("--device", default=None, type=torch_device,
                        help="cpu, cuda, cuda:1 (default: cuda if available)")
    parser.add_argument("--model-dtype", default=None, choices=list(FLOAT_DTYPE_NAMES),
                        help="dtype to load the model in (default: the checkpoint's)")
    parser.add_argument("--eval-text", default=None, type=existing_file,
                        help="text file for the held-out loss in compute vs lookup mode")
    parser.add_argument("--push-to-hub", default=None, metavar="REPO_ID", type=_repo_id_argument,
                        help="upload the table to this Hub repo")
    parser.add_argument("--no-progress", action="store_true")


def run(args: argparse.Namespace) -> int:
    from .conversion.export import run as run_export

    return run_export(args)
