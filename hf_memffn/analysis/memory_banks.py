"""Memory banks: every FFN of a model read as unnormalized key-value memory, `FFN(x) = sum_i c_i(x) v_i`.

A *memory bank* is one set of memory cells that write into the residual stream of one layer. For every kind of FFN
it exposes the same three things:

* `coefficients_from_input(x)`: the memory coefficients `c(x)` (`[..., num_cells]`) from the tensor that the bank's
  `hook_module` receives as its first input (or returns, when `hook_reads_output`);
* `value_vectors()`: the value vectors in model space (`[num_cells, hidden_size]`), i.e. what one unit of coefficient
  adds to the residual stream (biases are not memories and are left out);
* `add_to_value(cell, delta)`: add a model-space vector to one cell's value (used by memory editing).

Supported FFN kinds (found by `memory_banks(model)`), coefficients c_j and the value v_j of cell j:

* `readout`: SwiGLU of any HF Llama-family model, FFN-C, KV-FFN and its baselines. c = the input of the final
  linear (`down_proj` / `out_proj`); v_j = column j of that linear's weight.
* `flash_mhf`: FlashMHF (and MH-FFN, Dense-MoE). Per head h and sub-network e, c = R_e * SiLU(q K_e^T) * (q U_e^T);
  v = V[h_kv, e, j] @ out_proj.weight[:, head h]^T (values live in head space and reach the residual via out_proj).
* `pkv`: the PKV baseline. Per head, c = softmax(q K^T / sqrt(d_h)) over the slots; v = V[h, j] @ out_proj (head h).
* `token_memory`: MemoryLLM / FlexMemoryLLM's FFN-M on X0, layer l. c = SiLU(gate_l(n)) * up_l(n) with
  n = RMSNorm_l(x0); v_j = column j of `down_proj[l]`.

Nothing here changes the model classes: coefficients are captured with forward hooks (see `coefficients.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN


def decoder_of(model: nn.Module) -> nn.Module:
    """The decoder stack (`model.model` of a `*ForCausalLM`): the module holding `layers`, `norm`, `embed_tokens`."""
    for candidate in (getattr(model, "model", None), getattr(model, "base_model", None), model):
        if candidate is not None and hasattr(candidate, "layers"):
            return candidate
    raise ValueError(
        f"model of class {type(model).__name__} has no decoder with `layers`; expected a Llama-family model"
    )


@dataclass
class MemoryBank:
    """Base class: one layer's set of memory cells. Subclasses implement the maths of one FFN kind."""

    name: str
    layer: int
    kind: str
    hook_module: nn.Module = field(repr=False)  # its input (or output, see below) is what the coefficients read
    cell_shape: tuple[int, ...]
    cell_axes: tuple[str, ...]
    hook_reads_output: bool = field(default=False, repr=False)

    @property
    def num_cells(self) -> int:
        n = 1
        for size in self.cell_shape:
            n *= size
        return n

    @property
    def context_free(self) -> bool:
        """True when the coefficients depend on the current token only (memory fed the token embeddings X0)."""
        return False

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
        raise NotImplementedError

    def value_vectors(self) -> torch.Tensor:
        raise NotImplementedError

    def add_to_value(self, cell: int, delta: torch.Tensor) -> None:
        raise NotImplementedError

    def value_parameter(self) -> torch.Tensor:
        """The parameter `add_to_value` changes (snapshot it to undo an edit exactly)."""
        raise NotImplementedError

    def value_delta_for_output(self, cell: int, coefficients: torch.Tensor, output_change: torch.Tensor) -> torch.Tensor:
        """The `add_to_value(cell, ...)` argument that moves this bank's output by `output_change` at a position
        whose coefficients are `coefficients` (`[num_cells]`). Here the value of a cell is its own parameter, so
        it is `output_change / c_cell`; multi-head banks whose cells share value rows override this."""
        return output_change / float(coefficients[cell])

    def output_from_coefficients(self, coefficients: torch.Tensor) -> torch.Tensor:
        """`sum_i c_i v_i` (no biases): the bank's contribution to the residual stream."""
        values = self.value_vectors().float()
        return coefficients.float() @ values


