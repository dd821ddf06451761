"""The feed-forward blocks, all behind one interface: `ffn(hidden_states [B, L, d]) -> [B, L, d]`.

- `SwiGLUFeedForward`: the Llama MLP (baseline; FlexMemoryLLM's FFN-C).
- `FlashMHFFeedForward`: multi-head FFN with E gated SwiGLU sub-networks per head (flash-mhf.md eq. 10-14), and the
  paper's MH-FFN (E=1, no gates) and Dense-MoE (one head) baselines, which are the same module with other sizes.
- `ParametricKVFeedForward`: the PKV baseline, per-head softmax attention over learned key/value slots.
- `KVFeedForward`: the KV-FFN block (kv-ffn.md eq. 1-3) and its ReLU / GLU / DenseNet baselines.
- `TokenMemory`: every layer's SwiGLU FFN on the token embeddings X0 (MemoryLLM, FlexMemoryLLM's FFN-M), stacked so
  all layers run as one batched matmul outside the decoder loop.

`build_residual_ffn(config)` picks the block a decoder layer applies to its residual stream.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from .flash_mhf_op import flash_mhf, flash_mhf_path
from .rms_norm import MemFFNRMSNorm, rms_normalize

logger = logging.getLogger(__name__)


class _TokenChunkedRecompute(torch.autograd.Function):
    """Runs a position-wise module over [1, n, d] tokens chunk by chunk without keeping any activation: the backward
    pass recomputes each chunk and writes its input gradient straight into one preallocated tensor."""

    @staticmethod
    def forward(ctx, module, chunk_tokens, tokens, *params):
        ctx.module, ctx.chunk_tokens, ctx.params = module, chunk_tokens, params
        device_type = tokens.device.type  # the recompute runs under the same autocast as this forward
        ctx.autocast = dict(device_type=device_type, enabled=torch.is_autocast_enabled(device_type),
                            dtype=torch.get_autocast_dtype(device_type))
        ctx.save_for_backward(tokens)
        output = None
        for start in range(0, tokens.shape[1], chunk_tokens):
            chunk_output = module._forward(tokens[:, start : start + chunk_tokens])
            if output is None:
                output = chunk_output.new_empty(1, tokens.shape[1], chunk_output.shape[-1])
            output[:, start : start + chunk_tokens] = chunk_output
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (tokens,) = ctx.saved_tensors
        needs_tokens = ctx.needs_input_grad[2]
        params = [p for p, needed in zip(ctx.params, ctx.needs_input_grad[3:]) if needed]
        grad_tokens = torch.empty_like(tokens) if needs_tokens else None
        grad_params = [None] * len(params)
        for start in range(0, tokens.shape[1], ctx.chunk_tokens):
            stop = start + ctx.chunk_tokens
            grads = _TokenChunkedRecompute._chunk_gradients(
                ctx, tokens[:, start:stop], grad_output[:, start:stop], params, needs_tokens
            )
            if needs_tokens:
                grad_tokens[:, start:stop] = grads.pop(0)
            for i, grad in enumerate(grads):
                grad_params[i] = grad if grad_params[i] is None else grad_params[i].add_(grad)
            del grads
        grads_by_param = iter(grad_params)
        all_param_grads = [next(grads_by_param) if needed else None for needed in ctx.needs_input_grad[3:]]
        return None, None, grad_tokens, *all_param_grads

    @staticmethod
    def _chunk_gradients(ctx, chunk, grad_chunk, params, needs_tokens) -> list[torch.Tensor]:
        # a function of its own, so the chunk's activations are freed before the next chunk runs
        chunk = chunk.detach().requires_grad_(needs_tokens)
        with torch.enable_grad(), torch.autocast(**ctx.autocast):
            chunk_output = ctx.module._forward(chunk)
        inputs = ([chunk] if needs_tokens else []) + params
        return list(torch.autograd.grad(chunk_output, inputs, grad_chunk))


def recompute_in_token_chunks(module: nn.Module, hidden_states: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Apply a position-wise `module._forward` ([1, n, d] -> [1, n, d']) to [B, L, d] keeping only the input for the
    backward pass: the B*L tokens run as chunks of `chunk_tokens`, each recomputed in the backward pass, so the
    activation memory of the backward pass is one chunk's, whatever B and L. Costs one extra forward of the module."""
    batch, length, width = hidden_states.shape
    tokens = hidden_states.reshape(1, batch * length, width)
    output = _TokenChunkedRecompute.apply(module, chunk_tokens, tokens, *module.parameters())
    return output.view(batch, length, -1)


