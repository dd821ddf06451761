"""The compared models of the study, each an explicit configuration matched to its baseline's parameter count.

Every model shares the baseline's decoder (width, depth, attention, tied embeddings); only the FFN changes, sized so
that the FFN keeps the parameters of the baseline's SwiGLU (3 d I):

| model | FFN | sizing rule |
|---|---|---|
| SwiGLU (transformers `LlamaForCausalLM`) | 3 d I | the baseline |
| FlashMHF d_h=128 | in/out projections 2 d^2 + H heads x E sub-networks 3 d_h d_e | d_e ~ 8/3 d_h rounded up to 64 (paper), E = what fills the rest, d_e then fitted in steps of 16 |
| FlashMHF d_h=64 | the same with twice the heads, each half as wide (the paper's head-width ablation) | as FlashMHF |
| MH-FFN d_h=128 | the same with one sub-network of width E d_e per head, no gates | as FlashMHF |
| Dense-MoE | FlashMHF with one head (d_h = d) | as FlashMHF |
| PKV d_h=128 | 2 d^2 + softmax attention over S learned slots per head, 2 d S | S fills the rest |
| MemoryLLM, equal total | SwiGLU of width I on X0 per layer | the baseline's width |
| MemoryLLM, equal active | as above, more layers | active (attention) parameters = the baseline's total |
| FlexMemoryLLM beta=3, equal total | FFN-C width beta d/3 + FFN-M the rest of I | memoryllm.md's beta = 3 (FFN-C keeps 3 d^2) |
| FlexMemoryLLM beta=3, equal active | FFN-C width I + FFN-M 5/3 as wide | active = the baseline's total |
| SwiGLU / KV-FFN / GLU (KV-FFN recipe) | 3 d I (+ biases) | the baseline's width |
| ReLU FFN | 2 d I' | I' = 1.5 I |
| DenseNet FFN | d I' + (I' + d) d | I' = 1.5 I - d / 2 |

Dense-MoE's single head is d wide (384 at size `small`), which the fused kernels do not take: it runs the PyTorch
op (`ffn_kernel="torch"`), so its tokens/s is not comparable. The paper runs FlashMHF and MH-FFN at fewer layers and wider FFNs (flash-mhf.md Table 4); at this size keeping the
depth and matching the FFN alone isolates the FFN, which is what is compared. `python examples/reproduce/study.py
--print-configs --size 370M` shows the rules at the paper's 370M shape.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_memffn.architectures import flex_memoryllm_split  # noqa: E402
from hf_memffn.flash_mhf_op import SUPPORTED_HEAD_DIMS  # noqa: E402

GROUPS = {
    "flash-mhf": "flash-mhf.md Table 1: FFN variants at equal total parameters",
    "memoryllm": "memoryllm.md: FFNs on the token embeddings, at equal total and at equal active parameters",
    "kv-ffn": "kv-ffn.md Table 1: KV-FFN and its baselines, with the paper's training settings",
}
# the model each group's models are compared with: the KV-FFN group trains with its own recipe and has its own SwiGLU
GROUP_BASELINES = {"flash-mhf": "llama", "memoryllm": "llama", "kv-ffn": "kv_swiglu"}


@dataclass(frozen=True)
class StudyShape:
    """The baseline's decoder, the batch shape and the default token budget of one study size."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    intermediate_size: int  # the SwiGLU baseline's FFN width
    ffn_head_dim: int  # FlashMHF / MH-FFN / PKV head width (the paper's d_h)
    block_size: int  # sequence length of the flash-mhf recipe
    batch_size: int  # sequences per step at `block_size`
    kvffn_block_size: int  # sequence length of the kv-ffn recipe (the paper: 2048); same tokens per step
    tokens: int  # default training tokens per model
    eval_tokens: int = 131_072  # held-out tokens per evaluation
    vocab_size: int = 8192  # for --print-configs; a study takes its data's vocabulary
    tie_word_embeddings: bool = True
    trainable: bool = True  # False: a paper shape, for --print-configs only

    @property
    def tokens_per_step(self) -> int:
        return self.block_size * self.batch_size


