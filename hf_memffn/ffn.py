"""The FFN blocks that every architecture shares, and the memory interface that every FFN block implements.

Each block maps `hidden_states [B, L, d] -> [B, L, d]`:

- `SwiGLUFeedForward`: the Llama MLP (baseline; FlexMemoryLLM's FFN-C).
- `KVFeedForward`: the KV-FFN block (kv-ffn.md eq. 1-3) and its ReLU / GLU / DenseNet baselines.
- `TokenMemory`: every layer's SwiGLU FFN on the token embeddings X0 (MemoryLLM, FlexMemoryLLM's FFN-M), stacked so
  all layers run as one batched matmul outside the decoder loop.

FlashMHFLlama's multi-head FFNs (FlashMHF, MH-FFN, Dense-MoE, PKV) live in `ffn_multihead.py`, next to the fused op
only their checkpoints carry. Every block also reads as key-value memory through `FeedForwardMemory`, the interface
the analysis tools (`hf_memffn.analysis`) ask.
"""

from __future__ import annotations

import re

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.utils import logging

from .ffn_triton import paired_activation, paired_kernels_unavailable
from .rms_norm import rms_normalize
from .triton_launch import autocast_off


def package_logger(module_name: str):
    """The logger of one of the package's modules, named `transformers.memffn.<module>` (also when the module runs as
    a checkpoint's remote code): under transformers' own logger, so that its verbosity
    (`transformers.logging.set_verbosity_info()`, `TRANSFORMERS_VERBOSITY=info`) shows or hides the package's
    messages, which path runs included, as it does transformers' own."""
    return logging.get_logger(f"transformers.memffn.{module_name.rsplit('.', 1)[-1]}")


logger = package_logger(__name__)


def load_checkpoint_parts(state_dict: dict, part_names: list[str], fused_name: str, fused: torch.Tensor | None, *,
                          join, rows_of_part, error_msgs: list[str]) -> None:
    """Loading, in a module's `_load_from_state_dict`, a parameter that checkpoints keep as several tensors (e.g.
    `key_proj` and `value_proj` for one `key_value_proj`). With every part in `state_dict`, `join(parts)` replaces
    them under `fused_name`, which loading then copies. With some of them (the HF Trainer loads a sharded checkpoint
    one shard at a time, and the parts may sit in different shards), each is copied into its own rows of the
    parameter `fused`, `rows_of_part(index)` (a view), and the other rows are left as they are: not left at their
    initial values while an unexpected key is only warned about. A part of the wrong shape is an error, as in
    `load_state_dict`. Nothing is done if the checkpoint holds `fused_name` itself or the module has no `fused`."""
    if fused is None or fused_name in state_dict or not any(name in state_dict for name in part_names):
        return
    if all(name in state_dict for name in part_names):
        state_dict[fused_name] = join([state_dict.pop(name) for name in part_names])
        return
    for index, name in enumerate(part_names):
        if name not in state_dict:
            continue
        part, rows = state_dict.pop(name), rows_of_part(index)
        if part.shape != rows.shape:
            error_msgs.append(f"size mismatch for {name}: copying a param with shape {tuple(part.shape)} from "
                              f"checkpoint, the shape in current model is {tuple(rows.shape)}.")
            continue
        with torch.no_grad():
            rows.copy_(part)


# A tensor of a module inside one of KV-FFN's former key and value layers, `key_proj` and `value_proj`.
_IN_FORMER_KEY_VALUE_LAYER = re.compile(r"(^|\.)mlp\.(key_proj|value_proj)\.[^.]+\.")


def refuse_adapters_of_former_key_value_layers(keys) -> None:
    """A ValueError naming the first of `keys` (state dict keys of a model whose KV-FFN layers hold `key_value_proj`)
    that belongs to a module inside `key_proj` or `value_proj`: an adapter (PEFT's LoRA, ...) saved when the key and
    value projections were two layers. No layer here takes it: `PeftModel.from_pretrained` would load the rest of
    the adapter without a word, `load_adapter` with a report of unexpected keys, and the model run without it."""
    former = next((key for key in sorted(keys) if _IN_FORMER_KEY_VALUE_LAYER.search(key)), None)
    if former is not None:
        raise ValueError(
            f"{former}: an adapter saved when KV-FFN's key and value projections were two layers, `key_proj` and "
            "`value_proj`; they are one layer now, `key_value_proj` (its outputs interleave them), and the adapter "
            "would be left out. Merge it into the weights with the version of the package that saved it "
            "(`merge_and_unload()`, then `save_pretrained`): that checkpoint loads here; or train the adapter again "
            "with `key_value_proj` among its targets")


