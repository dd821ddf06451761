"""The shared starting point of a multi-GPU comparison: a tokenizer trained on the corpus and a model from a preset.

    python examples/save_initial_weights.py CORPUS.jsonl OUT_DIR --arch flash_mhf --preset small \
        [--config-overrides ffn_kernel=triton] [--vocab-size 8192] [--seed 0]

OUT_DIR gets the model (float32, seeded) and its tokenizer, ready for `examples/pretrain.py --init-from OUT_DIR`,
so every engine of examples/ddp_check.sh starts from the same weights (ZeRO-3's own initialisation plays no part).
OUT_DIR must not exist; it appears whole or not at all (written under a temporary name, then renamed).
--config-overrides KEY=VALUE,... sets fields of the architecture's config (a key that is not one of its fields is
refused before any work; `ffn_kernel` is FlashMHFLlama's).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pretrain  # noqa: E402

from hf_memffn.atomic_write import atomic_output  # noqa: E402
from hf_memffn.cli_args import refuse_an_output_dir_that_cannot_be_written  # noqa: E402


def main(argv=None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", type=Path, help="JSON lines with a 'text' field")
    parser.add_argument("out", type=Path)
    parser.add_argument("--arch", default="flash_mhf", choices=pretrain.ARCHITECTURE_NAMES)
    parser.add_argument("--preset", default="small", choices=sorted(pretrain.PRESETS))
    parser.add_argument("--config-overrides", default="")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out.exists():  # (an interrupted write into it would leave a model without its tokenizer, or the reverse)
        raise ValueError(f"OUT_DIR={str(args.out)!r} exists: remove it or name a new folder")
    refuse_an_output_dir_that_cannot_be_written(args.out, "OUT_DIR")  # (before the tokenizer is trained)
    from hf_memffn.tokenization import MIN_VOCAB_SIZE

    if args.vocab_size < MIN_VOCAB_SIZE:  # (it failed after the corpus was read, naming `vocab_size`)
        raise ValueError(f"--vocab-size={args.vocab_size}: expected a vocabulary of {MIN_VOCAB_SIZE} tokens or more "
                         "(256 bytes and 3 special tokens)")
    overrides = pretrain.parse_overrides(args.config_overrides)
    if overrides:  # (their fields and values, before the tokenizer is trained)
        vocab_size, fields = pretrain.vocab_size_and_fields(overrides, 64 * 1024)
        pretrain.build_config(args.arch, args.preset, vocab_size, **fields)

    from transformers import AutoModelForCausalLM

    from hf_memffn.tokenization import train_tokenizer

    with args.corpus.open(encoding="utf-8") as handle:
        tokenizer = train_tokenizer(corpus_texts(handle, args.corpus), vocab_size=args.vocab_size)
    # the tokenizer's size padded for tensor-core friendly shapes, unless --config-overrides sets vocab_size
    vocab_size, fields = pretrain.vocab_size_and_fields(overrides, 64 * math.ceil(len(tokenizer) / 64))
    config = pretrain.build_config(args.arch, args.preset, vocab_size, tokenizer, **fields)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if hasattr(model, "attach_tokenizer"):  # our architectures keep the tokenizer's special ids in the config
        model.attach_tokenizer(tokenizer)
    pretrain.refuse_a_tokenizer_beyond_the_vocabulary(model, tokenizer)  # (a --config-overrides vocab_size too small)
    with atomic_output(args.out) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    print(f"initial weights: {args.arch} {args.preset}, {sum(p.numel() for p in model.parameters()):,} parameters -> {args.out}")
    return args.out


def corpus_texts(lines, corpus: Path):
    """The 'text' of each JSON line of CORPUS; blank lines hold no document. A line that is not a JSON object with a
    text is refused naming it (it failed with a bare `KeyError: 'text'` or a `JSONDecodeError` naming no file)."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"CORPUS={str(corpus)!r}: line {number} is not JSON ({error}); give JSON lines with a "
                             "'text' field") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"CORPUS={str(corpus)!r}: line {number} holds no 'text' string (found {text!r}); give "
                             "JSON lines with a 'text' field")
        yield text


if __name__ == "__main__":
    main()