class ReadoutBank(MemoryBank):
    """An FFN that ends with one linear `readout` whose input starts with the hidden activation (SwiGLU, KV-FFN, ...).

    The coefficients are exactly the first `num_cells` inputs of the readout (KV-FFN's DenseNet baseline appends a
    copy of x after them), so they are captured without recomputation.
    """

    def __init__(self, name: str, layer: int, readout: nn.Linear, num_cells: int | None = None):
        num_cells = readout.in_features if num_cells is None else num_cells
        super().__init__(name, layer, "readout", readout, (num_cells,), ("cell",))
        self.readout = readout

    def coefficients_from_input(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[..., : self.num_cells]

    def value_vectors(self) -> torch.Tensor:
        return self.readout.weight.detach()[:, : self.num_cells].t()

    @torch.no_grad()
    def add_to_value(self, cell: int, delta: torch.Tensor) -> None:
        weight = self.readout.weight
        weight[:, cell] += delta.to(device=weight.device, dtype=weight.dtype)

    def value_parameter(self) -> torch.Tensor:
        return self.readout.weight


class MultiHeadBank(MemoryBank):
    """Shared part of the multi-head FFNs (FlashMHF, MH-FFN, Dense-MoE, PKV): per-head queries from the FFN input,
    per-head values in head space mapped to model space through the head's slice of `out_proj`."""

    def __init__(self, name, layer, kind, mlp, cell_shape, cell_axes, value_heads: int):
        super().__init__(name, layer, kind, mlp, cell_shape, cell_axes)
        self.mlp = mlp
        self.num_heads = mlp.num_heads
        self.head_dim = mlp.head_dim
        self.value_heads = value_heads
        if self.num_heads % value_heads:
            raise ValueError(f"{name}: ffn heads ({self.num_heads}) must be a multiple of value heads ({value_heads})")

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B, L, H, d_h]` per-head queries, computed by the FFN module itself."""
        return self.mlp.queries(hidden).transpose(1, 2)

    def head_values(self) -> torch.Tensor:
        """`[H, ..., d_h]` the values of each head (shared value heads repeated)."""
        raise NotImplementedError

    def _out_proj_weight(self) -> torch.Tensor:
        if self.mlp.out_proj is None:
            return torch.eye(self.num_heads * self.head_dim, device=self.mlp.value.device)
        return self.mlp.out_proj.weight.detach()

    def value_vectors(self) -> torch.Tensor:
        values = self.head_values().float()  # [H, ..., d_h]
        out_weight = self._out_proj_weight().float()  # [d, H*d_h]
        per_head = out_weight.reshape(out_weight.shape[0], self.num_heads, self.head_dim)  # [d, H, d_h]
        model_space = torch.einsum("h...d,mhd->h...m", values, per_head)
        return model_space.reshape(self.num_cells, out_weight.shape[0])

    def _head_delta(self, head: int, delta: torch.Tensor) -> torch.Tensor:
        """Least-squares head-space change whose image through the head's slice of `out_proj` is `delta`."""
        out_head = self._out_proj_weight().float()[:, head * self.head_dim : (head + 1) * self.head_dim]  # [d, d_h]
        return torch.linalg.lstsq(out_head, delta.float().to(out_head.device).unsqueeze(-1)).solution[:, 0]

    def _value_index(self, cell: int) -> tuple[int, ...]:
        index = [int(i) for i in torch.unravel_index(torch.tensor(int(cell)), self.cell_shape)]
        return (index[0] // (self.num_heads // self.value_heads), *index[1:])

    @torch.no_grad()
    def add_to_value(self, cell: int, delta: torch.Tensor) -> None:
        """Only the part of `delta` in the span of the head's output projection can be realised; when value heads
        are shared by several heads the change reaches every head of the group."""
        head = int(torch.unravel_index(torch.tensor(int(cell)), self.cell_shape)[0])
        value = self.mlp.value
        value[self._value_index(cell)] += self._head_delta(head, delta).to(device=value.device, dtype=value.dtype)

    def value_parameter(self) -> torch.Tensor:
        return self.mlp.value

    def value_delta_for_output(self, cell: int, coefficients: torch.Tensor, output_change: torch.Tensor) -> torch.Tensor:
        """Heads of a group share value rows, so changing cell (h, ..., j) moves the output of every head h' of the
        group by `c[h', ..., j] * W_o[h'] @ dv`. Solves for `dv` in least squares, scaled so that the realised output
        change has `output_change`'s full component along `output_change` (only a d_h-dim span is reachable)."""
        index = [int(i) for i in torch.unravel_index(torch.tensor(int(cell)), self.cell_shape)]
        group = self.num_heads // self.value_heads
        first = index[0] - index[0] % group
        out_weight = self._out_proj_weight().float()
        coefficients = coefficients.reshape(self.cell_shape)
        reach = sum(  # [d, d_h]: output change per unit of head-space value change
            float(coefficients[(h, *index[1:])]) * out_weight[:, h * self.head_dim : (h + 1) * self.head_dim]
            for h in range(first, first + group)
        )
        target = output_change.float().to(out_weight.device)
        head_delta = torch.linalg.lstsq(reach, target.unsqueeze(-1)).solution[:, 0]
        along = float((reach @ head_delta) @ target)
        if along > 0:
            head_delta = head_delta * float(target @ target) / along
        head = index[0]
        return out_weight[:, head * self.head_dim : (head + 1) * self.head_dim] @ head_delta


class FlashMHFBank(MultiHeadBank):
    """FlashMHF: per head h and sub-network e, cells j with coefficient `R_e * SiLU(q K_e^T)_j * (q U_e^T)_j`.

    Cells are flattened in (head, subnetwork, cell) order. MH-FFN (no router) has one sub-network with R = 1.
    """

    def __init__(self, name: str, layer: int, mlp: nn.Module):
        num_kv_heads, num_subnetworks, subnetwork_size, _ = mlp.value.shape
        shape = (mlp.num_heads, num_subnetworks, subnetwork_size)
        super().__init__(name, layer, "flash_mhf", mlp, shape, ("head", "subnetwork", "cell"), num_kv_heads)

    def coefficients_from_input(self, hidden: torch.Tensor) -> torch.Tensor:
        queries = self.mlp.queries(hidden)  # [B, H, L, d_h]
        gates = self.mlp.gates(queries).transpose(1, 2)  # [B, L, H, E], float32
        q = queries.transpose(1, 2).float()
        group = self.num_heads // self.value_heads
        key = self.mlp.key.float().repeat_interleave(group, dim=0)  # [H, E, d_e, d_h]
        up = self.mlp.up.float().repeat_interleave(group, dim=0)
        activation = F.silu(torch.einsum("blhd,hejd->blhej", q, key)) * torch.einsum("blhd,hejd->blhej", q, up)
        return (activation * gates.unsqueeze(-1)).flatten(-3)

    def head_values(self) -> torch.Tensor:
        return self.mlp.value.detach().repeat_interleave(self.num_heads // self.value_heads, dim=0)


class ParametricKVBank(MultiHeadBank):
    """PKV: per head, `softmax(q K^T / sqrt(d_h))` over learned slots (the normalized neural memory of the paper)."""

    def __init__(self, name: str, layer: int, mlp: nn.Module):
        num_heads, slots, _ = mlp.value.shape
        super().__init__(name, layer, "pkv", mlp, (num_heads, slots), ("head", "cell"), num_heads)

    def coefficients_from_input(self, hidden: torch.Tensor) -> torch.Tensor:
        q = self.queries(hidden).float()  # [B, L, H, d_h]
        scores = torch.einsum("blhd,hjd->blhj", q, self.mlp.key.float()) / self.head_dim**0.5
        return scores.softmax(-1).flatten(-2)

    def head_values(self) -> torch.Tensor:
        return self.mlp.value.detach()


class TokenMemoryBank(MemoryBank):
    """Layer l of the stacked memory on the token embeddings X0 (MemoryLLM, FlexMemoryLLM's FFN-M).

    The query space is the vocabulary: the coefficients of a token depend on that token only.
    """

    def __init__(self, name: str, layer: int, memory: nn.Module, embed_tokens: nn.Module, activation: str, eps: float):
        super().__init__(name, layer, "token_memory", embed_tokens, (memory.down_proj.shape[-1],), ("cell",))
        self.hook_reads_output = True  # the embedding's output is X0, whether or not a lookup table is loaded
        self.memory = memory
        self.act_fn = ACT2FN[activation]
        self.eps = eps

    @property
    def context_free(self) -> bool:
        return True

    def coefficients_from_input(self, hidden: torch.Tensor) -> torch.Tensor:
        memory, layer = self.memory, self.layer
        x = hidden.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * memory.norm_weight[layer].float()
        gate = x @ memory.gate_proj[layer].float().t()
        up = x @ memory.up_proj[layer].float().t()
        return self.act_fn(gate) * up

    def value_vectors(self) -> torch.Tensor:
        return self.memory.down_proj[self.layer].detach().t()

    @torch.no_grad()
    def add_to_value(self, cell: int, delta: torch.Tensor) -> None:
        down = self.memory.down_proj
        down[self.layer, :, cell] += delta.to(device=down.device, dtype=down.dtype)

    def value_parameter(self) -> torch.Tensor:
        return self.memory.down_proj


def _bank_for_mlp(layer: int, mlp: nn.Module) -> MemoryBank:
    name = f"layers.{layer}.mlp"
    key, value = getattr(mlp, "key", None), getattr(mlp, "value", None)
    if isinstance(key, nn.Parameter) and isinstance(value, nn.Parameter) and hasattr(mlp, "queries"):
        if value.dim() == 4 and isinstance(getattr(mlp, "up", None), nn.Parameter):
            return FlashMHFBank(name, layer, mlp)
        if value.dim() == 3:
            return ParametricKVBank(name, layer, mlp)
    if hasattr(mlp, "memory_coefficients") and isinstance(getattr(mlp, "key_proj", None), nn.Linear):
        return ReadoutBank(name, layer, mlp.out_proj, num_cells=mlp.key_proj.out_features)
    for readout_name in ("down_proj", "out_proj", "w2", "fc2"):
        readout = getattr(mlp, readout_name, None)
        if isinstance(readout, nn.Linear):
            return ReadoutBank(name, layer, readout)
    raise ValueError(
        f"{name}: FFN of class {type(mlp).__name__} is not supported by the memory analysis; supported kinds are "
        "FFNs ending with a linear readout (down_proj/out_proj: SwiGLU, ReLU, GLU, KV-FFN), FlashMHF / MH-FFN / "
        "Dense-MoE (key/up/value parameters), PKV and the token memory on X0"
    )


def memory_banks(model: nn.Module) -> list[MemoryBank]:
    """Every memory bank of `model`, in layer order (residual FFN first, then the memory on X0, per layer)."""
    decoder = decoder_of(model)
    config = model.config
    banks: list[MemoryBank] = []
    memory = getattr(decoder, "memory", None)
    if memory is not None:
        activation = getattr(config, "hidden_act", "silu")
        eps = getattr(memory, "eps", config.rms_norm_eps)
    for layer, block in enumerate(decoder.layers):
        mlp = getattr(block, "mlp", None)
        if mlp is not None:
            banks.append(_bank_for_mlp(layer, mlp))
        if memory is not None:
            embed = decoder.embed_tokens
            banks.append(TokenMemoryBank(f"layers.{layer}.memory", layer, memory, embed, activation, float(eps)))
    if not banks:
        raise ValueError(f"model of class {type(model).__name__} has no FFN memory to analyse")
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