def linear_weight_in_use(linear: nn.Module, chunk_rows: int = 1024) -> torch.Tensor:
    """The weight `[out, in]` (detached) that `linear`'s forward applies. An `nn.Linear`'s own; a layer that wraps one
    (PEFT's LoRA, DoRA, IA3, ... layers hold the Linear as their base layer, whose `weight` is the base weight without
    the adapter) is read off its forward instead, as `linear(I) - linear(0)` in chunks of rows of the identity, so the
    weight has its active adapters in it, as the forward has, merged or not; in the weight's dtype also inside a
    caller's `torch.autocast`, as an `nn.Linear`'s own."""
    if isinstance(linear, nn.Linear):
        return linear.weight.detach()
    base_weight = linear.weight  # (the wrapped Linear's: its dtype, device and shape)
    in_features = base_weight.shape[1]
    training = [(module, module.training) for module in linear.modules()]
    linear.eval()  # (an adapter's dropout off: the weight of the eval forward)
    try:
        with torch.no_grad(), autocast_off(base_weight.device.type):
            offset = linear(base_weight.new_zeros(1, in_features))  # the bias, if any
            columns = []
            for start in range(0, in_features, chunk_rows):  # (rows of the identity: never all of it at once)
                rows = torch.arange(start, min(start + chunk_rows, in_features), device=base_weight.device)
                identity_rows = base_weight.new_zeros(len(rows), in_features)
                identity_rows[torch.arange(len(rows), device=rows.device), rows] = 1
                columns.append(linear(identity_rows) - offset)
    finally:
        for module, mode in training:
            module.training = mode
    return torch.cat(columns).t()


class FeedForwardMemory:
    """An FFN read as unnormalized key-value memory, `FFN(x) = sum_j c_j(x) v_j` (biases and inner residual
    connections are not memories and are left out). A block implements:

    - `memory_kind`: the family of the block ("readout", "flash_mhf", "pkv", "token_memory");
    - `memory_cell_shape` / `memory_cell_axes`: how the cells are grouped, e.g. `(I,)` / `("cell",)`, or
      `(H, E, d_e)` / `("head", "subnetwork", "cell")`; a flat cell index runs row-major over the shape;
    - `memory_coefficients(x)`: the coefficients `c(x)` `[B, L, num_cells]` of the block's input `x` `[B, L, d]`;
    - `memory_values()`: the value vectors `[num_cells, d]`, what one unit of coefficient adds to the output;
    - `memory_value_parameter()` and `add_to_memory_value(cell, delta)`: the parameter holding the values, and a
      change of one cell's value by `delta` (output space), for memory editing.
    """

    memory_kind = "readout"
    memory_cell_axes: tuple[str, ...] = ("cell",)

    @property
    def memory_cell_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def memory_num_cells(self) -> int:
        count = 1
        for size in self.memory_cell_shape:
            count *= size
        return count

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def memory_values(self) -> torch.Tensor:
        raise NotImplementedError

    def memory_value_parameter(self) -> nn.Parameter:
        raise NotImplementedError

    def add_to_memory_value(self, cell: int, delta: torch.Tensor) -> None:
        raise NotImplementedError

    def memory_value_delta_for_output(
        self, cell: int, coefficients: torch.Tensor, output_change: torch.Tensor
    ) -> torch.Tensor:
        """The `add_to_memory_value(cell, delta)` argument that moves the output by `output_change` where the
        coefficients are `coefficients` `[num_cells]`: `output_change / c_cell`, as each cell stores its own value
        (blocks whose cells share stored values override this)."""
        return output_change / float(coefficients[cell])


class LinearReadoutMemory(FeedForwardMemory):
    """The memory of an FFN whose last layer is one linear `readout` reading the coefficients as its first
    `memory_num_cells` inputs: the value of cell j is column j of the readout's weight."""

    @property
    def memory_readout(self) -> nn.Linear:
        raise NotImplementedError

    @property
    def memory_cell_shape(self) -> tuple[int, ...]:
        return (self.memory_readout.in_features,)

    def memory_values(self) -> torch.Tensor:
        return linear_weight_in_use(self.memory_readout)[:, : self.memory_num_cells].t()

    def memory_value_parameter(self) -> nn.Parameter:
        return self.memory_readout.weight

    @torch.no_grad()
    def add_to_memory_value(self, cell: int, delta: torch.Tensor) -> None:
        weight = self.memory_readout.weight
        weight[:, cell] += delta.to(device=weight.device, dtype=weight.dtype)


