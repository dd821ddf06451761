"""hf-memffn: FFN-as-key-value-memory architectures for Hugging Face Transformers.

Importing the package registers FlashMHFLlama, MemoryLLM, FlexMemoryLLM and KVFFN with `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` and `AutoModelForSequenceClassification`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

from .architectures import ARCHITECTURES, BASELINE, LORA_TARGET_MODULES, REGISTRY
from .configuration_memffn import (
    FlashMHFLlamaConfig,
    FlexMemoryLLMConfig,
    KVFFNConfig,
    MemFFNConfig,
    MemoryLLMConfig,
)
from .flash_mhf_op import flash_mhf
from .modeling_flash_mhf import FlashMHFLlamaForCausalLM, FlashMHFLlamaForSequenceClassification, FlashMHFLlamaModel
from .modeling_kvffn import KVFFNForCausalLM, KVFFNForSequenceClassification, KVFFNModel
from .modeling_memffn import (
    MemFFNForCausalLM,
    MemFFNForSequenceClassification,
    MemFFNModel,
    MemFFNPreTrainedModel,
)
from .modeling_memoryllm import (
    FlexMemoryLLMForCausalLM,
    FlexMemoryLLMForSequenceClassification,
    FlexMemoryLLMModel,
    MemoryLLMForCausalLM,
    MemoryLLMForSequenceClassification,
    MemoryLLMModel,
)

__version__ = "0.1.0"


def register_auto_classes() -> None:
    """Register the four architectures with the transformers Auto classes (idempotent). Importing their modeling
    files has already named their causal LM classes among transformers' causal LMs
    (`modeling_memffn.register_for_auto_classes`)."""
    for name, entry in REGISTRY.items():
        if name == BASELINE:
            continue
        AutoConfig.register(entry.config_class.model_type, entry.config_class, exist_ok=True)
        AutoModel.register(entry.config_class, entry.model_class, exist_ok=True)
        AutoModelForCausalLM.register(entry.config_class, entry.causal_lm_class, exist_ok=True)
        AutoModelForSequenceClassification.register(entry.config_class, entry.sequence_classification_class,
                                                    exist_ok=True)


register_auto_classes()

__all__ = [
    "ARCHITECTURES",
    "LORA_TARGET_MODULES",
    "FlashMHFLlamaConfig",
    "FlashMHFLlamaForCausalLM",
    "FlashMHFLlamaForSequenceClassification",
    "FlashMHFLlamaModel",
    "FlexMemoryLLMConfig",
    "FlexMemoryLLMForCausalLM",
    "FlexMemoryLLMForSequenceClassification",
    "FlexMemoryLLMModel",
    "KVFFNConfig",
    "KVFFNForCausalLM",
    "KVFFNForSequenceClassification",
    "KVFFNModel",
    "MemFFNConfig",
    "MemFFNForCausalLM",
    "MemFFNForSequenceClassification",
    "MemFFNModel",
    "MemFFNPreTrainedModel",
    "MemoryLLMConfig",
    "MemoryLLMForCausalLM",
    "MemoryLLMForSequenceClassification",
    "MemoryLLMModel",
    "flash_mhf",
    "register_auto_classes",
]
