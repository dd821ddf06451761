"""Pre-tokenized token shards: a folder holding a tokenizer, one flat uint16 token file per split and meta.json.

Layout written by `write_split` / `write_meta` (examples/reproduce/prepare_data.py builds such a folder):

    DIR/tokenizer.json, tokenizer_config.json, ...   the tokenizer (AutoTokenizer.from_pretrained(DIR))
    DIR/train.bin, DIR/heldout.bin, ...              token ids as little-endian uint16, documents joined by EOS
    DIR/meta.json                                    source, licence, token counts, how it was made

`pretrain.py --data-dir DIR` trains on `train.bin` and evaluates on `heldout.bin`, cut into blocks of `--block-size`
tokens; nothing but numpy and torch is needed to read them (no `datasets`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import numbers
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from hf_memffn.atomic_write import atomic_output, write_atomic

TOKEN_DTYPE = np.dtype("<u2")
META_FILE = "meta.json"


def split_path(folder: str | os.PathLike, split: str) -> Path:
    return Path(folder) / f"{split}.bin"


def write_split(folder: str | os.PathLike, split: str, documents: Iterable[list[int]], eos_id: int,
                max_tokens: int | None = None) -> int:
    """Write documents (token id lists) joined by `eos_id` to `DIR/split.bin`, stopping at `max_tokens`; returns the
    number of tokens written. An empty document adds nothing, no EOS either (`pretrain.pack_into_blocks` leaves
    blank documents out alike): each added a lone EOS, so the shards held runs of EOS that the text path's blocks of
    the same documents do not. Written under a temporary name and renamed, so a folder never holds half a split."""
    largest = int(np.iinfo(TOKEN_DTYPE).max)
    if isinstance(eos_id, bool) or not isinstance(eos_id, numbers.Integral) or not 0 <= eos_id <= largest:
        raise ValueError(f"eos_id={eos_id!r} is invalid; allowed: a token id from 0 to {largest} (the tokenizer's "
                         "eos_token_id, which separates the documents)")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, numbers.Integral)
                                   or max_tokens < 0):
        raise ValueError(f"max_tokens={max_tokens!r} is invalid; allowed: None (no cap) or an integer >= 0")
    written = 0
    with atomic_output(split_path(folder, split)) as temporary, temporary.open("wb") as handle:
        for ids in documents:
            ids = list(ids)
            if not ids:
                continue
            chunk = np.asarray(ids + [eos_id], dtype=np.int64)
            outside = chunk[(chunk < 0) | (chunk > np.iinfo(TOKEN_DTYPE).max)]
            if outside.size:
                raise ValueError(f"token id {int(outside[0])} does not fit uint16 (0 to 65535): use a vocabulary "
                                 "below 65536")
            if max_tokens is not None:
                chunk = chunk[: max_tokens - written]
            handle.write(chunk.astype(TOKEN_DTYPE).tobytes())
            written += chunk.size
            if max_tokens is not None and written >= max_tokens:
                break
    return written


def write_meta(folder: str | os.PathLike, meta: dict) -> None:
    write_atomic(Path(folder) / META_FILE, json.dumps(meta, indent=2) + "\n")


def read_meta(folder: str | os.PathLike, option: str = "--data-dir") -> dict:
    """The shards' meta.json; `option` names the command-line flag that gave `folder`, for the error."""
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise ValueError(f"{option}={str(folder)!r} has no {META_FILE}: "
                         "prepare it with examples/reproduce/prepare_data.py")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{option}={str(folder)!r}: {META_FILE} is not readable JSON ({error}); prepare the folder "
                         "again with examples/reproduce/prepare_data.py") from error
    if not isinstance(meta, dict):
        raise ValueError(f"{option}={str(folder)!r}: {META_FILE} holds a {type(meta).__name__}, not a JSON object; "
                         "prepare the folder again with examples/reproduce/prepare_data.py")
    return meta


