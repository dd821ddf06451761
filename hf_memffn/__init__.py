"""hf-memffn: FFN-as-key-value-memory architectures for Hugging Face Transformers.

Importing the package registers FlashMHFLlama, MemoryLLM, FlexMemoryLLM and KVFFN with `AutoConfig`, `AutoModel`
and `AutoModelForCausalLM`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_memffn import (
    FlashMHFLlamaConfig,
    FlexMemoryLLMConfig,
    KVFFNConfig,
    MemFFNConfig,
    MemoryLLMConfig,
)
from .flash_mhf_op import flash_mhf
from .modeling_memffn import (
    MODEL_CLASSES,
    FlashMHFLlamaForCausalLM,
    FlashMHFLlamaModel,
    FlexMemoryLLMForCausalLM,
    FlexMemoryLLMModel,
    KVFFNForCausalLM,
    KVFFNModel,
    MemFFNForCausalLM,
    MemFFNModel,
    MemFFNPreTrainedModel,
    MemoryLLMForCausalLM,
    MemoryLLMModel,
)

__version__ = "0.1.0"

# architecture name -> config class (the names used across the CLI, tests and examples)
ARCHITECTURES = {
    "flash_mhf": FlashMHFLlamaConfig,
    "memoryllm": MemoryLLMConfig,
    "flex_memoryllm": FlexMemoryLLMConfig,
    "kvffn": KVFFNConfig,
}


# LoRA `target_modules` per architecture (the nn.Linear layers; FlashMHF's sub-network weights and the stacked FFNs
# on X0 are plain parameters: `hf_memffn.adapters` adapts them).
_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_TARGET_MODULES = {
    "llama": _ATTENTION + ["gate_proj", "up_proj", "down_proj"],
    "flash_mhf": _ATTENTION + ["in_proj", "out_proj"],
    "memoryllm": _ATTENTION,
    "flex_memoryllm": _ATTENTION + ["gate_proj", "up_proj", "down_proj"],
    "kvffn": _ATTENTION + ["key_proj", "value_proj", "out_proj"],
}


def register_auto_classes() -> None:
    """Register the four architectures with the transformers Auto classes (idempotent)."""
    for config_class, (model_class, causal_lm_class) in MODEL_CLASSES.items():
        AutoConfig.register(config_class.model_type, config_class, exist_ok=True)
        AutoModel.register(config_class, model_class, exist_ok=True)
        AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)


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
