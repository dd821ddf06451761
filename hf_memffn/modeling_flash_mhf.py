"""FlashMHFLlama: the shared decoder (`modeling_memffn.py`) with the multi-head FFNs of `ffn_multihead.py`.

`config.residual_ffn` picks the block: FlashMHF (and its MH-FFN / Dense-MoE sizes), the PKV baseline, or SwiGLU.
Saved checkpoints carry this file, the shared decoder and the fused FlashMHF op with its kernels.
"""

from __future__ import annotations

from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import FlashMHFLlamaConfig
from .ffn_multihead import FlashMHFFeedForward, ParametricKVFeedForward
from .modeling_memffn import MemFFNForCausalLM, MemFFNModel, register_for_auto_classes


class FlashMHFLlamaModel(MemFFNModel):
    config_class = FlashMHFLlamaConfig
    residual_ffn_blocks = {
        **MemFFNModel.residual_ffn_blocks,
        "flash_mhf": FlashMHFFeedForward,
        "pkv": ParametricKVFeedForward,
    }


class FlashMHFLlamaForCausalLM(MemFFNForCausalLM, GenerationMixin):
    config_class = FlashMHFLlamaConfig
    base_model_class = FlashMHFLlamaModel


register_for_auto_classes(FlashMHFLlamaConfig, FlashMHFLlamaModel, FlashMHFLlamaForCausalLM)

__all__ = ["FlashMHFLlamaModel", "FlashMHFLlamaForCausalLM"]
