"""KVFFN: the shared decoder (`modeling_memffn.py`) with the KV-FFN block (or one of its baselines) on the residual
stream. Saved checkpoints carry this file and the shared decoder only."""

from __future__ import annotations

import torch

from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import KVFFNConfig
from .ffn import KVFeedForward
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForQuestionAnswering,
    MemFFNForSequenceClassification,
    MemFFNForTokenClassification,
    MemFFNModel,
    add_missing_checkpoint_parts,
    register_checkpoint_conversions,
    register_for_auto_classes,
)


class KVFFNModel(MemFFNModel):
    config_class = KVFFNConfig
    residual_ffn_blocks = {"kvffn": KVFeedForward}


class KVFFNForCausalLM(MemFFNForCausalLM, GenerationMixin):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


class KVFFNForSequenceClassification(MemFFNForSequenceClassification):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


class KVFFNForTokenClassification(MemFFNForTokenClassification):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


class KVFFNForQuestionAnswering(MemFFNForQuestionAnswering):
    config_class = KVFFNConfig
    base_model_class = KVFFNModel


register_for_auto_classes(KVFFNConfig, KVFFNModel, KVFFNForCausalLM, KVFFNForSequenceClassification,
                          KVFFNForTokenClassification, KVFFNForQuestionAnswering)

# Checkpoints store each KV-FFN layer's key and value projections as two linear layers, `mlp.key_proj` and
# `mlp.value_proj`; the module holds them as one, `mlp.key_value_proj`, whose output features interleave them (key 0,
# value 0, key 1, ...). Loading interleaves the two, saving separates them again. Interleaved, every contiguous share
# of the rows pairs each key with its value, so tensor parallelism shards the layer as a plain column-parallel one
# (transformers shards each checkpoint tensor before the conversion runs). The baselines without values keep
# `mlp.key_proj`, which has no `value_proj` to pair with.
class InterleaveRows(ConversionOps):
    """[n, ...] tensors (all of one shape) -> one [len * n, ...] tensor whose row `len * i + j` is row i of tensor j;
    `separate=True` is the reverse. A projection the checkpoint lacks (`key_proj` or `value_proj`) starts new, drawn
    as `_init_weights` draws the block's weights (N(0, kvffn_init_std), biases 0), and is reported missing
    (`add_missing_checkpoint_parts`)."""

    def __init__(self, separate: bool = False):
        self.separate = separate

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        if self.separate:
            (tensor,) = (value[0] if isinstance(value, list) else value for value in input_dict.values())
            parts = tensor.unflatten(0, (-1, len(target_patterns))).unbind(1)
            return {target: part.contiguous() for target, part in zip(target_patterns, parts)}
        kind = target_patterns[0].rpartition(".")[2]  # "weight" or "bias"
        config = kwargs.get("config")

        def init_part(part: torch.Tensor) -> None:
            if kind == "bias":
                part.zero_()
            else:
                part.normal_(0.0, config.kvffn_init_std)

        add_missing_checkpoint_parts(input_dict, source_patterns, [f"mlp.key_proj.{kind}", f"mlp.value_proj.{kind}"],
                                     target_patterns[0], init_part, kwargs.get("model"),
                                     kwargs.get("full_layer_name"))
        tensors = [input_dict[pattern] for pattern in source_patterns]
        tensors = [tensor[0] if isinstance(tensor, list) else tensor for tensor in tensors]
        return {target_patterns[0]: torch.stack(tensors, dim=1).flatten(0, 1)}

    @property
    def reverse_op(self) -> ConversionOps:
        return InterleaveRows(separate=not self.separate)


KEY_VALUE_CONVERSION = [
    WeightConverter([f"mlp.key_proj.{name}", f"mlp.value_proj.{name}"], f"mlp.key_value_proj.{name}",
                    operations=[InterleaveRows()])
    for name in ("weight", "bias")
]
register_checkpoint_conversions(KVFFNConfig.model_type, KEY_VALUE_CONVERSION)

__all__ = ["KVFFNModel", "KVFFNForCausalLM", "KVFFNForSequenceClassification",
           "KVFFNForTokenClassification", "KVFFNForQuestionAnswering"]
