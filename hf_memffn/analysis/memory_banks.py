"""Memory banks: every FFN of a model read as unnormalized key-value memory, `FFN(x) = sum_i c_i(x) v_i`.

A *memory bank* is one set of memory cells that write into the residual stream of one layer: one FFN block, or
one layer of the stacked memory on the token embeddings X0. The maths belongs to the block: every FFN block of this
package implements the memory interface `hf_memffn.ffn.FeedForwardMemory` (the coefficients of an input, the value
vectors in model space, how the cells are grouped, a value edit), and a bank asks it. The bank adds the layer, a
name, and where its input is captured (`hook_module`). So a new FFN variant works in every tool by implementing
that interface.

Blocks and their cells (the README has the formulas): SwiGLU and KV-FFN (cells: the inputs of the final linear),
FlashMHF / MH-FFN / Dense-MoE (cells per head and sub-network), PKV (cells per head), the memory on X0
(`TokenMemory.layer_memory(l)`, cells of layer l), and transformers' gated MLPs (`LlamaMLP` and the MLPs of the
same layout in other Llama-family models) through the adapter `GatedMLPMemory`.

Nothing here changes the model classes: coefficients are captured with forward hooks (see `coefficients.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..ffn import FeedForwardMemory, LinearReadoutMemory


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (`model.model` of a `*ForCausalLM`): the module holding `layers`, `norm`, `embed_tokens`.
    A PEFT model (`get_peft_model`) is read through the model it wraps, adapters in place."""
    get_base_model = getattr(model, "get_base_model", None)
    if callable(get_base_model):
        model = get_base_model()
    for candidate in (getattr(model, "model", None), getattr(model, "base_model", None), model):
        if candidate is not None and hasattr(candidate, "layers"):
            return candidate
    raise ValueError(
        f"model of class {type(model).__name__} has no decoder with `layers`; expected a Llama-family model"
    )


def output_embedding(model: nn.Module) -> nn.Module:
    """The output embedding (`lm_head`), through which value projections and edits read the vocabulary."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if head is None:
        raise ValueError(f"model of class {type(model).__name__} has no output embedding (lm_head): value projections "
                         "and edits read the vocabulary through it; load it with AutoModelForCausalLM (not AutoModel)")
    return head


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's weights, where its inputs go. Weights on the meta device are refused: accelerate's
    offloading (`cpu_offload`, a `device_map` with "cpu" or "disk" entries next to a GPU) brings them in only inside
    each module's forward, and the analysis reads the FFN weights outside it (values, edits, coefficient hooks)."""
    offloaded = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if offloaded:
        raise ValueError(f"the weights {offloaded[:3]} ({len(offloaded)} in all) of {type(model).__name__} are on the "
                         "meta device (offloaded by accelerate, or never loaded): the memory analysis reads the FFN "
                         "weights outside the forward, where offloading does not bring them in. Load the model onto "
                         "one device (from_pretrained without device_map, or a device_map without 'cpu' and 'disk')")
    return next(model.parameters()).device


def _is_linear(module: nn.Module | None) -> bool:
    """An `nn.Linear`, or a PEFT layer wrapping one (its `get_base_layer()`; the values read its forward's weight)."""
    get_base_layer = getattr(module, "get_base_layer", None)
    return isinstance(module, nn.Linear) or callable(get_base_layer) and isinstance(get_base_layer(), nn.Linear)


