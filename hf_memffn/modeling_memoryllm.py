"""MemoryLLM and FlexMemoryLLM: the shared decoder (`modeling_memffn.py`) with the stacked FFNs on the token
embeddings X0 (`TokenMemory`), which `load_tols` can replace by token lookup tables (`token_lookup.py`).

MemoryLLM has no FFN on the residual stream; FlexMemoryLLM's FFN-C is a SwiGLU reading the layer input. Saved
checkpoints carry this file, the shared decoder and the token lookup runtime.
"""

from __future__ import annotations

import torch

from transformers.core_model_loading import ConversionOps, WeightConverter
from transformers.generation import GenerationMixin  # named in each causal LM's own bases, as transformers' models do

from .configuration_memffn import FlexMemoryLLMConfig, MemoryLLMConfig
from .ffn import TokenMemory
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForQuestionAnswering,
    MemFFNForSequenceClassification,
    MemFFNForTokenClassification,
    MemFFNModel,
    initializer_std,
    register_checkpoint_conversions,
    register_for_auto_classes,
    report_missing_checkpoint_part,
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


class FirstLayers(ConversionOps):
    """A stacked `TokenMemory` tensor [N, ...] of the checkpoint, fitted to the model's `num_hidden_layers` layers, as
    `from_pretrained(path, num_hidden_layers=k)` treats the decoder layers: of a deeper checkpoint the first k layers
    are kept (the decoder layers' weights past the k-th are reported unexpected); a shallower one gets the layers it
    lacks, drawn as `_init_weights` draws them (`TokenMemory.init_layers`) and reported missing as
    `<parameter>[N:k]` (the decoder layers' weights it lacks are reported missing). Saving (`cut=False`) leaves the
    tensor whole."""

    def __init__(self, cut: bool = True):
        self.cut = cut

    @torch.no_grad()
    def convert(self, input_dict, source_patterns, target_patterns, **kwargs):
        (tensor,) = (value[0] if isinstance(value, list) else value for value in input_dict.values())
        config = kwargs.get("config")
        layers = getattr(config, "num_hidden_layers", None)
        if self.cut and layers is not None and tensor.shape[0] > layers:
            tensor = tensor[:layers].clone()  # (a view would keep the dropped layers' memory as the parameter's)
        elif self.cut and layers is not None and tensor.shape[0] < layers and self._loads_whole_tensors(kwargs):
            saved, name = tensor.shape[0], target_patterns[0].rpartition(".")[2]
            new_layers = tensor.new_empty(layers - saved, *tensor.shape[1:])
            TokenMemory.init_layers(name, new_layers, initializer_std(config))
            tensor = torch.cat([tensor, new_layers])
            report_missing_checkpoint_part(kwargs["model"], f"{kwargs['full_layer_name']}[{saved}:{layers}]")
        return {target_patterns[0]: tensor}

    @staticmethod
    def _loads_whole_tensors(kwargs) -> bool:
        """Whether this load gives the conversion whole checkpoint tensors of a parameter of the model it names:
        `from_pretrained(..., distributed_config=...)` (a device mesh) gives each process its share of the layers
        (FSDP2 shards them along the layers), which is left as it is."""
        model, full_name = kwargs.get("model"), kwargs.get("full_layer_name")
        return model is not None and full_name is not None and getattr(model, "_device_mesh", None) is None

    @property
    def reverse_op(self) -> ConversionOps:
        return FirstLayers(cut=not self.cut)


# Every parameter of `TokenMemory` stacks the layers (see `FirstLayers`). Its RMSNorm weights are `rmsnorm_weight` in
# the model (a name the HF Trainer leaves out of weight decay) and `norm_weight` in checkpoints: loading renames them,
# saving renames them back.
TOKEN_MEMORY_CONVERSION = [
    WeightConverter(f"memory.{checkpoint_name}", f"memory.{name}", operations=[FirstLayers()])
    for checkpoint_name, name in (("norm_weight", "rmsnorm_weight"), ("gate_proj", "gate_proj"),
                                  ("up_proj", "up_proj"), ("down_proj", "down_proj"))
]
for _config_class in (MemoryLLMConfig, FlexMemoryLLMConfig):
    register_checkpoint_conversions(_config_class.model_type, TOKEN_MEMORY_CONVERSION)

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
