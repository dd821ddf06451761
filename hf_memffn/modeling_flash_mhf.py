"""FlashMHFLlama: the shared decoder (`modeling_memffn.py`) with the multi-head FFNs of `ffn_multihead.py`.

`config.residual_ffn` picks the block: FlashMHF (and its MH-FFN / Dense-MoE sizes), the PKV baseline, or SwiGLU.
Saved checkpoints carry this file, the shared decoder and the fused FlashMHF op with its kernels.
"""

from __future__ import annotations

import torch

from transformers.core_model_loading import Concatenate, WeightConverter
from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import FlashMHFLlamaConfig
from .ffn_multihead import FlashMHFFeedForward, ParametricKVFeedForward
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForQuestionAnswering,
    MemFFNForSequenceClassification,
    MemFFNForTokenClassification,
    MemFFNModel,
    add_missing_checkpoint_parts,
    initializer_std,
    register_checkpoint_conversions,
    register_for_auto_classes,
)


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


class FlashMHFLlamaForSequenceClassification(MemFFNForSequenceClassification):
    config_class = FlashMHFLlamaConfig
    base_model_class = FlashMHFLlamaModel


class FlashMHFLlamaForTokenClassification(MemFFNForTokenClassification):
    config_class = FlashMHFLlamaConfig
    base_model_class = FlashMHFLlamaModel


class FlashMHFLlamaForQuestionAnswering(MemFFNForQuestionAnswering):
    config_class = FlashMHFLlamaConfig
    base_model_class = FlashMHFLlamaModel


register_for_auto_classes(FlashMHFLlamaConfig, FlashMHFLlamaModel, FlashMHFLlamaForCausalLM,
                          FlashMHFLlamaForSequenceClassification, FlashMHFLlamaForTokenClassification,
                          FlashMHFLlamaForQuestionAnswering)


class ConcatenateSubnetworkWeights(Concatenate):
    """`Concatenate` of the sub-network weights; one the checkpoint lacks starts new, drawn as `_init_weights` draws
    the sub-network weights (N(0, initializer_range)), and is reported missing (`add_missing_checkpoint_parts`)."""

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        std = initializer_std(kwargs.get("config"))
        add_missing_checkpoint_parts(input_dict, source_patterns, ["mlp.key", "mlp.up", "mlp.value"],
                                     target_patterns[0], lambda part: part.normal_(0.0, std),
                                     kwargs.get("model"), kwargs.get("full_layer_name"))
        return super().convert(input_dict, source_patterns, target_patterns, **kwargs)


# Checkpoints store each FlashMHF layer's sub-network weights as three tensors, `mlp.key`, `mlp.up` and `mlp.value`;
# the module holds them as one parameter `mlp.key_up_value`. Loading concatenates them, saving splits it again.
# (The lookaheads keep `mlp.up` off the SwiGLU baseline's `mlp.up_proj`; saving drops them from the names.)
SUBNETWORK_WEIGHTS_CONVERSION = [
    WeightConverter([r"mlp.key(?!\w)", r"mlp.up(?!\w)", r"mlp.value(?!\w)"], "mlp.key_up_value",
                    operations=[ConcatenateSubnetworkWeights(dim=0)]),
]
register_checkpoint_conversions(FlashMHFLlamaConfig.model_type, SUBNETWORK_WEIGHTS_CONVERSION)

__all__ = ["FlashMHFLlamaModel", "FlashMHFLlamaForCausalLM", "FlashMHFLlamaForSequenceClassification",
           "FlashMHFLlamaForTokenClassification", "FlashMHFLlamaForQuestionAnswering"]
