"""Memory editing: change what a token's memory outputs and measure the effect on next-token predictions.

Two edits, both reversible (`apply()` / `revert()`, or use them as context managers):

* `ValueEdit` (every architecture): add a model-space vector to the value of one memory cell. `edit_next_token`
  picks the cell that the prompt's last token triggers most in the edited layer (largest |c_j| * ||v_j||) and moves
  its value so that, at that position, the FFN output makes the move that most raises the target's probability.
  A value of the memory on X0 acts only while the memory is computed: a loaded lookup table holds its outputs as
  they were exported, so `edit_next_token` refuses value edits of that memory then.
* `TokenMemoryEdit` (MemoryLLM / FlexMemoryLLM): rewrite one token's memory output rows, i.e. its lookup-table row,
  by adding a `[num_layers, hidden]` delta to the memory's output wherever that token occurs. It is held by a small
  wrapper around the decoder's memory readout, so it works with the computed memory and with loaded lookup tables
  alike; no weight changes, so nothing a checkpoint would hold: `save_pretrained` is refused while one is applied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from .arguments import check_at_least, check_strength
from .coefficients import coefficients_for_ids, one_sequence
from .memory_banks import MemoryBank, decoder_of, memory_banks, model_device, output_embedding


def check_target_id(model: torch.nn.Module, target_id: int) -> None:
    """Refuses a target outside the output vocabulary (the rows of the output embedding)."""
    vocab_size = output_embedding(model).weight.shape[0]
    if not 0 <= target_id < vocab_size:
        raise ValueError(f"target_id={target_id} is outside the vocabulary [0, {vocab_size})")


def promotion_direction(model: torch.nn.Module, target_id: int) -> torch.Tensor:
    """Unit model-space vector that raises the target's logit relative to the others, through the final RMSNorm."""
    check_target_id(model, target_id)
    weight = output_embedding(model).weight.detach().float()
    direction = weight[target_id] - weight.mean(0)
    norm_weight = getattr(decoder_of(model).norm, "weight", None)
    if norm_weight is not None:
        direction = direction * norm_weight.detach().float()
    return direction / direction.norm()


