"""hf-memffn: FFN-as-key-value-memory architectures for Hugging Face Transformers.

Importing the package registers FlashMHFLlama, MemoryLLM, FlexMemoryLLM and KVFFN with `AutoConfig`, `AutoModel`
and `AutoModelForCausalLM`.
"""

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
from .modeling_flash_mhf import FlashMHFLlamaForCausalLM, FlashMHFLlamaModel
from .modeling_kvffn import KVFFNForCausalLM, KVFFNModel
from .modeling_memffn import MemFFNForCausalLM, MemFFNModel, MemFFNPreTrainedModel
from .modeling_memoryllm import FlexMemoryLLMForCausalLM, FlexMemoryLLMModel, MemoryLLMForCausalLM, MemoryLLMModel

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


register_auto_classes()

__all__ = [
    "ARCHITECTURES",
    "LORA_TARGET_MODULES",
    "FlashMHFLlamaConfig",
    "FlashMHFLlamaForCausalLM",
    "FlashMHFLlamaModel",
    "FlexMemoryLLMConfig",
    "FlexMemoryLLMForCausalLM",
    "FlexMemoryLLMModel",
    "KVFFNConfig",
    "KVFFNForCausalLM",
    "KVFFNModel",
    "MemFFNConfig",
    "MemFFNForCausalLM",
    "MemFFNModel",
    "MemFFNPreTrainedModel",
    "MemoryLLMConfig",
    "MemoryLLMForCausalLM",
    "MemoryLLMModel",
    "flash_mhf",
    "register_auto_classes",
]
