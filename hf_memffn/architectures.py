"""The one registry of architecture names: each architecture of this package, and transformers' Llama as the
baseline they are compared with, under the name the CLI, the demo, the recipe, the tests and the docs use.

`ARCHITECTURES`, `ARCHITECTURE_NAMES`, `LORA_TARGET_MODULES` and `DISPLAY_NAMES` are read from `REGISTRY`.
This module is part of the package only (checkpoints never carry it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import transformers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from . import modeling_flash_mhf, modeling_kvffn, modeling_memoryllm
from .configuration_memffn import FlashMHFLlamaConfig, FlexMemoryLLMConfig, KVFFNConfig, MemoryLLMConfig, check_choice
from .modeling_flash_mhf import FlashMHFLlamaForCausalLM, FlashMHFLlamaModel
from .modeling_kvffn import KVFFNForCausalLM, KVFFNModel
from .modeling_memoryllm import FlexMemoryLLMForCausalLM, FlexMemoryLLMModel, MemoryLLMForCausalLM, MemoryLLMModel

BASELINE = "llama"

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_SWIGLU = ("gate_proj", "up_proj", "down_proj")


def _whole_width(hidden_size: int, width: int) -> dict[str, int]:
    return {"intermediate_size": width}


FLEX_MEMORYLLM_BETA = 3


def flex_memoryllm_split(hidden_size: int, width: int, beta: float = FLEX_MEMORYLLM_BETA) -> dict[str, int]:
    """FFN-C and FFN-M widths of a FlexMemoryLLM with the parameters of one SwiGLU FFN `width` wide.

    memoryllm.md splits the FFN's parameters so that FFN-C (on the residual stream) keeps beta * h^2 of them and FFN-M
    (on the token embeddings, offloadable as a lookup table) the rest: "5h^2 for beta=3" out of the 8h^2 of a SwiGLU
    of width 8h/3. A SwiGLU of width w has 3 h w parameters, so FFN-C's width is beta * h / 3.
    """
    compute = min(max(1, round(beta * hidden_size / 3)), width - 1)
    return {"intermediate_size": compute, "memory_intermediate_size": width - compute}


@dataclass(frozen=True)
class Architecture:
    """One architecture: its name, the classes that build it, and the settings other tools take from here."""

    name: str
    display_name: str  # in tables and plots
    config_class: type
    model_class: type
    causal_lm_class: type
    lora_target_modules: tuple[str, ...]  # the nn.Linear layers LoRA adapts (see README, PEFT)
    tiny_ffn: dict = field(default_factory=dict)  # FFN fields of the tiny models (`hf_memffn.testing.tiny_config`)
    # FFN width fields (given the hidden size) that give this architecture the FFN parameters of one SwiGLU `width`
    # wide (the baseline's); FlashMHFLlama's equal-size shape depends on its heads, so its users size it themselves.
    ffn_fields_at_width: Callable[[int, int], dict[str, int]] = _whole_width
    # the task heads beside the causal LM: Auto class name -> class (`task_heads_of`)
    task_heads: dict[str, type] = field(default_factory=dict)


# The Auto classes of the task heads beside the causal LM; `AutoModel<Task>` builds the classes named `<prefix><Task>`.
TASK_HEADS = ("AutoModelForSequenceClassification", "AutoModelForTokenClassification", "AutoModelForQuestionAnswering")


def task_heads_of(module, prefix: str) -> dict[str, type]:
    """An architecture's task heads: the `<prefix><Task>` classes of `module` (transformers or a modeling file)."""
    return {auto_class: getattr(module, prefix + auto_class[len("AutoModel"):]) for auto_class in TASK_HEADS}


REGISTRY: dict[str, Architecture] = {
    entry.name: entry
    for entry in (
        Architecture(
            BASELINE, "Llama (baseline)", LlamaConfig, LlamaModel, LlamaForCausalLM, _ATTENTION + _SWIGLU,
            tiny_ffn=dict(intermediate_size=128), task_heads=task_heads_of(transformers, "Llama"),
        ),
        Architecture(
            "flash_mhf", "FlashMHFLlama", FlashMHFLlamaConfig, FlashMHFLlamaModel, FlashMHFLlamaForCausalLM,
            _ATTENTION + ("in_proj", "out_proj") + _SWIGLU,  # (the `swiglu` baseline's FFN)
            tiny_ffn=dict(intermediate_size=96, ffn_num_heads=4, ffn_num_subnetworks=2, ffn_num_kv_heads=2),
            task_heads=task_heads_of(modeling_flash_mhf, "FlashMHFLlama"),
        ),
        Architecture(
            "memoryllm", "MemoryLLM", MemoryLLMConfig, MemoryLLMModel, MemoryLLMForCausalLM, _ATTENTION,
            tiny_ffn=dict(intermediate_size=128), task_heads=task_heads_of(modeling_memoryllm, "MemoryLLM"),
        ),
        Architecture(
            "flex_memoryllm", "FlexMemoryLLM", FlexMemoryLLMConfig, FlexMemoryLLMModel, FlexMemoryLLMForCausalLM,
            _ATTENTION + _SWIGLU,  # FFN-C
            tiny_ffn=dict(intermediate_size=64, memory_intermediate_size=64),
            ffn_fields_at_width=flex_memoryllm_split,
            task_heads=task_heads_of(modeling_memoryllm, "FlexMemoryLLM"),
        ),
        Architecture(
            "kvffn", "KVFFN", KVFFNConfig, KVFFNModel, KVFFNForCausalLM,
            _ATTENTION + ("key_value_proj", "out_proj", "key_proj"),  # (key_proj: the `relu` / `densenet` baselines)
            tiny_ffn=dict(intermediate_size=128), task_heads=task_heads_of(modeling_kvffn, "KVFFN"),
        ),
    )
}

# Every name, the baseline first.
ARCHITECTURE_NAMES: tuple[str, ...] = tuple(REGISTRY)
# This package's architectures: name -> config class.
ARCHITECTURES = {name: entry.config_class for name, entry in REGISTRY.items() if name != BASELINE}
LORA_TARGET_MODULES = {name: list(entry.lora_target_modules) for name, entry in REGISTRY.items()}
DISPLAY_NAMES = {name: entry.display_name for name, entry in REGISTRY.items()}


def auto_class_of(class_name: str | None) -> str | None:
    """The Auto class that builds this package's class named `class_name` (an entry of a config's `architectures`):
    "AutoModel", "AutoModelForCausalLM" or a task head's Auto class; None for any other name."""
    for name, entry in REGISTRY.items():
        if name == BASELINE:
            continue
        classes = {"AutoModel": entry.model_class, "AutoModelForCausalLM": entry.causal_lm_class, **entry.task_heads}
        for auto_class, model_class in classes.items():
            if model_class.__name__ == class_name:
                return auto_class
    return None


def architecture(name: str) -> Architecture:
    check_choice("arch", name, ARCHITECTURE_NAMES)
    return REGISTRY[name]
