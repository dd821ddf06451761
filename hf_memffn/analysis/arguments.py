"""Checks of the analysis helpers' arguments: a `ValueError` naming the argument and its allowed values, raised before
any work, rather than an IndexError or a torch error from inside the computation (or, for a negative index, a
silent read from the end)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from .memory_banks import decoder_of


def check_at_least(minimum: int, **values: int) -> None:
    """Refuses the first of `values` (argument name=value) under `minimum`."""
    for name, value in values.items():
        if not value >= minimum:
            raise ValueError(f"{name}={value!r} must be >= {minimum}")


def check_strength(strength: float, name: str = "strength") -> None:
    """An edit's strength (the argument `name`): a positive finite number."""
    if not (math.isfinite(strength) and strength > 0):
        raise ValueError(f"{name}={strength} must be a positive number (the largest move, in units of the "
                         "residual's norm)")


def check_cells(cells: torch.Tensor, num_cells: int, what: str) -> torch.Tensor:
    """`cells` (flat cell indices), or an error naming the first outside `0..num_cells - 1`."""
    outside = cells[(cells < 0) | (cells >= num_cells)]
    if outside.numel():
        raise ValueError(f"{what} has cell {int(outside[0])}: allowed cells are 0..{num_cells - 1}")
    return cells


def num_embeddings_of(model: torch.nn.Module) -> int:
    """The rows of the model's token embedding: the token ids it takes are 0..rows - 1."""
    return decoder_of(model).embed_tokens.weight.shape[0]


def check_ids(ids: Iterable[int], num_embeddings: int, what: str) -> list[int]:
    """`ids` as a list, or a one-line error where one is outside the model's embedding (a tokenizer that is not the
    model's own), before the model fails inside its embedding."""
    ids = list(ids)
    bad = [token for token in ids if not 0 <= token < num_embeddings]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]}: allowed ids are 0..{num_embeddings - 1} (the model's "
                         f"embedding has {num_embeddings} rows; is the tokenizer the model's own?)")
    return ids


def check_token_list(ids, what: str) -> None:
    """Refuses a token id where a text's list of token ids is expected (one text's ids given for the whole list),
    before `len` or iteration fails on an integer."""
    if isinstance(ids, int) or isinstance(ids, torch.Tensor) and ids.dim() == 0:
        raise ValueError(f"{what}={int(ids)} is a token id: expected a list of token-id lists, one per text (for one "
                         "text, [ids])")


def check_token_memory_layers(layers: Iterable[int], available: list[int], what: str) -> None:
    """Refuses layers not among `available`, the layers of the memory on the token embeddings."""
    unknown = [layer for layer in layers if layer not in available]
    if unknown:
        raise ValueError(f"{what}={unknown} have no token memory; allowed: {available}")