class SwiGLUFeedForward(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class _MultiHeadQueries(nn.Module):
    """Shared front and back of the multi-head FFNs: project to per-head queries, and heads back to the model."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.ffn_num_heads
        self.head_dim = config.hidden_size // config.ffn_num_heads
        hidden_size = config.hidden_size
        self.in_proj = nn.Linear(hidden_size, hidden_size, bias=False) if config.ffn_io_projections else None
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=False) if config.ffn_io_projections else None
        self.query_norm = MemFFNRMSNorm(self.head_dim, eps=config.rms_norm_eps) if config.ffn_query_norm else None

    def queries(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, L, d] -> [B, H, L, d_h]"""
        batch, length, _ = hidden_states.shape
        if self.in_proj is not None:
            hidden_states = self.in_proj(hidden_states)
        queries = hidden_states.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        return self.query_norm(queries) if self.query_norm is not None else queries

    def merge_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, H, L, d_h] -> [B, L, d]"""
        batch, _, length, _ = heads.shape
        merged = heads.transpose(1, 2).reshape(batch, length, self.num_heads * self.head_dim)
        return self.out_proj(merged) if self.out_proj is not None else merged


class FlashMHFFeedForward(_MultiHeadQueries):
    """Flash Multi-Head FFN. Per head h with query q (after `in_proj` and `query_norm`):

        R = sigmoid(q W_router) / (sum_E sigmoid(q W_router) + eps)        (gate logits in float32)
        S_h = sum_e R_e * (SiLU(q K_e^T) * (q U_e^T)) V_e                   (the fused op, `flash_mhf`)

    then heads are concatenated and projected by `out_proj`. `key`, `up`, `value` hold the sub-network weights,
    [ffn_num_kv_heads, E, subnetwork_size, d_h]; groups of heads share them like grouped-query attention.
    With `ffn_variant="mh_ffn"` there is a single sub-network and no router (the naive multi-head FFN).
    With `ffn_recompute_chunk_tokens` > 0 the module keeps only its input for the backward pass and recomputes its
    activations chunk by chunk (see `recompute_in_token_chunks`).
    """

    def __init__(self, config):
        super().__init__(config)
        self.num_subnetworks = config.ffn_num_subnetworks
        self.subnetwork_size = config.intermediate_size // config.ffn_num_subnetworks
        self.gate_eps = config.ffn_gate_eps
        self.kernel = config.ffn_kernel
        shape = (config.ffn_num_kv_heads, self.num_subnetworks, self.subnetwork_size, self.head_dim)
        self.key = nn.Parameter(torch.empty(shape))
        self.up = nn.Parameter(torch.empty(shape))
        self.value = nn.Parameter(torch.empty(shape))
        if config.ffn_variant == "mh_ffn":
            self.router = None
        else:
            self.router = nn.Parameter(torch.empty(self.num_heads, self.head_dim, self.num_subnetworks))
        self.recompute_chunk_tokens = config.ffn_recompute_chunk_tokens
        self._path_logged = False

    def gates(self, queries: torch.Tensor) -> torch.Tensor:
        """Normalized sub-network weights R [B, H, L, E] in float32 (also under autocast)."""
        if self.router is None:
            return queries.new_ones((*queries.shape[:-1], 1), dtype=torch.float32)
        with torch.autocast(queries.device.type, enabled=False):
            logits = torch.einsum("bhld,hde->bhle", queries.float(), self.router.float())
        scores = torch.sigmoid(logits)
        return scores / (scores.sum(dim=-1, keepdim=True) + self.gate_eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.recompute_chunk_tokens and torch.is_grad_enabled():
            return recompute_in_token_chunks(self, hidden_states, self.recompute_chunk_tokens)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        queries = self.queries(hidden_states)
        gates = self.gates(queries)
        if torch.is_autocast_enabled(queries.device.type):
            # The fused op is a custom op that autocast does not see: run it in the autocast dtype (the RMSNorm of
            # the queries returns float32 when its weight is float32), as autocast would run a matmul.
            queries = queries.to(torch.get_autocast_dtype(queries.device.type))
        gates = gates.to(queries.dtype)
        if not self._path_logged and not torch.compiler.is_compiling():
            logger.info("FlashMHF FFN runs the %s path", flash_mhf_path(queries, self.key, impl=self.kernel))
            self._path_logged = True
        heads = flash_mhf(queries, self.key, self.up, self.value, gates, impl=self.kernel)
        return self.merge_heads(heads)


class ParametricKVFeedForward(_MultiHeadQueries):
    """PKV baseline: per head, softmax(q K^T / sqrt(d_h)) V over `intermediate_size` learned key/value slots."""

    def __init__(self, config):
        super().__init__(config)
        slots = config.intermediate_size
        self.key = nn.Parameter(torch.empty(self.num_heads, slots, self.head_dim))
        self.value = nn.Parameter(torch.empty(self.num_heads, slots, self.head_dim))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        queries = self.queries(hidden_states)
        batch = queries.shape[0]
        keys = self.key.to(queries.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
        values = self.value.to(queries.dtype).unsqueeze(0).expand(batch, -1, -1, -1)
        heads = F.scaled_dot_product_attention(queries, keys, values)
        return self.merge_heads(heads)


class KVFeedForward(nn.Module):
    """KV-FFN, `y = W_o(act(W_k x + b_k) * (W_v x + b_v)) + b_o (+ x)`, and its baselines (see `KVFFNConfig`:
    the `+ x` of the paper is the decoder's residual; the block adds its input again only with
    `kvffn_inner_residual=True`).

    Keys are `key_proj`, values `value_proj`, the output projection `out_proj`. The ReLU baseline has no
    `value_proj`; the DenseNet baseline's `out_proj` reads [hidden; x].
    """

    def __init__(self, config):
        super().__init__()
        hidden_size, width, bias = config.hidden_size, config.intermediate_size, config.kvffn_bias
        self.variant = config.ffn_variant
        self.composition = config.kvffn_composition
        self.inner_residual = config.kvffn_inner_residual and self.variant == "kvffn"
        self.key_proj = nn.Linear(hidden_size, width, bias=bias)
        self.value_proj = None if self.variant in ("relu", "densenet") else nn.Linear(hidden_size, width, bias=bias)
        out_features_in = width + hidden_size if self.variant == "densenet" else width
        self.out_proj = nn.Linear(out_features_in, hidden_size, bias=bias)
        for linear in (self.key_proj, self.value_proj, self.out_proj):
            if linear is not None:
                linear.init_std = config.kvffn_init_std  # kv-ffn.md: every weight ~ N(0, sigma)
        activation = {"kvffn": config.kvffn_activation, "relu": "relu", "densenet": "relu", "glu": "sigmoid"}
        self.act_fn = ACT2FN[activation[self.variant]]
        self.dropout = nn.Dropout(config.kvffn_dropout)

    def memory_coefficients(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The hidden activation that `out_proj` reads (without the DenseNet input copy)."""
        keys = self.act_fn(self.key_proj(hidden_states))
        if self.value_proj is None:
            return keys
        values = self.value_proj(hidden_states)
        return keys + values if (self.variant == "kvffn" and self.composition == "sum") else keys * values

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden = self.memory_coefficients(hidden_states)
        if self.variant == "densenet":
            hidden = torch.cat([hidden, hidden_states], dim=-1)
        output = self.dropout(self.out_proj(hidden))
        return output + hidden_states if self.inner_residual else output


