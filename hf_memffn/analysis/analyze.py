"""One call that runs every instrument and returns a JSON-ready report: `analyze(model, tokenizer, texts)`.

The report (a plain dict) has these sections:

* `model`: class, type and the memory banks (name, layer, kind, number of cells);
* `texts`: for each text, its tokens and, per bank, the top cells of every token, the sparsity and the number of
  cells that carry 90% of the coefficient mass (and, for FlashMHF, the mass share of each head and sub-network);
* `banks`: per bank, the averages of those statistics over all texts and the key-value agreement;
* `cells`: per bank, the most strongly triggered cells, each with its top-triggering prefixes over the dataset
  and the tokens its value vector promotes;
* `contributions`: per layer, the norms of the attention, FFN and token-memory (lookup-table) outputs;
* `token_memory` (MemoryLLM / FlexMemoryLLM): per analysed layer, the token clusters and the most shared cells;
* `edits`: memory edits and their effect on next-token predictions (reverted after measuring).

`write_report` (report.py) renders it as JSON + a self-contained HTML page with plots.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..cli_args import decode_utf8
from .arguments import check_at_least, check_ids, check_strength, check_token_memory_layers
from .coefficients import coefficients_for_ids, summarize_coefficients
from .editing import edit_next_token
from .memory_banks import MemoryBank, decoder_of, memory_banks, model_device, output_embedding
from .token_memory import MAX_CLUSTERED_TOKENS, layer_contributions, token_clusters, token_memory_map
from .triggers import top_triggering_prefixes
from .vocabulary import key_value_agreement, project_values


def iter_texts(path: str | Path) -> Iterator[str]:
    """The texts of a file, read a line at a time: one per line, or a `.jsonl` file with a "text" field per line.
    Blank lines are skipped. Lines end at a line feed (or CR LF) only: a form feed or a Unicode line separator inside
    a text stays in it. A byte order mark at the start (as some Windows editors save UTF-8) is not part of the first
    text."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"texts file {str(path)!r} does not exist")
    records = path.suffix.lower() == ".jsonl"  # (`texts.JSONL` too, as Windows tools may name it)
    offset = 0
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):  # (a binary file's lines end at line feeds only)
            line = decode_utf8(raw, str(path), number, offset).removesuffix("\n").removesuffix("\r")
            offset += len(raw)
            if not line.strip():
                continue
            if not records:
                yield line
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: invalid JSON: {error.msg} (column {error.colno})") from None
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise ValueError(f"{path}:{number}: each .jsonl line must be an object with a string field 'text'")
            yield record["text"]


def read_texts(path: str | Path) -> list[str]:
    """The texts of a file (see `iter_texts`), as a list; a ValueError if it holds none."""
    texts = list(iter_texts(path))
    if not texts:
        raise ValueError(f"texts file {str(path)!r} holds no text")
    return texts


def stream_texts(path: str | Path) -> Iterator[str]:
    """The texts of a file (see `iter_texts`), checked through to the end now (a bad line or a file of no text is
    refused before the long work) and read again, a line at a time, as they are iterated: a large --dataset file is
    never held in memory whole."""
    if not sum(1 for _ in iter_texts(path)):  # (every line is decoded and checked on the way, and none is kept)
        raise ValueError(f"texts file {str(path)!r} holds no text")
    return iter_texts(path)


