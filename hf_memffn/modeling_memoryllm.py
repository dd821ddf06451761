"""MemoryLLM and FlexMemoryLLM: the shared decoder (`modeling_memffn.py`) with the stacked FFNs on the token
embeddings X0 (`TokenMemory`), which `load_tols` can replace by token lookup tables (`token_lookup.py`).

MemoryLLM has no FFN on the residual stream; FlexMemoryLLM's FFN-C is a SwiGLU reading the layer input. Saved
checkpoints carry this file, the shared decoder and the token lookup runtime.
"""

from __future__ import annotations

from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.core_model_loading import WeightRenaming
from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import FlexMemoryLLMConfig, MemoryLLMConfig
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForQuestionAnswering,
    MemFFNForSequenceClassification,
    MemFFNForTokenClassification,
    MemFFNModel,
    register_for_auto_classes,
)
from .token_lookup import TokenLookupMixin

class _KeepsTokenMemoryWhole:
    """These models also keep their stacked `TokenMemory` whole (device_map, FSDP wrapping)."""

    _no_split_modules = ["MemFFNDecoderLayer", "TokenMemory"]


class MemoryLLMModel(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNModel):
    config_class = MemoryLLMConfig


class MemoryLLMForCausalLM(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForCausalLM, GenerationMixin):
    config_class = MemoryLLMConfig
    base_model_class = MemoryLLMModel


class FlexMemoryLLMModel(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNModel):
    config_class = FlexMemoryLLMConfig


class FlexMemoryLLMForCausalLM(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForCausalLM, GenerationMixin):
    config_class = FlexMemoryLLMConfig
    base_model_class = FlexMemoryLLMModel


class MemoryLLMForSequenceClassification(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForSequenceClassification):
    config_class = MemoryLLMConfig
    base_model_class = MemoryLLMModel


class MemoryLLMForTokenClassification(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForTokenClassification):
    config_class = MemoryLLMConfig
    base_model_class = MemoryLLMModel


class MemoryLLMForQuestionAnswering(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForQuestionAnswering):
    config_class = MemoryLLMConfig
    base_model_class = MemoryLLMModel


class FlexMemoryLLMForSequenceClassification(_KeepsTokenMemoryWhole, TokenLookupMixin,
                                             MemFFNForSequenceClassification):
    config_class = FlexMemoryLLMConfig
    base_model_class = FlexMemoryLLMModel


class FlexMemoryLLMForTokenClassification(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForTokenClassification):
    config_class = FlexMemoryLLMConfig
    base_model_class = FlexMemoryLLMModel


class FlexMemoryLLMForQuestionAnswering(_KeepsTokenMemoryWhole, TokenLookupMixin, MemFFNForQuestionAnswering):
    config_class = FlexMemoryLLMConfig
    base_model_class = FlexMemoryLLMModel


register_for_auto_classes(MemoryLLMConfig, MemoryLLMModel, MemoryLLMForCausalLM, MemoryLLMForSequenceClassification,
                          MemoryLLMForTokenClassification, MemoryLLMForQuestionAnswering)
register_for_auto_classes(FlexMemoryLLMConfig, FlexMemoryLLMModel, FlexMemoryLLMForCausalLM,
                          FlexMemoryLLMForSequenceClassification, FlexMemoryLLMForTokenClassification,
                          FlexMemoryLLMForQuestionAnswering)

# The RMSNorm weights of `TokenMemory` are `rmsnorm_weight` in the model (a name the HF Trainer leaves out of weight
# decay) and `norm_weight` in checkpoints: loading renames them, saving renames them back.
NORM_WEIGHT_RENAMING = [WeightRenaming("memory.norm_weight", "memory.rmsnorm_weight")]
for _config_class in (MemoryLLMConfig, FlexMemoryLLMConfig):
    register_checkpoint_conversion_mapping(_config_class.model_type, NORM_WEIGHT_RENAMING, overwrite=True)

__all__ = [
    "MemoryLLMModel",
    "MemoryLLMForCausalLM",
    "MemoryLLMForSequenceClassification",
    "MemoryLLMForTokenClassification",
    "MemoryLLMForQuestionAnswering",
    "FlexMemoryLLMModel",
    "FlexMemoryLLMForCausalLM",
    "FlexMemoryLLMForSequenceClassification",
    "FlexMemoryLLMForTokenClassification",
    "FlexMemoryLLMForQuestionAnswering",
]
