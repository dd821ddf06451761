"""Memory coefficients: capture them with forward hooks, then summarise them.

`record_coefficients(model, banks)` is a context manager; inside it every forward pass calls, for each bank,
`on_coefficients(bank, coefficients)` with a `[batch, length, num_cells]` float32 tensor (or stores them when no
callback is given). The model classes are never modified; hooks are removed on exit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .arguments import check_at_least, check_ids, num_embeddings_of
from .memory_banks import MemoryBank, memory_banks, model_device

CoefficientCallback = Callable[[MemoryBank, torch.Tensor], None]


@contextmanager
def record_coefficients(
    model: torch.nn.Module,
    banks: Sequence[MemoryBank] | None = None,
    on_coefficients: CoefficientCallback | None = None,
) -> Iterator[dict[str, list[torch.Tensor]]]:
    """Hooks the banks' modules; yields `{bank name: [coefficients of each forward pass]}` (filled when no callback)."""
    banks = memory_banks(model) if banks is None else list(banks)
    stored: dict[str, list[torch.Tensor]] = {bank.name: [] for bank in banks}
    handles = []

    def make_hook(bank: MemoryBank):
        def hook(module, args, output=None):
            with torch.no_grad():
                coefficients = bank.coefficients_from_input(args[0] if output is None else output).float()
            if on_coefficients is None:
                stored[bank.name].append(coefficients.detach().cpu())
            else:
                on_coefficients(bank, coefficients.detach())

        return hook

    try:
        for bank in banks:
            if bank.hook_reads_output:
                handles.append(bank.hook_module.register_forward_hook(make_hook(bank)))
            else:
                handles.append(bank.hook_module.register_forward_pre_hook(make_hook(bank)))
        yield stored
    finally:
        for handle in handles:
            handle.remove()


def one_sequence(input_ids, model: torch.nn.Module | None = None) -> torch.Tensor:
    """`input_ids` as one `[length]` sequence; `[1, length]` is taken too. A batch of several sequences is refused:
    flattened, its rows would read as one sequence, each row the context of the next. With `model`, an id outside
    its token embedding is refused too."""
    input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() > 2 or input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected one sequence, [length] or "
                         "[1, length] (give the sequences of a batch one at a time)")
    if input_ids.numel() == 0:
        raise ValueError("input_ids is empty: expected one sequence of at least one token")
    if model is not None:
        check_ids(input_ids.reshape(-1).tolist(), num_embeddings_of(model), "input_ids")
    return input_ids.reshape(-1)


@torch.no_grad()
def coefficients_for_ids(
    model: torch.nn.Module, input_ids: torch.Tensor, banks: Sequence[MemoryBank] | None = None
) -> dict[str, torch.Tensor]:
    """`{bank name: [length, num_cells]}`: the memory coefficients of one token sequence (`input_ids`: `[length]`)."""
    input_ids = one_sequence(input_ids, model)
    banks = memory_banks(model) if banks is None else list(banks)
    device = model_device(model)
    with record_coefficients(model, banks) as stored:
        model(input_ids=input_ids.reshape(1, -1).to(device))
    missing = [name for name, captured in stored.items() if not captured]
    if missing:
        raise RuntimeError(f"no coefficients were captured for banks {missing}: their modules did not run in forward")
    return {name: captured[-1][0] for name, captured in stored.items()}


@dataclass
class CoefficientSummary:
    """Per-position statistics of one bank's coefficients for one text."""

    top_cells: torch.Tensor  # [length, k] flat cell indices, ranked by |coefficient|
    top_values: torch.Tensor  # [length, k] the signed coefficients of those cells
    sparsity: torch.Tensor  # [length] fraction of cells with |c| < relative_threshold * max |c|
    cells_for_mass: torch.Tensor  # [length] how many cells hold `mass_fraction` of the total |c|
    group_mass: torch.Tensor | None  # [head, subnetwork] share of |c| mass (FlashMHF only), averaged over positions


def summarize_coefficients(
    coefficients: torch.Tensor,
    bank: MemoryBank,
    top_k: int = 5,
    relative_threshold: float = 0.01,
    mass_fraction: float = 0.9,
) -> CoefficientSummary:
    """Top cells per token, sparsity and the number of cells carrying `mass_fraction` of the coefficient mass."""
    if not 0.0 < mass_fraction <= 1.0:
        raise ValueError(f"mass_fraction={mass_fraction} must be in (0, 1]")
    check_at_least(1, top_k=top_k)
    magnitude = coefficients.float().abs()
    k = min(top_k, magnitude.shape[-1])
    _, top_cells = magnitude.topk(k, dim=-1)
    top_values = coefficients.gather(-1, top_cells)
    peak = magnitude.amax(-1, keepdim=True)
    sparsity = (magnitude < relative_threshold * peak).float().mean(-1)
    sorted_mass = magnitude.sort(-1, descending=True).values.cumsum(-1)
    total = sorted_mass[..., -1:].clamp_min(torch.finfo(torch.float32).tiny)
    cells_for_mass = (sorted_mass / total < mass_fraction).sum(-1) + 1
    group_mass = None
    if len(bank.cell_shape) == 3:
        per_group = magnitude.reshape(*magnitude.shape[:-1], *bank.cell_shape).sum(-1)  # [..., H, E]
        share = per_group / per_group.flatten(-2).sum(-1)[..., None, None].clamp_min(torch.finfo(torch.float32).tiny)
        group_mass = share.reshape(-1, *bank.cell_shape[:2]).mean(0)
    cells_for_mass = cells_for_mass.clamp_max(magnitude.shape[-1])
    return CoefficientSummary(top_cells, top_values, sparsity, cells_for_mass, group_mass)
