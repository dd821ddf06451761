"""Top-triggering prefixes of memory cells over a dataset, streamed with bounded memory.

For each tracked cell a top-k "heap" of (coefficient, position) is kept as two `[num_cells, k]` tensors and merged with
each batch's own top-k (vectorised; memory O(num_cells * k) whatever the dataset size). Only the token windows of the
positions still referenced by some heap are kept, so the prefixes can be shown without a second pass over the data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .arguments import check_at_least, check_cells, check_ids, check_token_list, num_embeddings_of
from .coefficients import record_coefficients
from .memory_banks import MemoryBank, model_device


class TopKPerCell:
    """Keeps, for each of `num_cells` cells, the `k` largest scores seen so far and an integer key for each.

    `absolute=True`: the `k` scores of largest magnitude, kept with their sign (`values` are then ordered by |score|).
    """

    def __init__(self, num_cells: int, k: int, device: torch.device | str = "cpu", absolute: bool = False):
        if k < 1:
            raise ValueError(f"k={k} must be >= 1")
        self.k = k
        self.absolute = absolute
        self.values = torch.full((num_cells, k), float("-inf"), device=device)
        self.keys = torch.full((num_cells, k), -1, dtype=torch.long, device=device)

    def _rank(self, values: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """What the heap orders by: the scores, or their magnitudes (an empty slot, key -1, last)."""
        return torch.where(keys < 0, float("-inf"), values.abs()) if self.absolute else values

    def update(self, scores: torch.Tensor, keys: torch.Tensor) -> None:
        """`scores`: [num_positions, num_cells]; `keys`: [num_positions] integer id of each position."""
        if scores.shape[0] == 0:
            return
        batch_k = min(self.k, scores.shape[0])
        scores = scores.float()
        _, batch_index = (scores.abs() if self.absolute else scores).topk(batch_k, dim=0)  # [batch_k, num_cells]
        candidate_values = torch.cat([self.values, scores.gather(0, batch_index).t()], dim=1)
        candidate_keys = torch.cat([self.keys, keys.to(self.keys.device)[batch_index].t()], dim=1)
        _, chosen = self._rank(candidate_values, candidate_keys).topk(self.k, dim=1)
        self.values = candidate_values.gather(1, chosen)
        self.keys = candidate_keys.gather(1, chosen)


@dataclass
class Trigger:
    """One top-triggering position of a cell: the prefix ends with the triggering token."""

    coefficient: float
    text_index: int
    position: int
    prefix_ids: list[int]  # up to `prefix_length` tokens, the last one is the triggering token
    next_id: int | None  # the token that follows in the text (None at the end of a text)


@dataclass
class TriggerIndex:
    """Result of `top_triggering_prefixes`: the top triggers of the tracked cells of each bank."""

    cells: dict[str, torch.Tensor]  # bank name -> tracked flat cell indices
    triggers: dict[str, list[list[Trigger]]]  # bank name -> per tracked cell, best first
    num_tokens: int

    def for_cell(self, bank_name: str, cell: int) -> list[Trigger]:
        cells = self.cells[bank_name].tolist()
        if cell not in cells:
            raise ValueError(f"cell {cell} of bank {bank_name} was not tracked; tracked cells: {cells[:20]}...")
        return self.triggers[bank_name][cells.index(cell)]


def _batches(token_lists: Iterable[list[int]], batch_size: int) -> Iterable[list[tuple[int, list[int]]]]:
    batch: list[tuple[int, list[int]]] = []
    for index, ids in enumerate(token_lists):
        check_token_list(ids, f"token_lists[{index}]")
        if len(ids) == 0:
            continue
        batch.append((index, ids))
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


@torch.no_grad()
def top_triggering_prefixes(
    model: torch.nn.Module,
    token_lists: Iterable[list[int]],
    banks: Sequence[MemoryBank],
    k: int = 10,
    cells: dict[str, Sequence[int]] | None = None,
    batch_size: int = 8,
    prefix_length: int = 16,
    absolute: bool = False,
    pad_token_id: int = 0,
    total: int | None = None,
) -> TriggerIndex:
    """Streams `token_lists` (an iterable of token-id lists, e.g. a generator over a dataset) through the model.

    Returns, for each bank and each tracked cell (all cells unless `cells[bank.name]` lists some), the `k` positions
    with the largest coefficient (largest |coefficient| with `absolute=True`; `Trigger.coefficient` keeps its sign)
    and their prefixes. A token id outside the model's embedding is refused when its text is read.
    """
    check_at_least(1, k=k, batch_size=batch_size, prefix_length=prefix_length)
    device = model_device(model)
    unknown = sorted(set(cells or {}) - {bank.name for bank in banks})
    if unknown:
        raise ValueError(f"cells names banks {unknown} that are not among `banks`; allowed: "
                         f"{[bank.name for bank in banks]}")
    tracked = {
        bank.name: torch.as_tensor(list(cells[bank.name]) if cells and bank.name in cells else range(bank.num_cells),
                                   dtype=torch.long)
        for bank in banks
    }
    for bank in banks:
        check_cells(tracked[bank.name], bank.num_cells, f"cells[{bank.name!r}]")
    num_embeddings = num_embeddings_of(model)
    check_ids([pad_token_id], num_embeddings, "pad_token_id")
    heaps = {name: TopKPerCell(len(index), k, device, absolute=absolute) for name, index in tracked.items()}
    windows: dict[int, tuple[list[int], int | None]] = {}
    stride = 1 << 32  # key = text_index * stride + position
    batch_keys = torch.empty(0)
    batch_mask = torch.empty(0)

    def on_coefficients(bank: MemoryBank, coefficients: torch.Tensor) -> None:
        scores = coefficients[..., tracked[bank.name].to(coefficients.device)]
        flat = scores.flatten(0, -2)[batch_mask]
        heaps[bank.name].update(flat, batch_keys)

    num_tokens = 0
    with record_coefficients(model, banks, on_coefficients):
        for batch in tqdm(_batches(token_lists, batch_size), desc="top triggers", unit="batch", total=total):
            length = max(len(ids) for _, ids in batch)
            input_ids = torch.full((len(batch), length), pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
            for row, (index, ids) in enumerate(batch):
                check_ids(ids, num_embeddings, f"token_lists[{index}]")
                input_ids[row, : len(ids)] = torch.as_tensor(ids)
                attention_mask[row, : len(ids)] = 1
            positions = torch.arange(length).expand(len(batch), length)
            text_index = torch.as_tensor([index for index, _ in batch]).unsqueeze(1).expand(-1, length)
            batch_mask = attention_mask.reshape(-1).bool().to(device)
            batch_keys = (text_index * stride + positions).reshape(-1).to(device)[batch_mask]
            num_tokens += int(attention_mask.sum())
            model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device))
            referenced = torch.unique(torch.cat([heap.keys.reshape(-1) for heap in heaps.values()]))
            batch_texts = dict(batch)
            for key in referenced[torch.isin(referenced, batch_keys)].tolist():
                index, position = divmod(key, stride)
                ids = batch_texts[index]
                start = max(0, position + 1 - prefix_length)
                windows[key] = (list(ids[start : position + 1]), ids[position + 1] if position + 1 < len(ids) else None)
            if len(windows) > 2 * referenced.numel():
                keep = set(referenced.tolist())
                windows = {key: window for key, window in windows.items() if key in keep}

    triggers: dict[str, list[list[Trigger]]] = {}
    for name, heap in heaps.items():
        per_cell = []
        for values, keys in zip(heap.values.cpu().tolist(), heap.keys.cpu().tolist()):
            cell_triggers = []
            for value, key in zip(values, keys):
                if key < 0:
                    continue
                index, position = divmod(key, stride)
                prefix, next_id = windows[key]
                cell_triggers.append(Trigger(value, index, position, prefix, next_id))
            per_cell.append(cell_triggers)
        triggers[name] = per_cell
    return TriggerIndex(cells=tracked, triggers=triggers, num_tokens=num_tokens)