class TokenMemory(nn.Module):
    """Every layer's FFN on the token embeddings X0, stacked: layer l computes SwiGLU_l(RMSNorm_l(x0)).

    Since X0 does not depend on the layer, all layers run together as one batched matmul before the decoder loop.
    Parameters: `norm_weight` [N, d], `gate_proj` [N, I, d], `up_proj` [N, I, d], `down_proj` [N, d, I].
    Because the input is a token embedding, the output for a token id never depends on its context: it can be
    precomputed for the whole vocabulary as a token lookup table.
    """

    def __init__(self, num_layers: int, hidden_size: int, intermediate_size: int, eps: float, hidden_act: str):
        super().__init__()
        self.num_layers = num_layers
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(num_layers, hidden_size))
        self.gate_proj = nn.Parameter(torch.empty(num_layers, intermediate_size, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_layers, intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_layers, hidden_size, intermediate_size))
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, token_embeddings: torch.Tensor) -> torch.Tensor:
        """[B, L, d] -> [B, L, N, d]: each token's FFN output for every layer."""
        return self.forward_layers(token_embeddings, None)

    def forward_layers(self, token_embeddings: torch.Tensor, layers: list[int] | torch.Tensor | None) -> torch.Tensor:
        """Like `forward`, for a subset of layers (in the given order): [B, L, d] -> [B, L, len(layers), d]."""
        norm_weight, gate_proj, up_proj, down_proj = self.norm_weight, self.gate_proj, self.up_proj, self.down_proj
        if layers is not None:
            index = torch.as_tensor(layers, device=norm_weight.device, dtype=torch.long)
            norm_weight, gate_proj, up_proj, down_proj = (p[index] for p in (norm_weight, gate_proj, up_proj, down_proj))
        dtype = token_embeddings.dtype
        normalized = rms_normalize(token_embeddings, self.eps).to(dtype)
        per_layer_inputs = normalized.unsqueeze(-2) * norm_weight  # [B, L, N, d]
        gate = torch.einsum("blnd,nid->blni", per_layer_inputs, gate_proj)
        up = torch.einsum("blnd,nid->blni", per_layer_inputs, up_proj)
        return torch.einsum("blni,ndi->blnd", self.act_fn(gate) * up, down_proj)

    def extra_repr(self) -> str:
        layers, width, hidden = self.gate_proj.shape
        return f"layers={layers}, hidden_size={hidden}, intermediate_size={width}"


def build_residual_ffn(config) -> nn.Module | None:
    """The FFN that a decoder layer applies to its residual stream, as the config's wiring says."""
    kind = config.residual_ffn
    if kind is None:
        return None
    if kind == "swiglu":
        return SwiGLUFeedForward(config.hidden_size, config.residual_ffn_size, config.hidden_act)
    if kind == "kvffn":
        return KVFeedForward(config)
    if kind == "flash_mhf":
        if config.ffn_variant == "pkv":
            return ParametricKVFeedForward(config)
        return FlashMHFFeedForward(config)
    raise ValueError(f"unknown residual FFN kind {kind!r}")


def build_token_memory(config) -> TokenMemory | None:
    if config.token_memory_size is None:
        return None
    return TokenMemory(
        config.num_hidden_layers, config.hidden_size, config.token_memory_size, config.rms_norm_eps, config.hidden_act
    )