SHAPES = {
    shape.name: shape
    for shape in (
        StudyShape("toy", 64, 2, 4, 16, 192, 32, block_size=64, batch_size=4, kvffn_block_size=128, tokens=2048,
                   eval_tokens=512, vocab_size=512),
        # for a machine without a GPU (2 cores: about an hour for the 15 models and two more seeds of the main pair)
        StudyShape("cpu", 192, 4, 3, 64, 512, 64, block_size=256, batch_size=16, kvffn_block_size=512,
                   tokens=400_000, eval_tokens=32_768),
        # the `cpu` shape with `small`'s batch: one pass over the corpus gives 4.8 tokens per parameter, 4x `small`'s
        StudyShape("narrow", 192, 4, 3, 64, 512, 64, block_size=1024, batch_size=16, kvffn_block_size=2048,
                   tokens=15_990_000),
        StudyShape("small", 384, 6, 6, 64, 1024, 128, block_size=1024, batch_size=16, kvffn_block_size=2048,
                   tokens=6_000_000),
        StudyShape("base", 512, 8, 8, 64, 1376, 128, block_size=1024, batch_size=32, kvffn_block_size=2048,
                   tokens=50_000_000),
        # the width of the paper's 128M baseline (six FFN heads of 128) at base's depth and batch
        StudyShape("wide", 768, 8, 12, 64, 2048, 128, block_size=1024, batch_size=32, kvffn_block_size=2048,
                   tokens=50_000_000),
        # flash-mhf.md Table 4 baselines, to print the sizing rules at the paper's scale
        StudyShape("128M", 768, 12, 12, 64, 2048, 128, block_size=4096, batch_size=64, kvffn_block_size=2048,
                   tokens=60_000_000_000, vocab_size=50432, trainable=False),
        StudyShape("370M", 1024, 24, 16, 64, 2752, 128, block_size=4096, batch_size=64, kvffn_block_size=2048,
                   tokens=60_000_000_000, vocab_size=50432, tie_word_embeddings=False, trainable=False),
    )
}


@dataclass(frozen=True)
class Recipe:
    """Optimiser and regularisation of a group (AdamW betas (0.9, 0.95), cosine decay, as examples/pretrain.py)."""

    name: str
    learning_rate: float
    dropout: float  # attention dropout, and the KV-FFN block's output dropout
    long_blocks: bool  # sequences of `kvffn_block_size` instead of `block_size`
    source: str
    warmup_ratio: float = 0.015
    min_learning_rate: float = 1e-5
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def block_size(self, shape: StudyShape) -> int:
        return shape.kvffn_block_size if self.long_blocks else shape.block_size


RECIPES = {
    "flash-mhf": Recipe("flash-mhf", 3e-3, 0.0, False,
                        "flash-mhf.md Table 3, 128M column: lr 3e-3, cosine to 1e-5 after 1.5% warmup, AdamW (0.9, "
                        "0.95), weight decay 0.1, clip 1.0, no dropout (memoryllm.md gives no recipe: the same)"),
    "kv-ffn": Recipe("kv-ffn", 3e-4, 0.1, True,
                     "kv-ffn.md 6.1 and 8.1: lr 3e-4, weight decay 0.1, clip 1.0, dropout 0.1 on attention and FFN, "
                     "sequences of 2048 tokens (schedule and betas, which the paper omits, as the flash-mhf recipe)"),
}


@dataclass(frozen=True)
class StudyModel:
    key: str
    label: str
    group: str
    arch: str  # examples/pretrain.py --arch
    recipe: str
    ffn_fields: dict = field(default_factory=dict)  # config fields beyond the shared decoder
    num_hidden_layers: int | None = None  # None: the baseline's
    ablation: bool = False
    paper: str = ""  # the paper's number or claim for this model

    def config_fields(self, shape: StudyShape) -> dict:
        """Every config field but vocab_size (and the tokenizer's special ids, which the recipe sets)."""
        recipe = RECIPES[self.recipe]
        fields = {
            "hidden_size": shape.hidden_size,
            "num_hidden_layers": self.num_hidden_layers or shape.num_hidden_layers,
            "num_attention_heads": shape.num_attention_heads,
            "num_key_value_heads": shape.num_attention_heads,
            "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size,
            "max_position_embeddings": max(shape.block_size, shape.kvffn_block_size),
            "tie_word_embeddings": shape.tie_word_embeddings,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "attention_dropout": recipe.dropout,
        }
        fields.update(self.ffn_fields)
        heads = fields.get("ffn_num_heads")
        if heads and fields.get("ffn_variant") != "pkv" and shape.hidden_size // heads not in SUPPORTED_HEAD_DIMS:
            # the fused kernels take heads of 64/128/256 (e.g. not Dense-MoE's single head of d): the PyTorch op then
            fields["ffn_kernel"] = "torch"
        if self.arch == "kvffn":
            fields["kvffn_dropout"] = recipe.dropout
        return fields