def _byte_level_alphabet() -> dict[str, int]:
    """The byte each character of a byte-level BPE's vocabulary (GPT-2's alphabet: `Ġ` for a space, ...) stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + n): byte for n, byte in enumerate(others)}}


BYTE_LEVEL_ALPHABET = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def token_bytes(piece: str) -> bytes | None:
    """The bytes a vocabulary entry stands for: a SentencePiece byte token (`<0xE4>`) or a byte-level BPE piece
    (`Ġä¸`); None for any other entry."""
    byte = _BYTE_FALLBACK.fullmatch(piece)
    if byte:
        return bytes([int(byte.group(1), 16)])
    if piece and all(character in BYTE_LEVEL_ALPHABET for character in piece):
        return bytes(BYTE_LEVEL_ALPHABET[character] for character in piece)
    return None


_WORD_START = "\u2581"  # SentencePiece's mark of the space before a word (`▁the`)


class TokenNames:
    """Readable strings for token ids (decoded one by one, so byte-level markers disappear). A token holding part of
    a character's UTF-8 bytes decodes alone to U+FFFD whatever the bytes; it is named by its bytes instead, those of
    no whole character as escapes (`Ġä¸` is ` \\xe4\\xb8`), so the pieces of different characters stay apart.
    A SentencePiece token keeps the spaces its `▁` marks stand for, which the decoder of Llama's and Mistral's
    tokenizers strips at the start of a text (so of a token decoded alone): `▁the` is ` the`, unlike `the`."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        token_id = int(token_id)
        if token_id not in self._cache:
            name = self.tokenizer.decode([token_id])
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            piece = piece if isinstance(piece, str) else ""
            if "\ufffd" in name:
                data = token_bytes(piece)
                if data is not None:
                    name = data.decode("utf-8", errors="backslashreplace")
            if piece.startswith(_WORD_START) and not name.startswith(_WORD_START):  # (a decoder that reads the marks)
                marks, spaces = len(piece) - len(piece.lstrip(_WORD_START)), len(name) - len(name.lstrip(" "))
                name = " " * (marks - spaces) + name
            self._cache[token_id] = name
        return self._cache[token_id]

    def many(self, ids: Iterable[int]) -> list[str]:
        return [self(i) for i in ids]


def encode(tokenizer, texts: Iterable[str], max_length: int, num_embeddings: int, what: str) -> Iterable[list[int]]:
    for index, text in enumerate(texts):
        ids = tokenizer(text, truncation=True, max_length=max_length)["input_ids"]
        yield check_ids(ids, num_embeddings, f"{what} {index}")


def _text_section(model, banks, token_lists, names: TokenNames, top_cells: int) -> tuple[list[dict], dict]:
    texts, totals = [], {bank.name: {"sparsity": 0.0, "cells_for_mass": 0.0, "tokens": 0} for bank in banks}
    group_mass: dict[str, list[torch.Tensor]] = {}
    for ids in tqdm(token_lists, desc="memory coefficients", unit="text"):
        coefficients = coefficients_for_ids(model, torch.as_tensor(ids), banks)
        per_bank = {}
        for bank in banks:
            summary = summarize_coefficients(coefficients[bank.name], bank, top_k=top_cells)
            per_bank[bank.name] = {
                "top_cells": [
                    [[bank.cell_label(c), round(float(v), 5)] for c, v in zip(cells, values)]
                    for cells, values in zip(summary.top_cells.tolist(), summary.top_values.tolist())
                ],
                "sparsity": summary.sparsity.tolist(),
                "cells_for_mass": summary.cells_for_mass.tolist(),
            }
            totals[bank.name]["sparsity"] += float(summary.sparsity.sum())
            totals[bank.name]["cells_for_mass"] += float(summary.cells_for_mass.float().sum())
            totals[bank.name]["tokens"] += len(ids)
            if summary.group_mass is not None:
                group_mass.setdefault(bank.name, []).append(summary.group_mass)
        texts.append({"tokens": names.many(ids), "banks": per_bank})
    stats = {}
    for bank in banks:
        n = max(totals[bank.name]["tokens"], 1)
        stats[bank.name] = {
            "mean_sparsity": totals[bank.name]["sparsity"] / n,
            "mean_cells_for_90pct_mass": totals[bank.name]["cells_for_mass"] / n,
        }
        if bank.name in group_mass:
            stats[bank.name]["head_subnetwork_mass"] = torch.stack(group_mass[bank.name]).mean(0).tolist()
    return texts, stats