class GatedMLPMemory(LinearReadoutMemory):
    """transformers' gated MLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))` (`LlamaMLP`, and the MLPs of the same
    layout in other Llama-family models), read as memory like `SwiGLUFeedForward`."""

    def __init__(self, mlp: nn.Module):
        self.mlp = mlp

    @staticmethod
    def fits(mlp: nn.Module) -> bool:
        linears = (getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj"))
        return all(map(_is_linear, linears)) and callable(getattr(mlp, "act_fn", None))

    @property
    def memory_readout(self) -> nn.Linear:
        return self.mlp.down_proj

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mlp.act_fn(self.mlp.gate_proj(hidden_states)) * self.mlp.up_proj(hidden_states)


# The members of `FeedForwardMemory`. A block is recognised by them rather than by its class: a model loaded with
# `trust_remote_code` runs the copy of `ffn.py` saved with it, whose classes are not this package's.
_MEMORY_INTERFACE = tuple(name for name in vars(FeedForwardMemory) if name.startswith(("memory_", "add_to_memory")))


def feed_forward_memory(name: str, mlp: nn.Module) -> FeedForwardMemory:
    """`mlp` read as memory: itself when it implements `FeedForwardMemory`, else through an adapter."""
    if all(hasattr(type(mlp), member) for member in _MEMORY_INTERFACE):
        return mlp
    if GatedMLPMemory.fits(mlp):
        return GatedMLPMemory(mlp)
    raise ValueError(
        f"{name}: FFN of class {type(mlp).__name__} is not supported by the memory analysis: it does not implement "
        "hf_memffn.ffn.FeedForwardMemory and is not a gated MLP of transformers' layout (gate_proj, up_proj, "
        "down_proj, act_fn)"
    )


@dataclass
class MemoryBank:
    """One layer's set of memory cells: the block's memory interface, plus where the bank's input is captured."""

    name: str
    layer: int
    memory: FeedForwardMemory = field(repr=False)
    hook_module: nn.Module = field(repr=False)  # its input (or output, see below) is what the coefficients read
    hook_reads_output: bool = field(default=False, repr=False)
    context_free: bool = False  # the coefficients depend on the current token only (memory fed the embeddings X0)

    @property
    def kind(self) -> str:
        return self.memory.memory_kind

    @property
    def cell_shape(self) -> tuple[int, ...]:
        return tuple(self.memory.memory_cell_shape)

    @property
    def cell_axes(self) -> tuple[str, ...]:
        return tuple(self.memory.memory_cell_axes)

    @property
    def num_cells(self) -> int:
        return self.memory.memory_num_cells

    def cell_label(self, cell: int) -> str:
        """Human-readable name of a flat cell index, e.g. `123` or `h2.e1.17` for FlashMHF."""
        if len(self.cell_shape) == 1:
            return str(int(cell))
        parts = []
        for axis, size in zip(reversed(self.cell_axes), reversed(self.cell_shape)):
            parts.append((axis, int(cell) % size))
            cell = int(cell) // size
        prefix = {"head": "h", "subnetwork": "e", "cell": ""}
        return ".".join(f"{prefix.get(axis, axis)}{index}" for axis, index in reversed(parts))

    def coefficients_from_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """The coefficients `[..., num_cells]` of what `hook_module` receives (or returns, when `hook_reads_output`)."""
        return self.memory.memory_coefficients(hidden)

    def value_vectors(self) -> torch.Tensor:
        """`[num_cells, hidden_size]`: what one unit of coefficient adds to the residual stream (biases are not
        memories and are left out)."""
        return self.memory.memory_values()

    def add_to_value(self, cell: int, delta: torch.Tensor) -> None:
        """Add a model-space vector to one cell's value (memory editing)."""
        self.memory.add_to_memory_value(cell, delta)

    def value_parameter(self) -> torch.Tensor:
        """The parameter `add_to_value` changes (snapshot it to undo an edit exactly)."""
        return self.memory.memory_value_parameter()

    def value_delta_for_output(self, cell: int, coefficients: torch.Tensor, output_change: torch.Tensor) -> torch.Tensor:
        """The `add_to_value(cell, ...)` argument that moves this bank's output by `output_change` at a position whose
        coefficients are `coefficients` (`[num_cells]`)."""
        return self.memory.memory_value_delta_for_output(cell, coefficients, output_change)

    def output_from_coefficients(self, coefficients: torch.Tensor) -> torch.Tensor:
        """`sum_i c_i v_i` (no biases): the bank's contribution to the residual stream."""
        return coefficients.float() @ self.value_vectors().float()


def _refuse_pefts_parameter_adapters(decoder: nn.Module) -> None:
    """PEFT's `target_parameters` LoRA adds its delta to a weight only while its wrapper's forward runs: read outside
    it, as coefficients, values and edits read the FFN weights, the weights would be the base model's."""
    from ..adapters import _pefts_parameter_adapters, parameter_weights

    adapted = _pefts_parameter_adapters(decoder, parameter_weights(decoder))
    if adapted:
        raise ValueError(f"the FFN weights {adapted} carry PEFT's target_parameters LoRA, which PEFT applies only "
                         "inside the forward: the memory analysis would read the base model's weights. Merge it first "
                         "(model = model.merge_and_unload()), or adapt these weights with "
                         "hf_memffn.adapters.add_weight_lora, which the analysis reads")


def memory_banks(model: nn.Module) -> list[MemoryBank]:
    """Every memory bank of `model`, in layer order (residual FFN first, then the memory on X0, per layer)."""
    decoder = decoder_of(model)
    model_device(model)  # (refuses offloaded weights)
    _refuse_pefts_parameter_adapters(decoder)
    memory = getattr(decoder, "memory", None)  # the stacked FFNs on X0 (None when dropped for a lookup table)
    banks: list[MemoryBank] = []
    for layer, block in enumerate(decoder.layers):
        mlp = getattr(block, "mlp", None)
        if mlp is not None:
            name = f"layers.{layer}.mlp"
            banks.append(MemoryBank(name, layer, feed_forward_memory(name, mlp), hook_module=mlp))
        if memory is not None:
            # the embedding's output is X0, whether the memory is computed or read from a lookup table
            banks.append(MemoryBank(f"layers.{layer}.memory", layer, memory.layer_memory(layer),
                                    hook_module=decoder.embed_tokens, hook_reads_output=True, context_free=True))
    if not banks:
        dropped = memory is None and getattr(decoder.config, "token_memory_size", None) is not None
        raise ValueError(f"model of class {type(model).__name__} has no FFN memory to analyse" + (
            ": its FFNs on the token embeddings were dropped for a lookup table (`drop_memory_ffn`), whose rows hold "
            "their outputs, not their coefficients; load the model again without dropping them" if dropped else ""))
    return banks


def select_banks(banks: list[MemoryBank], names: list[str] | None) -> list[MemoryBank]:
    """The banks called `names` (all when None); a clear error for an unknown name."""
    if names is None:
        return banks
    by_name = {bank.name: bank for bank in banks}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"banks={unknown} not found; available banks: {sorted(by_name)}")
    return [by_name[name] for name in names]
