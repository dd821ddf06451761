"""Modeling of the four FFN-as-memory architectures: one Llama-style decoder, four wirings of its FFNs.

A decoder layer computes

    X_{L+1} = X_L + Attn(norm(X_L)) [+ FFN(norm(.))] [+ FFN_L(X0)]

where the FFN on the residual stream (`mlp`) is FlashMHF, SwiGLU or KV-FFN and reads either X_L + Attn (sequential,
like Llama) or X_L (parallel, FlexMemoryLLM's FFN-C), and the FFN on the token embeddings X0 (MemoryLLM, FFN-M) comes
from the model-level `TokenMemory`, computed for all layers at once before the loop. The config says which parts a
model has (`residual_ffn`, `parallel_residual_ffn`, `token_memory_size`); each architecture's classes below are
thin compositions that only name their config.

This file and its sibling imports are copied next to saved checkpoints for `trust_remote_code`: they import only
torch, transformers, safetensors and (guarded) triton.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.utils import can_return_tuple

from .configuration_memffn import (
    FlashMHFLlamaConfig,
    FlexMemoryLLMConfig,
    KVFFNConfig,
    MemFFNConfig,
    MemoryLLMConfig,
)
from .ffn import (
    FlashMHFFeedForward,
    ParametricKVFeedForward,
    TokenMemory,
    build_residual_ffn,
    build_token_memory,
)
from .model_card import render_model_card
from .rms_norm import MemFFNRMSNorm
from .token_lookup import TokenLookupMixin


# --------------------------------------------------------------------------------------------------------------------
# Rotary position embeddings (default RoPE with `rope_theta`)
# --------------------------------------------------------------------------------------------------------------------
class MemFFNRotary(nn.Module):
    """cos/sin tables for positions; the inverse frequencies are recomputed on the fly (no buffer to initialize)."""

    def __init__(self, config: MemFFNConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, device=x.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.rope_theta**exponents)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


# --------------------------------------------------------------------------------------------------------------------
# Attention (grouped-query, through transformers' attention interface)
# --------------------------------------------------------------------------------------------------------------------
def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * n_rep, L, D]"""
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, length, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, length, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MemFFNAttention(nn.Module):
    def __init__(self, config: MemFFNConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(query, key, cos, sin)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


# --------------------------------------------------------------------------------------------------------------------
# The FFN on X0 enters each layer through a readout
# --------------------------------------------------------------------------------------------------------------------
class ComputedMemoryReadout:
    """Each layer's output of the FFNs on X0, computed by `TokenMemory` ([B, L, N, d]).

    A token lookup table provides the same `add_into` from the token ids instead (see `token_lookup.py`).
    """

    def __init__(self, outputs: torch.Tensor):
        self.outputs = outputs

    def add_into(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return hidden_states + self.outputs[:, :, layer_idx]


# --------------------------------------------------------------------------------------------------------------------
# Decoder layer, written once
# --------------------------------------------------------------------------------------------------------------------
class MemFFNDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MemFFNConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel_residual_ffn = config.parallel_residual_ffn
        self.self_attn = MemFFNAttention(config, layer_idx)
        self.input_layernorm = MemFFNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = build_residual_ffn(config)
        self.post_attention_layernorm = (
            MemFFNRMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.mlp is not None else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        memory_readout: ComputedMemoryReadout | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer_input = hidden_states
        attn_output, attn_weights = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            **kwargs,
        )
        hidden_states = layer_input + attn_output
        if self.mlp is not None:
            ffn_input = layer_input if self.parallel_residual_ffn else hidden_states
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(ffn_input))
        if memory_readout is not None:
            hidden_states = memory_readout.add_into(hidden_states, self.layer_idx)
        return hidden_states, attn_weights


# --------------------------------------------------------------------------------------------------------------------
# Pretrained base: initialization, parameter counts, saving with tokenizer and model card
# --------------------------------------------------------------------------------------------------------------------
class MemFFNPreTrainedModel(PreTrainedModel):
    config_class = MemFFNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MemFFNDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            # Blocks that follow their paper's init (KV-FFN: N(0, kvffn_init_std)) tag their layers with `init_std`.
            init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MemFFNRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, FlashMHFFeedForward):
            for param in (module.key, module.up, module.value, module.router):
                if param is not None:
                    init.normal_(param, mean=0.0, std=std)
        elif isinstance(module, ParametricKVFeedForward):
            init.normal_(module.key, mean=0.0, std=std)
            init.normal_(module.value, mean=0.0, std=std)
        elif isinstance(module, TokenMemory):
            init.ones_(module.norm_weight)
            for param in (module.gate_proj, module.up_proj, module.down_proj):
                init.normal_(param, mean=0.0, std=std)

    def _token_memory(self) -> TokenMemory | None:
        base = getattr(self, self.base_model_prefix, self)
        return getattr(base, "memory", None)

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters, and active ones: those left on the device once the FFNs on the token embeddings X0
        become token lookup tables (equal for architectures without such FFNs). Tied weights count once."""
        def numel(parameter) -> int:  # DeepSpeed ZeRO-3 leaves each parameter empty and records its size in ds_numel
            return getattr(parameter, "ds_numel", parameter.numel())

        total = sum(numel(p) for p in self.parameters())
        memory = self._token_memory()
        in_memory = sum(numel(p) for p in memory.parameters()) if memory is not None else 0
        return {"total": total, "active": total - in_memory}

    def attach_tokenizer(self, tokenizer) -> None:
        """Save this tokenizer with the model in `save_pretrained` (and `push_to_hub`)."""
        self._attached_tokenizer = tokenizer

    @property
    def attached_tokenizer(self):
        return getattr(self, "_attached_tokenizer", None)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the attached tokenizer and a model card (README.md)."""
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            if self.attached_tokenizer is not None:
                self.attached_tokenizer.save_pretrained(save_directory)
            card_path = os.path.join(save_directory, "README.md")
            if not os.path.exists(card_path):
                tmp_path = card_path + ".tmp"
                with open(tmp_path, "w", encoding="utf-8") as handle:
                    handle.write(render_model_card(self))
                os.replace(tmp_path, card_path)
        return result

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload exactly what `save_pretrained` writes (weights, config, remote code, tokenizer, this package's model
        card, and an attached token lookup table) in one commit; see `hub.push_checkpoint` for the options.
        transformers' own `push_to_hub` would replace the model card with a generic template."""
        from .hub import push_checkpoint

        return push_checkpoint(self, repo_id, **kwargs)


