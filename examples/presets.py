"""Named model sizes for the pretraining recipe.

The three paper sizes follow flash-mhf.md, Appendix C (Table 3, optimiser) and Appendix D (Table 4, shapes):

| preset | layers | d_model | attention heads x 64 | intermediate | FlashMHF (layers, intermediate, H x d_h, E) | lr     |
| 128M   | 12     | 768     | 12                   | 2048         | 10, 2048, 6 x 128, 8                        | 3e-3   |
| 370M   | 24     | 1024    | 16                   | 2752         | 21, 2688, 8 x 128, 7                        | 1.5e-3 |
| 1.3B   | 24     | 2048    | 32                   | 5504         | 20, 5760, 16 x 128, 15                      | 1e-3   |

The Llama baseline, MemoryLLM and KVFFN use the baseline shape; FlexMemoryLLM splits the baseline's FFN width
between FFN-C and FFN-M as memoryllm.md's example does (beta = 3: FFN-C keeps 3 h^2 of the FFN's parameters, FFN-M
gets the rest, 5 h^2 when the width is 8h/3; see `hf_memffn.architectures.flex_memoryllm_split`); FlashMHF uses its own column (fewer
layers, wider FFN heads, at equal size).
The FlashMHF sub-network width is `intermediate_size / ffn_num_subnetworks` (256, 384, 384). Embeddings are tied
as in the baseline of each size (Table 4's tie row is ambiguous for the 370M FlashMHF; untied is what keeps it at
the baseline's size). `tiny` and `small` are for CI and quick GPU checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The names of `hf_memffn.architectures.REGISTRY` (tests/test_recipe.py checks they agree), spelled out here because
# fine-tuning with the recipe must not import `hf_memffn`: it runs the checkpoint's own code.
ARCHITECTURE_NAMES = ("llama", "flash_mhf", "memoryllm", "flex_memoryllm", "kvffn")


@dataclass(frozen=True)
class Preset:
    """One model size: the shared Llama fields, the FlashMHF variant of the shape, and the optimiser settings."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    tie_word_embeddings: bool
    learning_rate: float
    flash_mhf: dict = field(default_factory=dict)  # FlashMHF overrides of the fields above + its extras
    max_position_embeddings: int = 4096
    head_dim: int = 64

    def config_fields(self, architecture: str) -> dict:
        """Keyword arguments for the config class of `architecture` (vocab_size is set by the recipe)."""
        if architecture not in ARCHITECTURE_NAMES:
            raise ValueError(f"architecture={architecture!r} is not one of {ARCHITECTURE_NAMES}")
        fields = {
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "attention_dropout": 0.0,
        }
        if architecture == "flash_mhf":
            fields.update(self.flash_mhf)
        else:  # the baseline's FFN parameters (FlexMemoryLLM splits the width between FFN-C and FFN-M)
            from hf_memffn.architectures import REGISTRY

            fields.update(REGISTRY[architecture].ffn_fields_at_width(self.hidden_size, self.intermediate_size))
        return fields


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset(
            name="tiny", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
            intermediate_size=128, tie_word_embeddings=True, learning_rate=3e-3, max_position_embeddings=512,
            # one FFN head of 64: the narrowest the fused kernels take, so the recipe's default runs them on a GPU
            flash_mhf={"intermediate_size": 128, "ffn_num_heads": 1, "ffn_num_subnetworks": 2},
        ),
        Preset(
            name="small", hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
            intermediate_size=688, tie_word_embeddings=True, learning_rate=3e-3, max_position_embeddings=2048,
            flash_mhf={"num_hidden_layers": 4, "intermediate_size": 512, "ffn_num_heads": 2, "ffn_num_subnetworks": 2},
        ),
        Preset(
            name="128M", hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=2048, tie_word_embeddings=True, learning_rate=3e-3,
            flash_mhf={"num_hidden_layers": 10, "intermediate_size": 2048, "ffn_num_heads": 6, "ffn_num_subnetworks": 8},
        ),
        Preset(
            name="370M", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
            intermediate_size=2752, tie_word_embeddings=False, learning_rate=1.5e-3,
            flash_mhf={
                "num_hidden_layers": 21, "intermediate_size": 2688, "ffn_num_heads": 8, "ffn_num_subnetworks": 7,
            },
        ),
        Preset(
            name="1.3B", hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
            intermediate_size=5504, tie_word_embeddings=False, learning_rate=1e-3,
            flash_mhf={"num_hidden_layers": 20, "intermediate_size": 5760, "ffn_num_heads": 16, "ffn_num_subnetworks": 15},
        ),
    )
}

# Appendix C, Table 3 (same for every size except the learning rate, which lives in the preset).
OPTIMIZER_DEFAULTS = {
    "min_learning_rate": 1e-5,
    "warmup_ratio": 0.015,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "weight_decay": 0.1,
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {sorted(PRESETS)}")
    return PRESETS[name]
