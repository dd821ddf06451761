"""The package's public names, and their registration with transformers' Auto classes: what `import hf_memffn`
gives (hf_memffn/__init__.py)."""

import transformers
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .architectures import ARCHITECTURES, BASELINE, LORA_TARGET_MODULES, REGISTRY
from .configuration_memffn import (
    FlashMHFLlamaConfig,
    FlexMemoryLLMConfig,
    KVFFNConfig,
    MemFFNConfig,
    MemoryLLMConfig,
)
from .flash_mhf_op import flash_mhf
from .modeling_flash_mhf import (
    FlashMHFLlamaForCausalLM,
    FlashMHFLlamaForQuestionAnswering,
    FlashMHFLlamaForSequenceClassification,
    FlashMHFLlamaForTokenClassification,
    FlashMHFLlamaModel,
)
from .modeling_kvffn import (
    KVFFNForCausalLM,
    KVFFNForQuestionAnswering,
    KVFFNForSequenceClassification,
    KVFFNForTokenClassification,
    KVFFNModel,
)
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForQuestionAnswering,
    MemFFNForSequenceClassification,
    MemFFNForTokenClassification,
    MemFFNModel,
    MemFFNPreTrainedModel,
)
from .modeling_memoryllm import (
    FlexMemoryLLMForCausalLM,
    FlexMemoryLLMForQuestionAnswering,
    FlexMemoryLLMForSequenceClassification,
    FlexMemoryLLMForTokenClassification,
    FlexMemoryLLMModel,
    MemoryLLMForCausalLM,
    MemoryLLMForQuestionAnswering,
    MemoryLLMForSequenceClassification,
    MemoryLLMForTokenClassification,
    MemoryLLMModel,
)

def register_auto_classes() -> None:
    """Register the four architectures with the transformers Auto classes (idempotent). Importing their modeling
    files has already named their head classes in transformers' tables of each task's models
    (`modeling_memffn.register_for_auto_classes`)."""
    for name, entry in REGISTRY.items():
        if name == BASELINE:
            continue
        AutoConfig.register(entry.config_class.model_type, entry.config_class, exist_ok=True)
        AutoModel.register(entry.config_class, entry.model_class, exist_ok=True)
        AutoModelForCausalLM.register(entry.config_class, entry.causal_lm_class, exist_ok=True)
        for auto_class, head_class in entry.task_heads.items():
            getattr(transformers, auto_class).register(entry.config_class, head_class, exist_ok=True)


__all__ = [
    "ARCHITECTURES",
    "FlashMHFLlamaConfig",
    "FlashMHFLlamaForCausalLM",
    "FlashMHFLlamaForQuestionAnswering",
    "FlashMHFLlamaForSequenceClassification",
    "FlashMHFLlamaForTokenClassification",
    "FlashMHFLlamaModel",
    "FlexMemoryLLMConfig",
    "FlexMemoryLLMForCausalLM",
    "FlexMemoryLLMForQuestionAnswering",
    "FlexMemoryLLMForSequenceClassification",
    "FlexMemoryLLMForTokenClassification",
    "FlexMemoryLLMModel",
    "KVFFNConfig",
    "KVFFNForCausalLM",
    "KVFFNForQuestionAnswering",
    "KVFFNForSequenceClassification",
    "KVFFNForTokenClassification",
    "KVFFNModel",
    "LORA_TARGET_MODULES",
    "MemFFNConfig",
    "MemFFNForCausalLM",
    "MemFFNForQuestionAnswering",
    "MemFFNForSequenceClassification",
    "MemFFNForTokenClassification",
    "MemFFNModel",
    "MemFFNPreTrainedModel",
    "MemoryLLMConfig",
    "MemoryLLMForCausalLM",
    "MemoryLLMForQuestionAnswering",
    "MemoryLLMForSequenceClassification",
    "MemoryLLMForTokenClassification",
    "MemoryLLMModel",
    "flash_mhf",
    "register_auto_classes",
]