# --------------------------------------------------------------------------------------------------------------------
# The decoder stack
# --------------------------------------------------------------------------------------------------------------------
class MemFFNModel(MemFFNPreTrainedModel):
    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(MemFFNDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.memory = build_token_memory(config)
        self.norm = MemFFNRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = MemFFNRotary(config)
        self.token_lookup = None  # set by `load_tols` (token_lookup.py) to read the FFNs on X0 from a table
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def memory_readout(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor):
        """Where each layer's FFN on X0 comes from: a token lookup table if one is loaded, else `TokenMemory`."""
        if self.token_lookup is not None:
            if input_ids is None:
                raise ValueError("token lookup tables are loaded: pass `input_ids` (not `inputs_embeds`)")
            return self.token_lookup.readout(input_ids)
        if self.memory is None:
            if self.config.token_memory_size is None:
                return None
            raise RuntimeError(
                "the FFNs on the token embeddings were dropped (`drop_memory_ffn`) and no lookup table is loaded"
            )
        if self.gradient_checkpointing and self.training:
            outputs = torch.utils.checkpoint.checkpoint(self.memory, inputs_embeds, use_reentrant=False)
        else:
            outputs = self.memory(inputs_embeds)
        return ComputedMemoryReadout(outputs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` or `inputs_embeds`")
        kwargs.pop("return_dict", None)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = (
            self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            position_ids=position_ids,
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        memory_readout = self.memory_readout(input_ids, inputs_embeds)

        hidden_states = inputs_embeds
        all_hidden_states = [] if output_hidden_states else None
        all_attentions = [] if output_attentions else None
        for layer in self.layers[: self.config.num_hidden_layers]:
            if all_hidden_states is not None:
                all_hidden_states.append(hidden_states)
            hidden_states, attn_weights = layer(
                hidden_states,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                past_key_values=past_key_values,
                memory_readout=memory_readout,
                position_ids=position_ids,
                **kwargs,
            )
            if all_attentions is not None:
                all_attentions.append(attn_weights)
        hidden_states = self.norm(hidden_states)
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states=tuple(all_hidden_states) if all_hidden_states is not None else None,
            attentions=tuple(all_attentions) if all_attentions is not None else None,
        )


class MemFFNForCausalLM(MemFFNPreTrainedModel, GenerationMixin):
    base_model_class = MemFFNModel
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        # Only compute the logits that are asked for (generation needs the last position only).
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# --------------------------------------------------------------------------------------------------------------------
# The four architectures: thin compositions naming their config
# --------------------------------------------------------------------------------------------------------------------
class FlashMHFLlamaModel(MemFFNModel):
    config_class = FlashMHFLlamaConfig


class FlashMHFLlamaForCausalLM(MemFFNForCausalLM):
    config_class = FlashMHFLlamaConfig
    base_model_class = FlashMHFLlamaModel


# The models with FFNs on X0 also keep their stacked `TokenMemory` whole (device_map, FSDP wrapping).
_WITH_TOKEN_MEMORY = ["MemFFNDecoderLayer", "TokenMemory"]


class MemoryLLMModel(MemFFNModel):
    config_class = MemoryLLMConfig
    _no_split_modules = _WITH_TOKEN_MEMORY


class MemoryLLMForCausalLM(TokenLookupMixin, MemFFNForCausalLM):
    config_class = MemoryLLMConfig
    base_model_class = MemoryLLMModel
    _no_split_modules = _WITH_TOKEN_MEMORY


class FlexMemoryLLMModel(MemFFNModel):
    config_class = FlexMemoryLLMConfig
    _no_split_modules = _WITH_TOKEN_MEMORY


class FlexMemoryLLMForCausalLM(TokenLookupMixin, MemFFNForCausalLM):
    config_class = FlexMemoryLLMConfig
    base_model_class = FlexMemoryLLMModel
    _no_split_modules = _WITH_TOKEN_MEMORY


class KVFFNModel(MemFFNModel):
    config_class = KVFFNConfig


class KVFFNForCausalLM(MemFFNForCausalLM):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


MODEL_CLASSES = {
    FlashMHFLlamaConfig: (FlashMHFLlamaModel, FlashMHFLlamaForCausalLM),
    MemoryLLMConfig: (MemoryLLMModel, MemoryLLMForCausalLM),
    FlexMemoryLLMConfig: (FlexMemoryLLMModel, FlexMemoryLLMForCausalLM),
    KVFFNConfig: (KVFFNModel, KVFFNForCausalLM),
}

# `save_pretrained` copies this file and its sibling imports next to the weights, and config.json's `auto_map`
# points `AutoConfig` / `AutoModel` / `AutoModelForCausalLM` at them (see `MemFFNConfig.default_auto_map`).
for _config_class, (_model_class, _causal_lm_class) in MODEL_CLASSES.items():
    _config_class.register_for_auto_class("AutoConfig")
    _model_class.register_for_auto_class("AutoModel")
    _causal_lm_class.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "MemFFNPreTrainedModel",
    "MemFFNModel",
    "MemFFNForCausalLM",
    "FlashMHFLlamaModel",
    "FlashMHFLlamaForCausalLM",
    "MemoryLLMModel",
    "MemoryLLMForCausalLM",
    "FlexMemoryLLMModel",
    "FlexMemoryLLMForCausalLM",
    "KVFFNModel",
    "KVFFNForCausalLM",
]