def _round_to(value: float, multiple: int) -> int:
    return max(multiple, multiple * round(value / multiple))


def multi_head_ffn_widths(shape: StudyShape, head_dim: int | None = None) -> tuple[int, int]:
    """(E, d_e) of a FlashMHF FFN of heads `head_dim` wide (default: the shape's) with the parameters of the baseline's
    SwiGLU (see the module docstring)."""
    d, head_dim = shape.hidden_size, head_dim or shape.ffn_head_dim
    rest = 3 * d * shape.intermediate_size - 2 * d * d  # what the in/out projections leave for key/up/value
    paper_width = 64 * math.ceil(8 / 3 * head_dim / 64)
    subnetworks = max(1, round(rest / (3 * d * paper_width)))
    return subnetworks, _round_to(rest / (3 * d * subnetworks), 16)


def memoryllm_active_layers(shape: StudyShape) -> int:
    """Layers of a MemoryLLM whose active (attention + norm) parameters equal the baseline's layers' parameters."""
    d, attention = shape.hidden_size, 4 * shape.hidden_size * shape.num_attention_heads * shape.head_dim
    dense_layer = attention + 3 * d * shape.intermediate_size + 2 * d
    return round(shape.num_hidden_layers * dense_layer / (attention + d))


def study_models(shape: StudyShape) -> list[StudyModel]:
    d, width = shape.hidden_size, shape.intermediate_size
    heads = d // shape.ffn_head_dim
    subnetworks, subnetwork_size = multi_head_ffn_widths(shape)
    head_width = subnetworks * subnetwork_size
    slots = _round_to((3 * d * width - 2 * d * d) / (2 * d), 16)
    flex_widths = flex_memoryllm_split(d, width)
    flex_compute, flex_memory = flex_widths["intermediate_size"], flex_widths["memory_intermediate_size"]
    flex_active_memory = _round_to(width * flex_memory / flex_compute, 16)
    multi_head = {"ffn_num_heads": heads, "ffn_num_kv_heads": heads}
    # the paper's head-width ablation (Table 1: d_h = 64 against 128): twice the heads, each half as wide
    half_head_dim = shape.ffn_head_dim // 2
    half_subnetworks, half_subnetwork_size = multi_head_ffn_widths(shape, half_head_dim)
    # and from the other side (d_h = 256), where the width divides into such heads; the paper's sizing rule may leave
    # one sub-network per head (at `base`), which is MH-FFN: no router, no gates
    double_head_dim = 2 * shape.ffn_head_dim
    double_subnetworks, double_subnetwork_size = multi_head_ffn_widths(shape, double_head_dim)
    double_fields = {"ffn_variant": "flash_mhf" if double_subnetworks > 1 else "mh_ffn",
                     "intermediate_size": double_subnetworks * double_subnetwork_size,
                     "ffn_num_subnetworks": double_subnetworks,
                     "ffn_num_heads": d // double_head_dim, "ffn_num_kv_heads": d // double_head_dim}
    double_label = f"FlashMHF d_h={double_head_dim}" + ("" if double_subnetworks > 1 else " (E=1: MH-FFN)")
    models = [
        StudyModel("llama", "SwiGLU (transformers Llama)", "flash-mhf", "llama", "flash-mhf", paper="3.030"),
        StudyModel("flash_mhf", f"FlashMHF d_h={shape.ffn_head_dim}", "flash-mhf", "flash_mhf", "flash-mhf",
                   {"ffn_variant": "flash_mhf", "intermediate_size": head_width, "ffn_num_subnetworks": subnetworks,
                    **multi_head}, paper="3.014"),
        StudyModel("flash_mhf_half_head_dim", f"FlashMHF d_h={half_head_dim}", "flash-mhf", "flash_mhf", "flash-mhf",
                   {"ffn_variant": "flash_mhf", "intermediate_size": half_subnetworks * half_subnetwork_size,
                    "ffn_num_subnetworks": half_subnetworks, "ffn_num_heads": 2 * heads, "ffn_num_kv_heads": 2 * heads},
                   paper="3.046 (d_h=64)"),
        *([StudyModel("flash_mhf_double_head_dim", double_label, "flash-mhf", "flash_mhf", "flash-mhf", double_fields,
                      paper="3.029 (d_h=256)")] if d % double_head_dim == 0 else []),
        StudyModel("mh_ffn", f"MH-FFN d_h={shape.ffn_head_dim}", "flash-mhf", "flash_mhf", "flash-mhf",
                   {"ffn_variant": "mh_ffn", "intermediate_size": head_width, "ffn_num_subnetworks": 1, **multi_head},
                   paper="3.031"),
        StudyModel("dense_moe", "Dense-MoE (one head)", "flash-mhf", "flash_mhf", "flash-mhf",
                   {"ffn_variant": "dense_moe", "intermediate_size": head_width, "ffn_num_subnetworks": subnetworks,
                    "ffn_num_heads": 1, "ffn_num_kv_heads": 1}, paper="3.062"),
        StudyModel("pkv", f"PKV d_h={shape.ffn_head_dim}", "flash-mhf", "flash_mhf", "flash-mhf",
                   {"ffn_variant": "pkv", "intermediate_size": slots, **multi_head}, paper="3.334"),
        StudyModel("memoryllm_total", "MemoryLLM, equal total", "memoryllm", "memoryllm", "flash-mhf",
                   paper="worse than dense at equal total"),
        StudyModel("flex_total", "FlexMemoryLLM beta=3, equal total", "memoryllm", "flex_memoryllm", "flash-mhf",
                   {"intermediate_size": flex_compute, "memory_intermediate_size": flex_memory},
                   paper="closes most of MemoryLLM's gap"),
        StudyModel("memoryllm_active", "MemoryLLM, equal active", "memoryllm", "memoryllm", "flash-mhf",
                   num_hidden_layers=memoryllm_active_layers(shape), paper="better than dense at equal active"),
        StudyModel("flex_active", "FlexMemoryLLM beta=3, equal active", "memoryllm", "flex_memoryllm", "flash-mhf",
                   {"intermediate_size": width, "memory_intermediate_size": flex_active_memory},
                   paper="matches or beats dense at equal active"),
        StudyModel("kv_swiglu", "SwiGLU (KV-FFN block without biases)", "kv-ffn", "kvffn", "kv-ffn",
                   {"kvffn_bias": False}, paper="4.927"),
        StudyModel("kvffn", "KV-FFN", "kv-ffn", "kvffn", "kv-ffn", paper="5.161"),
        StudyModel("kv_glu", "GLU", "kv-ffn", "kvffn", "kv-ffn", {"ffn_variant": "glu"}, paper="5.287"),
        StudyModel("kv_densenet", "DenseNet FFN", "kv-ffn", "kvffn", "kv-ffn",
                   {"ffn_variant": "densenet", "intermediate_size": _round_to(1.5 * width - d / 2, 16)}, paper="5.324"),
        StudyModel("kv_relu", "ReLU FFN", "kv-ffn", "kvffn", "kv-ffn",
                   {"ffn_variant": "relu", "intermediate_size": _round_to(1.5 * width, 16)}, paper="5.432"),
    ]
    ablations = [
        ("kvffn_init_inv_d", "KV-FFN, init 1/d", {"kvffn_init": "inv_d"}, "1/sqrt(d) most stable"),
        ("kvffn_init_inv_sqrt_h", "KV-FFN, init 1/sqrt(h)", {"kvffn_init": "inv_sqrt_h"}, "1/sqrt(d) most stable"),
        ("kvffn_gelu", "KV-FFN, GELU keys", {"kvffn_activation": "gelu"}, "SiLU better by 0.03"),
        ("kvffn_relu_keys", "KV-FFN, ReLU keys", {"kvffn_activation": "relu"}, ""),
        ("kvffn_sum", "KV-FFN, key + value", {"kvffn_composition": "sum"}, "product better by 0.12"),
        ("kvffn_inner_residual", "KV-FFN, + inner residual", {"kvffn_inner_residual": True}, "(not in the paper)"),
    ]
    models += [StudyModel(key, label, "kv-ffn", "kvffn", "kv-ffn", fields, ablation=True, paper=paper)
               for key, label, fields, paper in ablations]
    return models


def parameter_counts(model) -> dict[str, int]:
    """total, active (without the FFNs on X0 that become lookup tables) and non-embedding parameters."""
    total = sum(p.numel() for p in model.parameters())
    counts = model.parameter_counts() if hasattr(model, "parameter_counts") else {"total": total, "active": total}
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    embedding_params = sum(p.numel() for p in model.parameters() if id(p) in embeddings)
    return {"total": counts["total"], "active": counts["active"], "non_embedding": total - embedding_params}
