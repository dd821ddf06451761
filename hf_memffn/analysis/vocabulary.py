"""Value vectors read in the vocabulary: `logits = lm_head(final_norm(v_i))` gives the tokens a memory promotes.

`key_value_agreement` compares those tokens with the next tokens of the cell's top-triggering prefixes (how often the
value predicts what follows the pattern its key detects).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .arguments import check_at_least, check_cells
from .memory_banks import MemoryBank, decoder_of, output_embedding
from .triggers import Trigger


@dataclass
class ValueProjection:
    """Top and bottom tokens of the vocabulary projection of some cells' value vectors."""

    cells: torch.Tensor  # [n] flat cell indices
    top_ids: torch.Tensor  # [n, top_n] tokens promoted when the coefficient is positive, best first
    top_logits: torch.Tensor
    bottom_ids: torch.Tensor  # [n, top_n] tokens promoted when the coefficient is negative (lowest logits first)
    bottom_logits: torch.Tensor


def vocabulary_logits(model: torch.nn.Module, vectors: torch.Tensor) -> torch.Tensor:
    """`[n, vocab]` logits of model-space vectors read through the final norm and the output embedding."""
    norm = decoder_of(model).norm
    head = output_embedding(model)
    weight = head.weight
    with torch.no_grad():
        return head(norm(vectors.to(device=weight.device, dtype=weight.dtype))).float()


@torch.no_grad()
def project_values(
    model: torch.nn.Module,
    bank: MemoryBank,
    cells: Sequence[int] | torch.Tensor | None = None,
    top_n: int = 10,
    chunk_size: int = 512,
    vocab_size: int | None = None,
) -> ValueProjection:
    """The `top_n` tokens each memory cell's value vector promotes (and demotes), computed in chunks of cells.

    `cells`: flat cell indices, `0..bank.num_cells - 1` (default: every cell).
    `vocab_size`: rank the ids `0..vocab_size - 1` only, e.g. `len(tokenizer)` where the output embedding has rows no
    token uses (a vocabulary padded to a round size); default: every row."""
    check_at_least(1, top_n=top_n, chunk_size=chunk_size)
    if vocab_size is not None:
        check_at_least(1, vocab_size=vocab_size)
    if cells is None:
        cells = torch.arange(bank.num_cells)
    else:
        cells = check_cells(torch.as_tensor(cells, dtype=torch.long).reshape(-1), bank.num_cells, "cells")
    values = bank.value_vectors()
    outputs: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, len(cells), chunk_size):
        chunk = cells[start : start + chunk_size]
        logits = vocabulary_logits(model, values[chunk.to(values.device)])[:, :vocab_size]
        n = min(top_n, logits.shape[-1])
        top = logits.topk(n, dim=-1)
        bottom = logits.topk(n, dim=-1, largest=False)
        outputs.append((top.indices.cpu(), top.values.cpu(), bottom.indices.cpu(), bottom.values.cpu()))
    if not outputs:
        empty = torch.empty(0, top_n, dtype=torch.long)
        return ValueProjection(cells, empty, empty.float(), empty, empty.float())
    top_ids, top_logits, bottom_ids, bottom_logits = (torch.cat(parts) for parts in zip(*outputs))
    return ValueProjection(cells, top_ids, top_logits, bottom_ids, bottom_logits)


def key_value_agreement(projection: ValueProjection, triggers: Sequence[Sequence[Trigger]]) -> torch.Tensor:
    """Per cell: the fraction of its trigger examples whose next token is among the value's top predicted tokens.

    A trigger with a negative coefficient is compared with the bottom tokens (the value acts with flipped sign).
    Cells without a trigger that has a next token get NaN.
    """
    if len(triggers) != len(projection.cells):
        raise ValueError(f"triggers has {len(triggers)} cells, projection has {len(projection.cells)}")
    agreement = torch.full((len(triggers),), float("nan"))
    for row, cell_triggers in enumerate(triggers):
        top = set(projection.top_ids[row].tolist())
        bottom = set(projection.bottom_ids[row].tolist())
        hits = [
            (t.next_id in (top if t.coefficient >= 0 else bottom)) for t in cell_triggers if t.next_id is not None
        ]
        if hits:
            agreement[row] = sum(hits) / len(hits)
    return agreement