def read_tokens(folder: str | os.PathLike, split: str) -> np.ndarray:
    """The token ids of `DIR/split.bin`, mapped read-only; a file of no whole number of tokens, or of another count
    than meta.json records for the split, is refused."""
    path = split_path(folder, split)
    if not path.is_file():
        available = sorted(p.stem for p in Path(folder).glob("*.bin"))
        raise ValueError(f"split={split!r} is not in {str(folder)!r}; available splits: {available}")
    size = path.stat().st_size
    if size == 0:  # numpy cannot map an empty file
        raise ValueError(f"split={split!r} of {str(folder)!r} holds no tokens ({path.name} is empty)")
    if size % TOKEN_DTYPE.itemsize:
        raise ValueError(f"split={split!r} of {str(folder)!r}: {path.name} holds {size} bytes, not a whole number of "
                         f"{TOKEN_DTYPE.itemsize}-byte tokens (a file cut short); prepare the folder again")
    expected = _tokens_in_meta(folder, split)
    if expected is not None and size // TOKEN_DTYPE.itemsize != expected:
        raise ValueError(f"split={split!r} of {str(folder)!r}: {path.name} holds {size // TOKEN_DTYPE.itemsize} "
                         f"tokens, but {META_FILE} records {expected} (a file cut short or replaced); prepare the "
                         "folder again")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def _tokens_in_meta(folder: str | os.PathLike, split: str) -> int | None:
    """The token count meta.json records for `split` (None where the folder has no meta.json or it lists none)."""
    if not (Path(folder) / META_FILE).is_file():
        return None
    splits = read_meta(folder, "folder").get("splits")
    entry = splits.get(split) if isinstance(splits, dict) else None
    tokens = entry.get("tokens") if isinstance(entry, dict) else None
    return tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None


class TokenBlocks(torch.utils.data.Dataset):
    """Consecutive, non-overlapping blocks of `block_size` tokens of a token file (the tail is dropped); each item is
    `{"input_ids": int64 array}` as `pretrain.collate_blocks` expects."""

    def __init__(self, tokens: np.ndarray, block_size: int, indices: range | None = None):
        if block_size <= 0:
            raise ValueError(f"block_size={block_size!r} must be a positive integer")
        self.tokens, self.block_size = tokens, block_size
        self.indices = range(len(tokens) // block_size) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        start = self.indices[index] * self.block_size
        return {"input_ids": np.asarray(self.tokens[start : start + self.block_size], dtype=np.int64)}

    def select(self, indices) -> TokenBlocks:
        """The blocks at `indices` (a range), like `datasets.Dataset.select`."""
        return TokenBlocks(self.tokens, self.block_size, self.indices[indices.start : indices.stop : indices.step])

    def __getstate__(self) -> dict:
        """A mapped token file is pickled as its path, not its tokens: DataLoader workers started by spawn or
        forkserver (macOS, Python 3.14's Linux default, --dataloader-multiprocessing-context) receive the dataset
        pickled, and each held a copy of the whole split in memory."""
        state = dict(self.__dict__)
        if isinstance(self.tokens, np.memmap) and isinstance(self.tokens.base, mmap.mmap):  # (the mapping itself)
            state["tokens"] = _MappedFile(self.tokens.filename, self.tokens.dtype.str, self.tokens.offset,
                                          self.tokens.shape)
        return state

    def __setstate__(self, state: dict) -> None:
        tokens = state["tokens"]
        if isinstance(tokens, _MappedFile):
            state["tokens"] = np.memmap(tokens.path, dtype=np.dtype(tokens.dtype), mode="r", offset=tokens.offset,
                                        shape=tokens.shape)
        self.__dict__.update(state)


@dataclasses.dataclass(frozen=True)
class _MappedFile:
    """Where a pickled `TokenBlocks` maps its tokens from again."""

    path: str
    dtype: str
    offset: int
    shape: tuple[int, ...]


def load_blocks(folder: str | os.PathLike, block_size: int, split: str = "train") -> TokenBlocks:
    return TokenBlocks(read_tokens(folder, split), block_size)