class SwiGLUFeedForward(LinearReadoutMemory, nn.Module):
    """down(act(gate(x)) * up(x)); memory cells are the intermediate units, values the columns of `down_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    @classmethod
    def from_config(cls, config) -> "SwiGLUFeedForward":
        """The FFN on the residual stream of a config (`residual_ffn_size` wide)."""
        return cls(config.hidden_size, config.residual_ffn_size, config.hidden_act)

    @property
    def memory_readout(self) -> nn.Linear:
        return self.down_proj

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.memory_coefficients(hidden_states))


class KVFeedForward(LinearReadoutMemory, nn.Module):
    """KV-FFN, `y = W_o(act(W_k x + b_k) * (W_v x + b_v)) + b_o (+ x)`, and its baselines (see `KVFFNConfig`:
    the `+ x` of the paper is the decoder's residual; the block adds its input again only with
    `kvffn_inner_residual=True`).

    Keys and values come from one linear layer `key_value_proj` (output 2i is key i, output 2i + 1 value i: one GEMM
    and one weight tensor instead of two), the output projection is `out_proj`. Between them, `act(keys) * values`
    is one Triton kernel per direction on CUDA, in eager mode and under `torch.compile` (`ffn_triton.py`;
    `decoder_kernels` decides, as for the decoder's norms; `path_description` says which runs), PyTorch operations
    otherwise. Checkpoints store
    the key and value projections as `key_proj` and `value_proj` (see `KEY_VALUE_CONVERSION` in
    `modeling_kvffn.py`). The ReLU and DenseNet baselines have keys only, `key_proj`; the DenseNet baseline's
    `out_proj` reads [hidden; x]. Memory cells are the hidden units, values the columns of `out_proj` (the DenseNet
    input copy and the inner residual are not memories).
    """

    def __init__(self, config):
        super().__init__()
        hidden_size, width, bias = config.hidden_size, config.intermediate_size, config.kvffn_bias
        self.variant = config.ffn_variant
        self.composition = config.kvffn_composition
        self.inner_residual = config.kvffn_inner_residual and self.variant == "kvffn"
        self.width = width
        if self.variant in ("relu", "densenet"):
            self.key_proj, self.key_value_proj = nn.Linear(hidden_size, width, bias=bias), None
        else:
            self.key_proj, self.key_value_proj = None, nn.Linear(hidden_size, 2 * width, bias=bias)
        out_features_in = width + hidden_size if self.variant == "densenet" else width
        self.out_proj = nn.Linear(out_features_in, hidden_size, bias=bias)
        for linear in (self.key_proj, self.key_value_proj, self.out_proj):
            if linear is not None:
                linear.init_std = config.kvffn_init_std  # kv-ffn.md: every weight ~ N(0, sigma)
        activation = {"kvffn": config.kvffn_activation, "relu": "relu", "densenet": "relu", "glu": "sigmoid"}
        self.activation = activation[self.variant]
        self.act_fn = ACT2FN[self.activation]
        self.product = not (self.variant == "kvffn" and self.composition == "sum")  # act(keys) * values, or +
        self.kernels = config.decoder_kernels
        self.dropout = nn.Dropout(config.kvffn_dropout)
        self._path_logged = False

    def check_distributed_loading(self, distributed_config, model_name: str, device_type: str) -> None:
        """Tensor parallelism shards `key_value_proj`'s rows, interleaved key and value: each rank needs whole
        key/value pairs, so `intermediate_size` must divide by `tp_size` (loading would otherwise stop at a size
        mismatch of the shards)."""
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        if self.key_value_proj is not None and self.width % tp_size:
            multiple = max(self.width // tp_size, 1) * tp_size
            raise ValueError(
                f"{model_name}: intermediate_size={self.width} must divide by tp_size={tp_size} under tensor "
                "parallelism (key_value_proj interleaves key and value rows, and each rank takes whole pairs), e.g. "
                f"intermediate_size={multiple}")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state dict in the checkpoint's names (`key_proj` and `value_proj`, as the HF Trainer reads a saved
        checkpoint back to resume or to load the best one) fills `key_value_proj`, interleaved as loading does; one
        of the two alone (a shard of a sharded checkpoint) fills its own rows."""
        if self.key_value_proj is not None:
            for name in ("weight", "bias"):
                fused = getattr(self.key_value_proj, name)
                load_checkpoint_parts(
                    state_dict, [f"{prefix}key_proj.{name}", f"{prefix}value_proj.{name}"],
                    f"{prefix}key_value_proj.{name}", fused,
                    join=lambda parts: torch.stack(parts, dim=1).flatten(0, 1),
                    rows_of_part=lambda index, fused=fused: fused[index::2], error_msgs=error_msgs)
            # (what is left under the former layers' names are modules that were inside them)
            refuse_adapters_of_former_key_value_layers([key for key in state_dict if key.startswith(prefix)])
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def memory_readout(self) -> nn.Linear:
        return self.out_proj

    @property
    def memory_cell_shape(self) -> tuple[int, ...]:
        return (self.width,)

    def _paired_kernels_unavailable(self, pairs: torch.Tensor) -> str | None:
        """Why `act(keys) * values` runs as PyTorch operations for the projection output `pairs` (None: the
        Triton kernels run)."""
        if self.key_value_proj is None:
            return f"the {self.variant} baseline has keys only"
        return paired_kernels_unavailable(pairs, self.kernels)

    def path_description(self, hidden_states: torch.Tensor | None = None) -> str:
        """What computes the activation between the projections for `hidden_states` (by default one token on the
        parameters' device and dtype)."""
        weight = self.out_proj.weight
        if hidden_states is None:
            hidden_states = weight.new_empty(1, 1, self.out_proj.in_features)
        reason = self._paired_kernels_unavailable(hidden_states)
        if reason is None:
            return f"Triton kernels for {self.activation}(keys) {'*' if self.product else '+'} values"
        return f"PyTorch operations for the activation ({reason})"

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The hidden activation that `out_proj` reads (without the DenseNet input copy)."""
        if self.key_value_proj is None:
            return self.act_fn(self.key_proj(hidden_states))
        pairs = self.key_value_proj(hidden_states)  # key i at 2i, value i at 2i + 1
        # (the compile check first: read while tracing, the flag would become a guard, and the eager forward that
        # sets it would make every compiled graph of the model recompile)
        if not torch.compiler.is_compiling() and not self._path_logged:
            logger.info("KV-FFN runs %s", self.path_description(pairs))
            self._path_logged = True
        if self._paired_kernels_unavailable(pairs) is None:
            return paired_activation(pairs, self.activation, self.product)
        keys, values = pairs.unflatten(-1, (-1, 2)).unbind(-1)
        keys = self.act_fn(keys)
        return keys * values if self.product else keys + values

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.memory_coefficients(hidden_states)
        if self.variant == "densenet":
            hidden = torch.cat([hidden, hidden_states], dim=-1)
        output = self.dropout(self.out_proj(hidden))
        return output + hidden_states if self.inner_residual else output


class TokenMemory(nn.Module):
    """Every layer's FFN on the token embeddings X0, stacked: layer l computes SwiGLU_l(RMSNorm_l(x0)).

    Since X0 does not depend on the layer, all layers run together as one batched matmul before the decoder loop.
    Parameters: `rmsnorm_weight` [N, d], `gate_proj` [N, I, d], `up_proj` [N, I, d], `down_proj` [N, d, I]. The
    RMSNorm weights carry `rmsnorm` in their name, by which the HF Trainer leaves them out of weight decay, as it does
    the decoder's norms (it would decay a `norm_weight`); checkpoints keep them as `norm_weight` (see
    `modeling_memoryllm.py`), which `load_state_dict` also takes.
    Because the input is a token embedding, the output for a token id never depends on its context: it can be
    precomputed for the whole vocabulary as a token lookup table. `layer_memory(l)` is layer l's FFN read as memory.
    """

    def __init__(self, num_layers: int, hidden_size: int, intermediate_size: int, eps: float, hidden_act: str):
        super().__init__()
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.eps = eps
        self.rmsnorm_weight = nn.Parameter(torch.ones(num_layers, hidden_size))
        self.gate_proj = nn.Parameter(torch.empty(num_layers, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_layers, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_layers, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[hidden_act]

    @property
    def norm_weight(self) -> nn.Parameter:
        """The RMSNorm weights under their checkpoint name."""
        return self.rmsnorm_weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """A state dict in the checkpoint's names (`norm_weight`, as the HF Trainer reads a saved checkpoint back to
        resume or to load the best one) fills `rmsnorm_weight`."""
        if f"{prefix}norm_weight" in state_dict and f"{prefix}rmsnorm_weight" not in state_dict:
            state_dict[f"{prefix}rmsnorm_weight"] = state_dict.pop(f"{prefix}norm_weight")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def init_own_parameters(self, std: float) -> None:
        for name in ("rmsnorm_weight", "gate_proj", "up_proj", "down_proj"):
            self.init_layers(name, getattr(self, name), std)

    @staticmethod
    def init_layers(name: str, layers: torch.Tensor, std: float) -> None:
        """Draw `layers` (layers of the parameter `name`, stacked) as a new model's: the norm weights 1, the
        projections N(0, std)."""
        if name == "rmsnorm_weight":
            init.ones_(layers)
        else:
            init.normal_(layers, mean=0.0, std=std)

    def forward(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        """[B, L, d] -> [B, L, N, d]: each token's FFN output for every layer. The result is a view of a layer-major
        [N, B, L, d] tensor, so each layer's output is contiguous and `ComputedMemoryReadout` hands the layers their
        parts without a copy (and the backward pass joins the layers' gradients in one step)."""
        return self.forward_layers(token_embeddings, None)

    def forward_layers(self, token_embeddings: torch.Tensor, layers: list[int] | torch.Tensor | None) -> torch.Tensor:
        """Like `forward`, for a subset of layers (in the given order): [B, L, d] -> [B, L, len(layers), d]."""
        index = self._layer_index(layers)
        down_proj = self.down_proj if index is None else self.down_proj[index]
        outputs = torch.einsum("n...i,ndi->n...d", self._layer_major_hidden(token_embeddings, index), down_proj)
        return outputs.movedim(0, -2)

    def hidden_activations(self, token_embeddings: torch.Tensor, layers: list[int] | torch.Tensor | None) -> torch.Tensor:
        """act(gate(n)) * up(n) with n = RMSNorm_l(x0), what `down_proj` reads: [..., d] -> [..., len(layers), I]."""
        return self._layer_major_hidden(token_embeddings, self._layer_index(layers)).movedim(0, -2)

    def _layer_major_hidden(self, token_embeddings: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """`hidden_activations` with the layers first, [len(layers), ..., I]: every product is one batched matmul
        over the layers that reads and writes whole contiguous [tokens, width] slabs."""
        norm_weight, gate_proj, up_proj = (
            (self.rmsnorm_weight, self.gate_proj, self.up_proj)
            if index is None
            else (self.rmsnorm_weight[index], self.gate_proj[index], self.up_proj[index])
        )
        normalized = rms_normalize(token_embeddings, self.eps).to(token_embeddings.dtype)
        norm_weight = norm_weight.view(norm_weight.shape[0], *([1] * (normalized.dim() - 1)), norm_weight.shape[-1])
        per_layer_inputs = normalized.unsqueeze(0) * norm_weight  # [N, ..., d]
        gate = torch.einsum("n...d,nid->n...i", per_layer_inputs, gate_proj)
        up = torch.einsum("n...d,nid->n...i", per_layer_inputs, up_proj)
        return self.act_fn(gate) * up

    def _layer_index(self, layers: list[int] | torch.Tensor | None) -> torch.Tensor | None:
        if layers is None or isinstance(layers, torch.Tensor) and layers.device == self.rmsnorm_weight.device:
            return layers
        return torch.as_tensor(layers, device=self.rmsnorm_weight.device, dtype=torch.long)

    def layer_memory(self, layer: int) -> "TokenMemoryLayer":
        return TokenMemoryLayer(self, layer)

    def extra_repr(self) -> str:
        # From the constructor's sizes, not the parameters' shapes: those are empty while DeepSpeed ZeRO-3 shards them.
        return f"layers={self.num_layers}, hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}"


class TokenMemoryLayer(FeedForwardMemory):
    """Layer `layer` of a `TokenMemory` read as memory: coefficients from the token embeddings X0, values the columns
    of `down_proj[layer]`. A view: it holds no parameters of its own."""

    memory_kind = "token_memory"

    def __init__(self, memory: TokenMemory, layer: int):
        self.memory = memory
        self.layer = layer

    @property
    def memory_cell_shape(self) -> tuple[int, ...]:
        return (self.memory.down_proj.shape[-1],)

    def memory_coefficients(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        return self.memory.hidden_activations(token_embeddings, [self.layer])[..., 0, :]

    def memory_values(self) -> torch.Tensor:
        return self.memory.down_proj[self.layer].detach().t()

    def memory_value_parameter(self) -> nn.Parameter:
        return self.memory.down_proj

    @torch.no_grad()
    def add_to_memory_value(self, cell: int, delta: torch.Tensor) -> None:
        down = self.memory.down_proj
        down[self.layer, :, cell] += delta.to(device=down.device, dtype=down.dtype)


def build_token_memory(config) -> TokenMemory | None:
    if config.token_memory_size is None:
        return None
    return TokenMemory(
        config.num_hidden_layers, config.hidden_size, config.token_memory_size, config.rms_norm_eps, config.hidden_act
    )
