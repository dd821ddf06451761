"""KVFFN: the shared decoder (`modeling_memffn.py`) with the KV-FFN block (or one of its baselines) on the residual
stream. Saved checkpoints carry this file and the shared decoder only."""

from __future__ import annotations

from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import KVFFNConfig
from .ffn import KVFeedForward
from .modeling_memffn import MemFFNForCausalLM, MemFFNModel, register_for_auto_classes


class KVFFNModel(MemFFNModel):
    config_class = KVFFNConfig
    residual_ffn_blocks = {"kvffn": KVFeedForward}


class KVFFNForCausalLM(MemFFNForCausalLM, GenerationMixin):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


register_for_auto_classes(KVFFNConfig, KVFFNModel, KVFFNForCausalLM)

__all__ = ["KVFFNModel", "KVFFNForCausalLM"]
