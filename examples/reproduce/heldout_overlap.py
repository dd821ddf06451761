"""How much of the held-out verse the training stream holds word for word (the study's data, `prepare_data.py`).

    python examples/reproduce/heldout_overlap.py --data .study-data --out DIR

The held-out documents come from regions of the corpus that training never reads, but the Gutenberg books repeat
poems (anthologies, editions), so a held-out line can still occur in the training text. Both token files are decoded
into documents (split at EOS) and lines; the script counts the held-out lines of more than `--min-chars` characters
that occur verbatim among the training lines, the held-out windows of `--window` consecutive lines that occur verbatim
in a training document, and the held-out documents with at least one such window. Lines are compared without the
whitespace around them: the tokenizer's decoding puts a space in front of each document's first line (the space its
encoding adds), which the same line inside another document does not have. Writes `overlap.json` and `overlap.md`
into DIR and prints the table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from token_shards import read_meta, read_tokens  # noqa: E402

from hf_memffn.atomic_write import write_atomic  # noqa: E402


def documents(tokens, eos_id: int) -> list[list[int]]:
    """Token ids split at `eos_id` (a last document without EOS kept)."""
    out, current = [], []
    for token in tokens.tolist():
        if token == eos_id:
            out.append(current)
            current = []
        else:
            current.append(token)
    if current:
        out.append(current)
    return out


def windows(lines: list[str], size: int) -> set[str]:
    return {"\n".join(lines[i:i + size]) for i in range(len(lines) - size + 1)}


def overlap(train_texts: list[str], heldout_texts: list[str], min_chars: int = 40, window: int = 4) -> dict:
    """The counts described in the module docstring, for decoded documents."""
    train_lines, train_windows = set(), set()
    for text in train_texts:
        lines = [line.strip() for line in text.split("\n")]
        train_lines.update(lines)
        train_windows |= windows(lines, window)
    long_lines = seen_lines = all_windows = seen_windows = seen_documents = 0
    for text in heldout_texts:
        lines = [line.strip() for line in text.split("\n")]
        long = [line for line in lines if len(line) > min_chars]
        long_lines += len(long)
        seen_lines += sum(line in train_lines for line in long)
        own = windows(lines, window)
        hits = sum(w in train_windows for w in own)
        all_windows += len(own)
        seen_windows += hits
        seen_documents += hits > 0
    return {"heldout_documents": len(heldout_texts), "train_documents": len(train_texts),
            "min_chars": min_chars, "window": window,
            "long_lines": long_lines, "long_lines_in_train": seen_lines,
            "windows": all_windows, "windows_in_train": seen_windows,
            "documents_with_a_window_in_train": seen_documents}


def markdown(result: dict, data: str) -> str:
    def share(part, whole):
        return f"{part:,} of {whole:,} ({100 * part / max(whole, 1):.1f}%)"

    return "\n".join([
        "# Held-out verse found word for word in the training stream", "",
        f"- data: `{data}` (training documents: {result['train_documents']:,}; held-out documents: "
        f"{result['heldout_documents']:,})", "",
        "| held-out unit | found verbatim in training |", "|---|---:|",
        f"| lines of more than {result['min_chars']} characters | "
        f"{share(result['long_lines_in_train'], result['long_lines'])} |",
        f"| windows of {result['window']} consecutive lines | {share(result['windows_in_train'], result['windows'])} |",
        f"| documents with at least one such window | "
        f"{share(result['documents_with_a_window_in_train'], result['heldout_documents'])} |", ""])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="the folder prepare_data.py wrote")
    parser.add_argument("--out", required=True, help="folder for overlap.json and overlap.md")
    parser.add_argument("--min-chars", type=int, default=40)
    parser.add_argument("--window", type=int, default=4)
    args = parser.parse_args(argv)
    if args.window < 1:
        raise ValueError(f"--window must be 1 or more consecutive lines, got {args.window}")
    if args.min_chars < 0:
        raise ValueError(f"--min-chars must be 0 or more, got {args.min_chars}")
    from transformers import AutoTokenizer

    meta = read_meta(args.data, "--data")
    tokenizer = AutoTokenizer.from_pretrained(args.data)
    eos = meta["tokenizer"]["eos_id"]
    texts = {split: [tokenizer.decode(doc) for doc in documents(read_tokens(args.data, split), eos)]
             for split in ("train", "heldout")}
    result = overlap(texts["train"], texts["heldout"], args.min_chars, args.window)
    result["data_sha256"] = {split: meta["splits"][split]["sha256"] for split in ("train", "heldout")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (("overlap.json", json.dumps(result, indent=2) + "\n"),
                       ("overlap.md", markdown(result, args.data))):
        write_atomic(out / name, text)
    print(markdown(result, args.data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