def _cells_section(
    model, banks, dataset_ids, names: TokenNames, top_triggers: int, cells_per_bank: int, top_tokens: int,
    agreement_cells: int, batch_size: int, pad_token_id: int, stats: dict, vocabulary: int,
) -> dict:
    index = top_triggering_prefixes(
        model, dataset_ids, banks, k=top_triggers, batch_size=batch_size, pad_token_id=pad_token_id
    )
    generator = torch.Generator().manual_seed(0)
    section = {}
    for bank in banks:
        triggers = index.triggers[bank.name]
        best_score = torch.tensor([cell[0].coefficient if cell else float("-inf") for cell in triggers])
        shown = best_score.topk(min(cells_per_bank, bank.num_cells)).indices
        sample = torch.randperm(bank.num_cells, generator=generator)[:agreement_cells]
        cells = torch.cat([shown, sample[~torch.isin(sample, shown)]])
        projection = project_values(model, bank, cells, top_n=top_tokens, vocab_size=vocabulary)
        agreement = key_value_agreement(projection, [triggers[int(c)] for c in cells])
        sampled = agreement[torch.isin(cells, sample)]  # the bank's figure: the random sample only (unbiased)
        valid = sampled[~sampled.isnan()]
        stats[bank.name]["key_value_agreement"] = float(valid.mean()) if len(valid) else None
        stats[bank.name]["agreement_cells"] = int(len(valid))
        shown_cells = []
        for row in range(len(shown)):
            cell = int(cells[row])
            shown_cells.append(
                {
                    "cell": bank.cell_label(cell),
                    "index": cell,
                    "promotes": names.many(projection.top_ids[row].tolist()),
                    "promotes_logits": [round(v, 4) for v in projection.top_logits[row].tolist()],
                    "demotes": names.many(projection.bottom_ids[row].tolist()),
                    "agreement": None if agreement[row].isnan() else float(agreement[row]),
                    "triggers": [
                        {
                            "coefficient": round(t.coefficient, 5),
                            "text_index": t.text_index,
                            "position": t.position,
                            "prefix": names.many(t.prefix_ids),
                            "next": names(t.next_id),
                        }
                        for t in triggers[cell]
                    ],
                }
            )
        section[bank.name] = shown_cells
    return section


def _token_memory_section(
    model, names: TokenNames, layers: Sequence[int], num_clusters: int, cluster_tokens: torch.Tensor, vocabulary: int
) -> dict:
    section = {}
    maps = {m.layer: m for m in token_memory_map(model, layers=layers, top_k=1, vocab_size=vocabulary)}
    for layer in layers:
        clusters = token_clusters(model, layer, num_clusters=num_clusters, token_ids=cluster_tokens)
        top1 = maps[layer].top_cells[:, 0]
        counts = torch.bincount(top1)
        busiest = counts.topk(min(5, int((counts > 0).sum()))).indices.tolist()
        section[str(layer)] = {
            "top_cell_per_token": top1.tolist(),  # the token-to-memory map over the whole vocabulary
            "cells_used_as_top1": int((counts > 0).sum()),
            "busiest_cells": [
                {
                    "cell": c,
                    "num_tokens": int(counts[c]),
                    "tokens": names.many(maps[layer].tokens_of_cell(c)[:20].tolist()),
                }
                for c in busiest
            ],
            "clusters": [
                {
                    "size": len(cluster.tokens),
                    "cohesion": round(cluster.cohesion, 4),
                    "shared_cells": cluster.shared_cells,
                    "tokens": names.many(cluster.tokens[:30]),
                }
                for cluster in clusters
            ],
        }
    return section


def _encode_edits(
    tokenizer, edits: Sequence[tuple[str, str]], num_embeddings: int
) -> list[tuple[str, str, list[int], list[int]]]:
    """`(prompt, target, prompt ids, target ids)` of each edit, or an error naming the first bad one."""
    encoded = []
    for index, edit in enumerate(edits):
        if not (isinstance(edit, (tuple, list)) and len(edit) == 2 and all(isinstance(part, str) for part in edit)):
            raise ValueError(f"edits[{index}]={edit!r}: expected a (prompt, target) pair of strings")
        prompt, target = edit
        prompt_ids = check_ids(tokenizer(prompt)["input_ids"], num_embeddings, f"edit prompt {prompt!r}")
        target_ids = check_ids(tokenizer(target, add_special_tokens=False)["input_ids"], num_embeddings,
                               f"edit target {target!r}")
        # (the prompt's own tokens: an empty prompt is `<s>` alone, and the edit would rewrite the start token's memory)
        if not tokenizer(prompt, add_special_tokens=False)["input_ids"] or not target_ids:
            raise ValueError(f"edit ({prompt!r}, {target!r}): prompt and target must both contain tokens")
        if len(target_ids) > 1:  # (an edit raises the probability of one next token: it has no multi-token target)
            pieces = [tokenizer.decode([token]) for token in target_ids]
            raise ValueError(f"edit ({prompt!r}, {target!r}) (--edit, or edits[{index}]): the target is "
                             f"{len(target_ids)} tokens {pieces!r}; allowed: a target of one token, the next token "
                             f"the edit promotes (e.g. {pieces[0]!r})")
        encoded.append((prompt, target, prompt_ids, target_ids))
    return encoded