@torch.no_grad()
def next_token_probabilities(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """`[vocab]` next-token distribution after the sequence `input_ids` (`[length]`)."""
    device = model_device(model)
    logits = model(input_ids=one_sequence(input_ids, model).reshape(1, -1).to(device)).logits[0, -1]
    return logits.float().softmax(-1).cpu()


@torch.no_grad()
def final_residual(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The residual stream entering the final norm at the last position (`[hidden]`)."""
    captured: list[torch.Tensor] = []
    handle = decoder_of(model).norm.register_forward_pre_hook(lambda module, args: captured.append(args[0][0, -1]))
    try:
        model(input_ids=input_ids.reshape(1, -1).to(model_device(model)))
    finally:
        handle.remove()
    return captured[-1].detach()


def promotion_move(
    model: torch.nn.Module, input_ids: torch.Tensor, target_id: int, strength: float = 2.0, steps: int = 60
) -> torch.Tensor:
    """The residual-stream change at the prompt's last position, of norm at most `strength` times the residual's,
    that most raises log p(target) through the final norm and the output embedding (projected gradient ascent).

    Moving along `promotion_direction` alone can raise tokens whose output embeddings resemble the target's (other
    cities, say) even more; ascending on log p(target) itself pushes the target above them.
    """
    # (out of inference mode, where a caller's `torch.inference_mode()` would make every tensor here one autograd
    # cannot differentiate; the gradient is taken for `move` alone, so the model's parameters get no `.grad`)
    with torch.inference_mode(False), torch.enable_grad():
        residual = final_residual(model, input_ids).float()
        budget = strength * float(residual.norm())
        norm, head = decoder_of(model).norm, output_embedding(model)
        dtype = head.weight.dtype
        move = (0.5 * budget * promotion_direction(model, target_id)).requires_grad_(True)
        optimizer = torch.optim.Adam([move], lr=0.05 * budget)
        for _ in range(steps):
            logits = head(norm((residual + move).to(dtype))).float()
            loss = -torch.log_softmax(logits, dim=-1)[target_id]
            (move.grad,) = torch.autograd.grad(loss, [move])
            optimizer.step()
            with torch.no_grad():
                move.mul_(min(1.0, budget / max(float(move.norm()), 1e-30)))
    return move.detach()


@dataclass
class ValueEdit:
    """Adds `delta` (model space) to the value vector of `cell` in `bank`; `revert()` restores the exact weights.

    Only the weights the edit changed are saved and restored, so edits of other cells or banks (MemoryLLM's banks
    share one stacked parameter) may be reverted in any order; edits of the same weights, last applied first.
    """

    bank: MemoryBank
    cell: int
    delta: torch.Tensor
    # (index of the changed weights, their values before, their values after the edit)
    _saved: tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def apply(self) -> "ValueEdit":
        if self._saved is not None:
            raise RuntimeError("edit already applied")
        if not 0 <= self.cell < self.bank.num_cells:
            raise ValueError(f"cell={self.cell} is outside {self.bank.name}: allowed cells are "
                             f"0..{self.bank.num_cells - 1}")
        weights = self.bank.value_parameter()
        if not isinstance(weights, nn.Parameter):  # (the module computes it from its parametrization on each read)
            raise ValueError(f"{self.bank.name}: its values are computed by a parametrization (a LoRA adapter or int8 "
                             "weights of hf_memffn.adapters), so an edit would change a copy and nothing else; merge "
                             "them first (adapters.merge_weight_lora)")
        weights = weights.detach()
        before = weights.clone()
        self.bank.add_to_value(self.cell, self.delta)
        changed = torch.nonzero(weights != before, as_tuple=True)
        self._saved = (changed, before[changed], weights[changed].clone())
        return self

    def revert(self) -> None:
        if self._saved is None:
            raise RuntimeError("edit is not applied")
        changed, before, after = self._saved
        weights = self.bank.value_parameter().detach()
        if not torch.equal(weights[changed], after):
            raise RuntimeError(f"{self.bank.name} cell {self.bank.cell_label(self.cell)} was changed again after this "
                               "edit: revert the later edits of the same weights first (last applied, first reverted)")
        weights[changed] = before
        self._saved = None

    def __enter__(self) -> "ValueEdit":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.revert()


def has_token_memory(model: torch.nn.Module) -> bool:
    """True for models whose layers read a memory on the token embeddings (computed or from a lookup table)."""
    decoder = decoder_of(model)
    computed = getattr(decoder, "memory", None) is not None
    return hasattr(decoder, "memory_readout") and (computed or getattr(decoder, "token_lookup", None) is not None)


class _EditedReadout:
    """Wraps the decoder's memory readout of one forward: adds `row_delta[layer]` wherever the token occurs."""

    def __init__(self, readout, token_mask: torch.Tensor, row_delta: torch.Tensor):
        self.readout = readout
        self.token_mask = token_mask  # [B, L, 1]
        self.row_delta = row_delta  # [N, d]

    def add_into(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        hidden = self.readout.add_into(hidden, layer_idx)
        delta = self.row_delta[layer_idx].to(device=hidden.device, dtype=hidden.dtype)
        return hidden + self.token_mask.to(device=hidden.device, dtype=hidden.dtype) * delta


class _EditedMemory:
    """Set as the decoder's `memory_readout` (an instance attribute: it shadows the method) while token memory edits
    are applied: the readout that `original` gives, with every applied edit added."""

    def __init__(self, original, previous):
        self.original = original  # what `decoder.memory_readout` was
        self.previous = previous  # the instance attribute it was (None: the method)
        self.edits: list[TokenMemoryEdit] = []

    def __call__(self, input_ids, inputs_embeds):
        if input_ids is None:
            raise ValueError("a TokenMemoryEdit needs `input_ids` (the edited token is found by its id)")
        readout = self.original(input_ids, inputs_embeds)
        for edit in self.edits:
            readout = _edited_readout(readout, (input_ids == edit.token_id).unsqueeze(-1), edit.row_delta)
        return readout


def _edited_readout(readout, token_mask: torch.Tensor, row_delta: torch.Tensor):
    """`readout` with `row_delta[layer]` added wherever `token_mask` [B, L, 1] is set. A readout of the computed
    memory (its outputs as tensors, `layer_outputs`) stays one of its own class, the edit added into those tensors:
    the decoder hands them to each layer as a positional argument, as reentrant activation checkpointing needs to
    treat them as the layer's inputs (reached through a wrapper instead, their graph was backpropagated inside each
    layer's backward and again after it). Other readouts (a lookup table's, whose rows need no gradient) are wrapped."""
    layer_outputs = getattr(readout, "layer_outputs", None)
    if layer_outputs is None:
        return _EditedReadout(readout, token_mask, row_delta)
    edited = [output + token_mask.to(device=output.device, dtype=output.dtype)
              * row_delta[layer].to(device=output.device, dtype=output.dtype)
              for layer, output in enumerate(layer_outputs)]
    # (the class takes [B, L, N, d]; stacked layer-major, as `TokenMemory` returns it, each layer's part is contiguous)
    return type(readout)(torch.stack(edited).movedim(0, -2))


@dataclass
class TokenMemoryEdit:
    """Adds `row_delta` (`[num_layers, hidden]`) to the memory output of every occurrence of `token_id`.

    It wraps the decoder's `memory_readout` (the seam where the memory enters the layers) on this model instance,
    so it works the same whether the memory is computed or read from a loaded lookup table. Several edits may be
    applied at once and reverted in any order.
    """

    model: torch.nn.Module
    token_id: int
    row_delta: torch.Tensor
    _decoder: torch.nn.Module | None = field(default=None, repr=False)

    def apply(self) -> "TokenMemoryEdit":
        if self._decoder is not None:
            raise RuntimeError("edit already applied")
        if not has_token_memory(self.model):
            raise ValueError(f"model of class {type(self.model).__name__} has no memory on the token embeddings")
        decoder = decoder_of(self.model)
        vocab_size = decoder.embed_tokens.weight.shape[0]
        if not 0 <= self.token_id < vocab_size:
            raise ValueError(f"token_id={self.token_id} is outside the vocabulary [0, {vocab_size})")
        if self.row_delta.shape != (len(decoder.layers), decoder.embed_tokens.weight.shape[1]):
            raise ValueError(f"row_delta has shape {tuple(self.row_delta.shape)}, expected [num_layers, hidden_size]")
        edited = vars(decoder).get("memory_readout")
        if not isinstance(edited, _EditedMemory):
            edited = _EditedMemory(decoder.memory_readout, previous=edited)
            decoder.memory_readout = edited
        edited.edits.append(self)
        self._decoder = decoder
        return self

    def revert(self) -> None:
        if self._decoder is None:
            raise RuntimeError("edit is not applied")
        edited = vars(self._decoder)["memory_readout"]
        edited.edits = [edit for edit in edited.edits if edit is not self]
        if not edited.edits:  # the last edit: the readout the decoder had before the first one
            if edited.previous is None:
                del self._decoder.memory_readout
            else:
                self._decoder.memory_readout = edited.previous
        self._decoder = None

    def __enter__(self) -> "TokenMemoryEdit":
        return self.apply()

    def __exit__(self, *exc) -> None:
        self.revert()


@dataclass
class EditResult:
    """What an edit changed at the prompt's next-token prediction."""

    method: str  # "value" or "token_memory"
    location: str  # bank and cell, or token and layer
    target_id: int
    target_probability_before: float
    target_probability_after: float
    top_before: list[tuple[int, float]]
    top_after: list[tuple[int, float]]
    edit: ValueEdit | TokenMemoryEdit = field(repr=False)


def _trigger_cell(model, input_ids, banks) -> tuple[MemoryBank, int, torch.Tensor]:
    """(bank, cell, the bank's coefficients at the last position) of the cell with the largest |c_j| * ||v_j||."""
    coefficients = coefficients_for_ids(model, input_ids, banks)
    best: tuple[float, MemoryBank, int, torch.Tensor] | None = None
    for bank in banks:
        last = coefficients[bank.name][-1]
        contribution = last.abs() * bank.value_vectors().float().norm(dim=-1).cpu()
        cell = int(contribution.argmax())
        if best is None or contribution[cell] > best[0]:
            best = (float(contribution[cell]), bank, cell, last)
    if best is None:
        raise ValueError("no memory bank to search: `banks` is empty")
    return best[1], best[2], best[3]


def find_trigger_cell(
    model: torch.nn.Module, input_ids: torch.Tensor, banks: Sequence[MemoryBank] | None = None
) -> tuple[MemoryBank, int, float]:
    """The cell the last token triggers most: largest |c_j| * ||v_j|| at the last position, over `banks`.

    Returns (bank, flat cell index, coefficient).
    """
    bank, cell, last = _trigger_cell(model, input_ids, memory_banks(model) if banks is None else list(banks))
    return bank, cell, float(last[cell])


def _top(probabilities: torch.Tensor, n: int) -> list[tuple[int, float]]:
    values, ids = probabilities.topk(min(n, probabilities.numel()))
    return [(int(i), float(v)) for i, v in zip(ids, values)]


def edit_next_token(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    target_id: int,
    strength: float = 2.0,
    method: str = "auto",
    layer: int | None = None,
    banks: Sequence[MemoryBank] | None = None,
    top_n: int = 5,
) -> EditResult:
    """Edits the memory of the prompt's last token so that it promotes `target_id`; the edit stays applied.

    `method`: "value" (targeted value edit of the cell the last token triggers most), "token_memory" (rewrite the
    token's memory row; MemoryLLM / FlexMemoryLLM) or "auto" (token_memory when the model has one, else value).
    `strength`: largest residual-stream move at the prompt's last position, in units of the final residual's norm;
    the move itself is the one that most raises log p(target) (see `promotion_move`).
    `layer`: the layer edited (default: the last, whose output reaches the prediction directly); a value edit
    searches the cell among that layer's `banks` (default: all of the model's banks); the memory on X0 is refused
    while a lookup table is loaded (the model reads the table, not the values).
    Call `result.edit.revert()` to undo.
    """
    methods = ("auto", "value", "token_memory")
    if method not in methods:
        raise ValueError(f"method={method!r} is not one of {methods}")
    check_strength(strength)
    check_at_least(1, top_n=top_n)
    check_target_id(model, target_id)
    input_ids = one_sequence(input_ids, model)
    has_memory = has_token_memory(model)
    if method == "auto":
        method = "token_memory" if has_memory else "value"
    num_layers = len(decoder_of(model).layers)
    layer = num_layers - 1 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer={layer} must be in [0, {num_layers})")
    if method == "value":
        candidates = [bank for bank in (memory_banks(model) if banks is None else banks) if bank.layer == layer]
        if not candidates:
            raise ValueError(f"layer={layer} has no memory bank to edit")
        read_from_table = [bank.name for bank in candidates if bank.context_free]
        if read_from_table and getattr(decoder_of(model), "token_lookup", None) is not None:
            raise ValueError(f"method='value' cannot edit {', '.join(read_from_table)}: a lookup table is loaded and "
                             "the model reads that memory from it; use method='token_memory' (or banks without it, "
                             "or unload_tols() first)")
    elif method == "token_memory" and not has_memory:
        raise ValueError(f"method='token_memory' needs a MemoryLLM/FlexMemoryLLM model, got {type(model).__name__}")
    before = next_token_probabilities(model, input_ids)
    move = promotion_move(model, input_ids, target_id, strength)
    edit: ValueEdit | TokenMemoryEdit
    if method == "value":
        bank, cell, last = _trigger_cell(model, input_ids, candidates)
        coefficient = float(last[cell])
        if coefficient == 0.0:
            raise ValueError("the prompt's last token triggers no memory cell (all coefficients are zero)")
        edit = ValueEdit(bank, cell, bank.value_delta_for_output(cell, last, move)).apply()
        location = f"{bank.name} cell {bank.cell_label(cell)} (coefficient {coefficient:.3g})"
    else:
        rows = torch.zeros(num_layers, move.numel())
        rows[layer] = move
        token_id = int(input_ids[-1])
        edit = TokenMemoryEdit(model, token_id, rows).apply()
        location = f"token {token_id} memory row of layer {layer}"
    try:
        after = next_token_probabilities(model, input_ids)
        return EditResult(
            method=method,
            location=location,
            target_id=int(target_id),
            target_probability_before=float(before[target_id]),
            target_probability_after=float(after[target_id]),
            top_before=_top(before, top_n),
            top_after=_top(after, top_n),
            edit=edit,
        )
    except BaseException:
        # (stopped here, by Ctrl-C or an out-of-memory error, the caller gets no result holding the edit to revert:
        # a value edit would stay in the weights, a token memory edit on the decoder)
        edit.revert()
        raise