def _edit_section(
    model, names: TokenNames, edits: Sequence[tuple[str, str, list[int], list[int]]], strength: float
) -> list[dict]:
    results = []
    for prompt, _target, prompt_ids, target_ids in edits:
        result = edit_next_token(model, torch.as_tensor(prompt_ids), target_ids[0], strength=strength)
        result.edit.revert()
        results.append(
            {
                "prompt": prompt,
                "edited_token": names(prompt_ids[-1]),
                "target": names(target_ids[0]),
                "method": result.method,
                "location": result.location,
                "target_probability_before": result.target_probability_before,
                "target_probability_after": result.target_probability_after,
                "top_before": [[names(i), p] for i, p in result.top_before],
                "top_after": [[names(i), p] for i, p in result.top_after],
            }
        )
    return results


def default_edit(model, tokenizer, text: str, max_prompt_tokens: int = 12, target_rank: int = 10) -> tuple[str, str]:
    """A demonstration edit: the first words of `text`, and the token the model ranks `target_rank`-th after them (in
    a vocabulary of fewer tokens, the last-ranked one). A special token, or one whose text does not tokenize back to
    it alone, is passed over for the next rank, then for the ranks above."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    prompt = tokenizer.decode(ids)
    prompt_ids = torch.as_tensor(tokenizer(prompt)["input_ids"])
    device = model_device(model)
    with torch.no_grad():
        logits = model(input_ids=prompt_ids.reshape(1, -1).to(device)).logits[0, -1, : len(tokenizer)]
    ranked = logits.argsort(descending=True).tolist()
    start = min(target_rank, len(ranked)) - 1
    special = set(tokenizer.all_special_ids)  # (`<pad>` or `</s>` as the answer demonstrates nothing)
    for token_id in ranked[start:] + ranked[:start][::-1]:
        if token_id in special:
            continue
        target = tokenizer.decode([token_id])
        if tokenizer(target, add_special_tokens=False)["input_ids"] == [token_id]:  # survives re-encoding, alone
            return prompt, target
    raise ValueError("no token of the vocabulary can serve as the demonstration edit's target")


def _restores_training_mode(function):
    """`function(model, ...)` leaves every module of `model` in the mode it found it in (it may switch to eval)."""

    @functools.wraps(function)
    def wrapper(model: torch.nn.Module, *args, **kwargs):
        modes = [(module, module.training) for module in model.modules()]
        try:
            return function(model, *args, **kwargs)
        finally:
            for module, training in modes:
                module.training = training

    return wrapper


@_restores_training_mode
def analyze(
    model: torch.nn.Module,
    tokenizer,
    texts: Iterable[str],
    dataset: Iterable[str] | None = None,
    max_length: int = 128,
    batch_size: int = 8,
    top_cells: int = 5,
    top_triggers: int = 8,
    cells_per_bank: int = 4,
    top_tokens: int = 10,
    agreement_cells: int = 256,
    num_clusters: int = 12,
    memory_layers: Sequence[int] | None = None,
    cluster_vocabulary: bool = False,
    edits: Sequence[tuple[str, str]] | None = None,
    edit_strength: float = 2.0,
    banks: Sequence[MemoryBank] | None = None,
) -> dict:
    """Runs every instrument on `model` (in eval mode; its mode is restored) and returns the report dict (see the
    module docstring).

    `texts` (a list, or any iterable of strings, read once into a list) are analysed token by token; `dataset`
    (default: `texts`) is streamed for the top-triggering prefixes.
    `edits`: (prompt, target) pairs; default: one demonstration edit on the first text (see `default_edit`);
    `edit_strength`: see `edit_next_token`.
    `cluster_vocabulary`: cluster the tokenizer's whole vocabulary (its first 8192 ids) instead of the tokens that occur
    in the texts and the dataset (untrained tokens of a small model otherwise form large meaningless clusters).
    Value projections and the token-to-memory map rank the tokenizer's ids only (`len(tokenizer)`), not the rows of a
    padded embedding that no token uses.
    `memory_layers`: token-memory layers to cluster (default: first, middle and last of the analysed ones).
    `banks`: the memory banks to analyse (default: all; see `memory_banks` and `select_banks`).
    """
    for name, value in (("texts", texts), ("dataset", dataset)):
        if isinstance(value, str):  # (iterated, a string gives one text per character)
            raise ValueError(f"{name} is one string: expected a list of texts (for one text, [text])")
    texts = list(texts)  # (read twice, and as the dataset when none is given: an iterator would be empty by then)
    if not texts:
        raise ValueError("texts is empty: give at least one text to analyse")
    check_at_least(1, max_length=max_length, batch_size=batch_size, top_cells=top_cells, top_triggers=top_triggers,
                   cells_per_bank=cells_per_bank, top_tokens=top_tokens, num_clusters=num_clusters)
    check_at_least(0, agreement_cells=agreement_cells)
    check_strength(edit_strength, "edit_strength")
    if memory_layers is not None:
        check_token_memory_layers(memory_layers, [bank.layer for bank in memory_banks(model) if bank.context_free],
                                  "memory_layers")
    output_embedding(model)  # (refuses a decoder without one before the long work)
    model.eval()
    banks = memory_banks(model) if banks is None else list(banks)
    names = TokenNames(tokenizer)
    num_embeddings = decoder_of(model).embed_tokens.weight.shape[0]
    token_lists = [ids for ids in encode(tokenizer, texts, max_length, num_embeddings, "text") if ids]
    if not token_lists:
        raise ValueError("texts give no tokens: every text is empty after tokenization")
    # the edits are measured last, but checked (and the demonstration edit chosen) before the long work
    edits = _encode_edits(tokenizer, [default_edit(model, tokenizer, texts[0])] if edits is None else edits,
                          num_embeddings)
    # (the id only fills the positions after a short text, which the attention mask leaves out and no statistic
    # reads: a pad token the tokenizer added past the embedding's rows, which the model cannot embed, gives way to 0)
    pad_token_id = tokenizer.pad_token_id
    if pad_token_id is None or not 0 <= pad_token_id < num_embeddings:
        pad_token_id = 0
    # (the ids the tokenizer has: an output embedding padded to a round size has rows no token uses, which would be
    # ranked among the tokens a value promotes and shown as empty names)
    vocabulary = len(tokenizer)
    report: dict = {
        "model": {
            "class": type(model).__name__,
            "model_type": getattr(model.config, "model_type", None),
            "num_layers": len(decoder_of(model).layers),
            "banks": [
                {
                    "name": b.name,
                    "layer": b.layer,
                    "kind": b.kind,
                    "num_cells": b.num_cells,
                    "cell_shape": list(b.cell_shape),
                    "cell_axes": list(b.cell_axes),
                }
                for b in banks
            ],
        }
    }
    report["texts"], stats = _text_section(model, banks, token_lists, names, top_cells)
    seen_tokens = {token for ids in token_lists for token in ids}

    def remember_tokens(lists: Iterable[list[int]]) -> Iterable[list[int]]:
        for ids in lists:
            seen_tokens.update(ids)
            yield ids

    dataset_ids = remember_tokens(encode(tokenizer, texts if dataset is None else dataset, max_length, num_embeddings,
                                         "text" if dataset is None else "dataset text"))
    report["cells"] = _cells_section(
        model, banks, dataset_ids, names, top_triggers, cells_per_bank, top_tokens, agreement_cells, batch_size,
        pad_token_id, stats, vocabulary,
    )
    report["banks"] = stats
    contributions = layer_contributions(model, token_lists)
    report["contributions"] = {
        "attention": contributions.attention,
        "ffn": contributions.ffn,
        "memory": contributions.memory,
        "memory_share": contributions.memory_share,
        "ffn_share": contributions.ffn_share,
    }
    token_memory_layers = [bank.layer for bank in banks if bank.context_free]
    if token_memory_layers:
        if memory_layers is None:
            ends = (0, len(token_memory_layers) // 2, -1)
            memory_layers = sorted({token_memory_layers[i] for i in ends})
        if cluster_vocabulary:
            cluster_tokens = torch.arange(min(vocabulary, num_embeddings, MAX_CLUSTERED_TOKENS))
            clustered = "vocabulary"
        else:
            cluster_tokens = torch.tensor(sorted(seen_tokens - set(tokenizer.all_special_ids)), dtype=torch.long)
            clustered = "tokens seen in the texts" if len(cluster_tokens) else "none: every token is a special one"
        report["token_memory"] = _token_memory_section(model, names, list(memory_layers), num_clusters, cluster_tokens,
                                                         vocabulary)
        report["token_memory_clustered"] = clustered
    report["edits"] = _edit_section(model, names, edits, edit_strength)
    return report
