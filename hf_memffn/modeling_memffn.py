"""The decoder that the four FFN-as-memory architectures share, written once.

A decoder layer computes

    X_{L+1} = X_L + Attn(norm(X_L)) [+ FFN(norm(.))] [+ FFN_L(X0)]

where the FFN on the residual stream (`mlp`) is FlashMHF, SwiGLU or KV-FFN and reads either X_L + Attn (sequential,
like Llama) or X_L (parallel, FlexMemoryLLM's FFN-C), and the FFN on the token embeddings X0 (MemoryLLM, FFN-M) comes
from the model-level `TokenMemory`, computed for all layers at once before the loop. The config says which parts a
model has (`residual_ffn`, `parallel_residual_ffn`, `token_memory_size`).

Each architecture's classes are thin compositions in a modeling file of their own (`modeling_flash_mhf.py`,
`modeling_memoryllm.py`, `modeling_kvffn.py`), which names its config and the FFN blocks it may use: transformers
copies that file and the siblings it imports next to the weights, so a checkpoint carries exactly the code its
architecture runs. These files import only torch, transformers, safetensors and (guarded) triton.
"""

import importlib.util
import inspect
import numbers
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Callable

import torch
import transformers
from torch import nn
from torch.nn.utils import parametrize
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, StaticLayer
from transformers.conversion_mapping import register_checkpoint_conversion_mapping
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    QuestionAnsweringModelOutput,
    SequenceClassifierOutputWithPast,
    TokenClassifierOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple, is_torchdynamo_compiling
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .configuration_memffn import (MemFFNConfig, pipeline_parallel_plan, refuse_the_base_class,
                                   tensor_parallel_plan)
from .decoder_triton import decoder_kernels_path, decoder_kernels_unavailable, rotate_pair
from .ffn import (SwiGLUFeedForward, TokenMemory, build_token_memory, package_logger,
                  refuse_adapters_of_former_key_value_layers)
from .parallel import TokenEmbeddingRelay
from .rms_norm import MemFFNRMSNorm
from .triton_launch import registered_operator


def _package_sibling(name: str):
    """The sibling module `name` of the installed hf-memffn package, or None where it is absent: the model card and
    the Hub upload are features of the package, not code a checkpoint carries (transformers copies only the siblings
    imported as `from .name import x`; a checkpoint folder loaded with `trust_remote_code` has no `name.py`)."""
    module_name = f"{__package__}.{name}"
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return None


logger = package_logger(__name__)

# The key/value cache's keyword: transformers 5.24 renamed `past_key_values` to `cache` (model and layer arguments,
# output field). Outputs and decoder layers get the installed version's name: `generate()` reads the cache back under
# it, and `GradientCheckpointingLayer` drops it by that name under activation checkpointing.
CACHE_KWARG = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


# The folders of the code between a user's call of a model and its forward: this package's files (or the copies a
# checkpoint loaded with `trust_remote_code` runs), transformers' forward wrappers and `nn.Module.__call__`.
_LIBRARY_FOLDERS = tuple(os.path.dirname(path) + os.sep for path in (__file__, torch.__file__, transformers.__file__))


def stacklevel_of_the_caller() -> int:
    """The `stacklevel` that makes a `warnings.warn` in the function calling this one name the first line outside
    this package, transformers and torch: the line (a user's, or another library's such as PEFT's) that called the
    model, which a fixed count misses by the varying number of wrappers in between."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_FOLDERS):
        frame, level = frame.f_back, level + 1
    return level


def take_cache(past_key_values: Cache | None, cache: Cache | None, kwargs: dict, warn: bool = True) -> Cache | None:
    """The key/value cache a forward was given, under either name. Before transformers 5.24 it is `past_key_values`,
    and a `cache` is continuous batching's paged cache, which the attention function updates itself: it goes back
    into `kwargs`, for that function. Since 5.24 it is `cache`; `past_key_values` still works, with transformers'
    deprecation warning (``warn``), which names the line that called the model."""
    if CACHE_KWARG == "past_key_values":
        if cache is not None:
            kwargs["cache"] = cache
        return past_key_values
    if past_key_values is None:
        return cache
    if cache is not None and cache is not past_key_values:
        raise ValueError(
            "pass the key/value cache once: as `cache` (or the older name `past_key_values`), not both. PEFT's prefix "
            "tuning before 0.22 does this in generate() on transformers >= 5.24 (its prefix as `past_key_values` "
            "beside generate()'s own `cache`; transformers' Llama drops the prefix there): install peft>=0.22, or "
            "decode with the PEFT model's forward, which passes the prefix alone, token by token")
    if warn and not is_torchdynamo_compiling():
        warnings.warn("`past_key_values` is deprecated since transformers 5.24: pass the key/value cache as `cache`",
                      FutureWarning, stacklevel=stacklevel_of_the_caller())
    return past_key_values


def embedding_rows(embedding: nn.Module) -> int | None:
    """How many token ids ``embedding`` looks up: an ``nn.Embedding``'s rows, or the rows of the weight of a module
    that replaces it (PEFT's LoRA and trainable-token wrappers, a user's own); None where no 2-D weight tells."""
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    weight = getattr(embedding, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def check_token_ids(input_ids: torch.Tensor, num_embeddings: int | None) -> None:
    """One-line errors for token ids the embedding cannot look up (instead of an index error from inside it, or a
    device-side assert on a GPU). Skipped while compiling (the check reads the tensor back); without
    ``num_embeddings`` (an embedding of unknown size), and while a CUDA graph is captured (continuous batching's
    `use_cuda_graph`: the host cannot read a tensor back then, and a replay runs no Python), only the ids' presence
    and dtype are checked."""
    if is_torchdynamo_compiling():
        return
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): pass at least one token per sequence")
    if input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids has dtype {input_ids.dtype}: token ids must be integers (torch.long)")
    if num_embeddings is None or (input_ids.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    low, high = torch.stack(torch.aminmax(input_ids)).tolist()  # one device-to-host copy
    if low < 0 or high >= num_embeddings:
        bad = low if low < 0 else high
        raise ValueError(
            f"input_ids contains token id {bad}: allowed ids are 0..{num_embeddings - 1} (the embedding has "
            f"{num_embeddings} rows; is the tokenizer the model's own?)"
        )


def check_attention_mask(attention_mask: torch.Tensor, batch_and_length: tuple[int, int], cache: Cache | None) -> None:
    """One-line errors for an `attention_mask` tensor that transformers' mask helpers and attention functions do not
    take: of another rank than 2 (a padding mask, see `check_padding_mask`) or 4 (a full mask, used as it is), or a
    4-D mask that is neither boolean nor floating point (eager attention would add its 1s and 0s to the scores,
    masking nothing; sdpa refuses it with torch's message)."""
    if attention_mask.dim() not in (2, 4):
        plural = "s" if attention_mask.dim() != 1 else ""
        raise ValueError(
            f"attention_mask has {attention_mask.dim()} dimension{plural} (shape {tuple(attention_mask.shape)}): "
            "allowed are a 2-D padding mask [batch, tokens] (1 for a token, 0 for padding) or a 4-D mask [batch, 1 "
            "or heads, queries, keys] (boolean: True where a query may attend; or floating point: added to the "
            "attention scores)")
    if attention_mask.dim() == 4 and not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point()):
        raise ValueError(
            f"a 4-D attention_mask has dtype {attention_mask.dtype}: allowed are torch.bool (True where a query may "
            "attend) or a floating point dtype (added to the attention scores: 0 to attend, a large negative value "
            "to mask); for 1 and 0, pass `attention_mask.bool()`")
    if attention_mask.dim() == 2 and not is_torchdynamo_compiling():
        check_padding_mask(attention_mask, batch_and_length, cache)


def check_padding_mask(attention_mask: torch.Tensor, batch_and_length: tuple[int, int], cache: Cache | None) -> None:
    """A one-line error for a 2-D `attention_mask` that is not [batch, cached + new tokens]: transformers' mask helpers
    would fail on the shapes inside the attention, or, in a decoding step given the mask of the cached tokens alone,
    attend to the wrong positions. Checked without a cache and with a `DynamicCache` (which counts its tokens by its
    tensors' shapes); skipped for other caches (a static cache counts them on the device: a kernel, and a device sync
    to read, per decoding step) and for symbolic sizes (an export traces the forward)."""
    if cache is not None and type(cache) is not DynamicCache:
        return
    batch, length = batch_and_length
    cached = cache.get_seq_length() if cache is not None else 0
    if not all(type(size) is int for size in (*attention_mask.shape, batch, length, cached)):
        return
    if tuple(attention_mask.shape) != (batch, cached + length):
        # (PEFT's prompt tuning and p-tuning look for generate()'s cache as `past_key_values`: under `cache`, since
        # transformers 5.24, they prepend their virtual tokens again at each step, after the first one cached them)
        peft = ("; PEFT's prompt tuning before 0.22 gives such a mask in generate() on transformers >= 5.24, its "
                "virtual tokens prepended again at each step: install peft>=0.22, or generate with use_cache=False"
                if CACHE_KWARG == "cache" and cached and attention_mask.shape[-1] < cached + length else "")
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}: a 2-D mask needs one row per sequence and one "
            f"column per token, the cached ones included: ({batch}, {cached + length}) for {cached} cached and "
            f"{length} new tokens (in a decoding loop, extend the mask by the new tokens' columns at each step){peft}")


def check_static_cache_room(cache: Cache | None, needed: int, what: str, hint: str = "") -> None:
    """A ValueError naming the static cache's `max_cache_len` where it cannot hold `needed` tokens (`what` says what
    needs them): its update would otherwise fail inside, an index_copy_ IndexError on the CPU and a device-side assert
    on CUDA. Reads host-side integers only (each layer's length, never the count of cached tokens, which a static
    cache keeps on the device); a sliding-window layer keeps its last tokens and never runs out of room."""
    for layer in getattr(cache, "layers", ()):
        if isinstance(layer, StaticLayer) and not getattr(layer, "is_sliding", False) and layer.max_cache_len < needed:
            raise ValueError(
                f"the {type(cache).__name__} has max_cache_len={layer.max_cache_len} positions, but {what} needs "
                f"{needed}: pass a cache of max_cache_len >= {needed}{hint}")


def check_cache_batch(cache: Cache, batch: int) -> None:
    """A ValueError where `cache` holds another number of sequences than the forward gives (a cache reused for another
    batch): a dynamic cache's update would otherwise fail inside torch.cat, a static one's inside index_copy_. Reads
    the first layer's key tensor's shape (host-side integers) once it holds any."""
    layers = getattr(cache, "layers", None)
    keys = getattr(layers[0], "keys", None) if layers else None
    if not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[2] == 0:
        return
    cached = keys.shape[0]
    if type(cached) is int and type(batch) is int and cached != batch:
        raise ValueError(
            f"the {type(cache).__name__} holds {cached} sequences, and this forward gives {batch} "
            f"sequence{'s' if batch != 1 else ''}: a cache continues the batch it was filled with; pass a new cache "
            "(or none) for another batch")


def check_position_ids(position_ids: torch.Tensor, batch_and_length: tuple[int, int]) -> None:
    """A one-line error for `position_ids` that are not [batch or 1, tokens]: a 1-D tensor, or one of another length,
    failed on the shapes inside the rotary embedding, and one position per row ([batch, 1]) for several tokens
    broadcast to every token, which then all had the same position, silently. Skipped for symbolic sizes (an export
    traces the forward)."""
    batch, length = batch_and_length
    if not all(type(size) is int for size in (*position_ids.shape, batch, length)):
        return
    if position_ids.dim() != 2 or position_ids.shape[1] != length or position_ids.shape[0] not in (1, batch):
        rows = "1" if batch == 1 else f"{batch} or 1"
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}: allowed are ({rows}, {length}), one position per "
            f"token of the {length} passed (a row of 1 applies to every sequence; for a 1-D tensor, pass "
            "`position_ids[None]`)")


def packed_sequence_positions(cu_seq_lens_q: torch.Tensor, batch_and_length: tuple[int, int], check: bool = True
                              ) -> torch.Tensor:
    """[1, tokens] positions restarting at 0 at each sequence start that `cu_seq_lens_q` marks in a row of packed
    sequences (the flash-attention kwargs of `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`). Only flash
    attention reads those kwargs; sdpa, eager and flex attention find the sequences of a packed row from `position_ids`
    (transformers' `create_causal_mask`), and without them let the sequences attend to each other. Boundaries of another
    row count, or that do not rise from 0 to the row's tokens, are refused, where `check` (not while torch.compile
    traces: the check reads the boundaries back, a sync)."""
    batch, length = batch_and_length
    bounds = cu_seq_lens_q.to(torch.long)
    if check and not is_torchdynamo_compiling():
        listed = bounds.tolist() if bounds.dim() == 1 else None
        if batch != 1 or listed is None or not listed or listed[0] != 0 or listed[-1] != length \
                or any(later < earlier for earlier, later in zip(listed, listed[1:])):
            shown = listed if listed is not None else f"of shape {tuple(cu_seq_lens_q.shape)}"
            raise ValueError(
                f"cu_seq_lens_q is {shown}: allowed are the starts of the sequences packed into one row and its end, "
                f"a 1-D tensor rising from 0 to the {length} tokens of that row (given {batch} row"
                f"{'s' if batch != 1 else ''}); or pass `position_ids` restarting at 0 at each sequence instead")
    tokens = torch.arange(length, device=bounds.device)
    sequence = torch.searchsorted(bounds[1:], tokens, right=True)
    return (tokens - bounds[sequence])[None]


# Attribute of a model being loaded: the names of the parts of its parameters that the checkpoint lacked, drawn new
# while loading (`report_missing_checkpoint_part`)
MISSING_CHECKPOINT_PARTS = "_memffn_missing_checkpoint_parts"


def initializer_std(config) -> float:
    """The std of the normal draws of `_init_weights`: `config.initializer_range`, 0 (or none) standing for
    transformers' default, 0.02, as in its own models."""
    return getattr(config, "initializer_range", None) or 0.02


def report_missing_checkpoint_part(model, name: str) -> None:
    """Record on `model`, while it loads, that the checkpoint lacked the part `name` of a parameter, which loading
    drew new: `from_pretrained` reports it among the missing keys
    (`MemFFNPreTrainedModel._adjust_missing_and_unexpected_keys`)."""
    model.__dict__.setdefault(MISSING_CHECKPOINT_PARTS, set()).add(name)


def add_missing_checkpoint_parts(input_dict: dict, source_patterns: list[str], part_names: list[str],
                                 target_pattern: str, init_part: Callable[[torch.Tensor], None], model=None,
                                 full_layer_name: str | None = None) -> None:
    """Loading a parameter that checkpoints keep as several tensors of one shape (a `WeightConverter` of
    `from_pretrained` that joins `source_patterns` into `target_pattern`): a part the checkpoint lacks is added to
    `input_dict`, shaped as the parts it holds and drawn by `init_part(tensor)` as `_init_weights` draws that
    part in a new model, so the parameter loads with the parts the checkpoint has, as a missing weight of a model
    without joined parameters starts new and the others load. Its checkpoint name (`part_names[index]` in place of
    `target_pattern` in `full_layer_name`) is recorded on `model`, which reports it among the missing keys
    (`MemFFNPreTrainedModel._adjust_missing_and_unexpected_keys`). Nothing is done where every part is there or none
    is, or where `model` has no parameter `full_layer_name` (the join of another class's tensors, dropped anyway)."""
    present = [input_dict[pattern] for pattern in source_patterns if pattern in input_dict]
    if not present or len(present) == len(source_patterns) or model is None or full_layer_name is None:
        return
    try:
        model.get_parameter(full_layer_name)
    except AttributeError:
        return
    like = present[0][0] if isinstance(present[0], list) else present[0]
    for index, pattern in enumerate(source_patterns):
        if pattern in input_dict:
            continue
        part = torch.empty_like(like)
        with torch.no_grad():
            init_part(part)
        input_dict[pattern] = [part] if isinstance(present[0], list) else part
        report_missing_checkpoint_part(model, full_layer_name.replace(target_pattern, part_names[index]))


# --------------------------------------------------------------------------------------------------------------------
# Rotary position embeddings: transformers' RoPE types (`config.rope_parameters`), as in LlamaForCausalLM
# --------------------------------------------------------------------------------------------------------------------
class MemFFNRotaryEmbedding(nn.Module):
    """cos/sin tables for positions, for every RoPE type of `MemFFNConfig.rope_parameters` ("default", "linear",
    "dynamic", "yarn", "longrope", "llama3"): the inverse frequencies come from transformers' RoPE init functions,
    and `dynamic_rope_update` recomputes them for the types that depend on the sequence length."""

    def __init__(self, config: MemFFNConfig):
        super().__init__()
        self.config = config
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        inv_freq, self.attention_scaling = self.rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @property
    def rope_init_fn(self) -> Callable:
        if self.rope_type == "default":
            return self.compute_default_rope_parameters
        return ROPE_INIT_FUNCTIONS[self.rope_type]

    @staticmethod
    def compute_default_rope_parameters(config: MemFFNConfig, device=None, **kwargs) -> tuple[torch.Tensor, float]:
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
        return 1.0 / (base**exponents), 1.0

    def reset_frequencies(self) -> None:
        """Recompute the (non-persistent) frequency buffers, e.g. after the model was built on the meta device."""
        inv_freq, self.attention_scaling = self.rope_init_fn(self.config)
        init.copy_(self.inv_freq, inv_freq)
        init.copy_(self.original_inv_freq, inv_freq)

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scaling = self.inv_freq.to(device=x.device, dtype=torch.float), float(self.attention_scaling)
        if ROTARY_TABLES_OPERATOR and torch.compiler.is_dynamo_compiling() and position_ids.shape[-1] > 1:
            # Left as PyTorch operations in a compiled graph, cos and sin are recomputed for every element inside each
            # layer's rotary kernel, forward and backward (inductor inlines cheap-looking producers into all their
            # consumers): the operator computes the tables once per forward and the rotations only read them.
            # Dynamo only (torch.compile, strict torch.export): eager steps and non-strict export, which ONNX export
            # tries first, keep the PyTorch operations (torch 2.11's Dynamo answers True to is_exporting() inside
            # torch.compile too, so that call cannot tell them apart), and so does a decoding step, whose one
            # position per sequence costs nothing to recompute.
            return _ROTARY_TABLES(position_ids, inv_freq, scaling, x.dtype)
        return rotary_tables(position_ids, inv_freq, scaling, x.dtype)


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [*position_ids.shape, 2 * len(inv_freq)] in ``dtype`` for float32 inverse frequencies."""
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


# The namespace of the fused FlashMHF operators (`flash_mhf_op.OP_NAMESPACE`, which tests check this agrees with): an
# operator already registered under this name comes from another copy of this file (a checkpoint's remote code).
ROTARY_TABLES_OP = "memffn_v2::rotary_tables"
ROTARY_TABLES_OPERATOR = True  # False: compiled graphs keep the tables' PyTorch operations (benchmarks compare both)


def _register_rotary_tables():
    registered = registered_operator(*ROTARY_TABLES_OP.split("::"))
    if registered is not None:
        return registered

    @torch.library.custom_op(ROTARY_TABLES_OP, mutates_args=())
    def rotary_tables_op(position_ids: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        return rotary_tables(position_ids, inv_freq, scaling, dtype)

    @rotary_tables_op.register_fake
    def _(position_ids, inv_freq, scaling, dtype):
        shape = (*position_ids.shape, 2 * inv_freq.shape[-1])
        return (position_ids.new_empty(shape, dtype=dtype), position_ids.new_empty(shape, dtype=dtype))

    return rotary_tables_op


_ROTARY_TABLES = _register_rotary_tables()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def rotate_queries_and_keys(query, key, cos, sin, kernels: str):
    """Rotary embedding of `query` and `key` in the projections' [B, L, H, D] layout; returns both as [B, H, L, D]
    (contiguous from the Triton kernel, transposed views from the PyTorch operations)."""
    if kernels != "torch" and decoder_kernels_unavailable(query, kernels) is None:
        return rotate_pair(query, key, cos, sin)
    return apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)


# --------------------------------------------------------------------------------------------------------------------
# Attention (grouped-query, through transformers' attention interface)
# --------------------------------------------------------------------------------------------------------------------
def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * n_rep, L, D]"""
    if n_rep == 1:
        return hidden_states
    batch, num_kv_heads, length, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, num_kv_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, num_kv_heads * n_rep, length, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # (a caller's 4-D mask, True where a query may attend, as sdpa takes it: added as 0 and 1 it would mask
        # nothing; transformers' eager masks are additive floats)
        attn_weights = attn_weights.masked_fill(~attention_mask, torch.finfo(attn_weights.dtype).min)
    elif attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MemFFNAttention(nn.Module):
    def __init__(self, config: MemFFNConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.decoder_kernels = config.decoder_kernels  # (set at build, as the norms' `kernels`)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)

    def check_distributed_loading(self, distributed_config, model_name: str, device_type: str) -> None:
        """Tensor parallelism shards the projections by whole heads (each rank views its share as heads of
        `head_dim`): the attention and key/value heads must divide by `tp_size` (the forward would otherwise stop
        at a reshape)."""
        tp_size = getattr(distributed_config, "tp_size", None) or 1
        heads = {field: getattr(self.config, field) for field in ("num_attention_heads", "num_key_value_heads")}
        for field, count in heads.items():
            if count % tp_size:
                allowed = [size for size in range(1, min(heads.values()) + 1)
                           if all(value % size == 0 for value in heads.values())]
                raise ValueError(
                    f"{model_name}: {field}={count} must divide by tp_size={tp_size} under tensor parallelism (each "
                    f"rank takes whole attention heads); allowed tp_size: {', '.join(map(str, allowed))}")

    def forward(self, hidden_states, position_embeddings, attention_mask, kv_cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = rotate_queries_and_keys(query, key, cos, sin, self.decoder_kernels)
        if kv_cache is not None:
            # (`kwargs`: a paged cache, since transformers 5.24, adds what the attention function needs to them)
            key, value = kv_cache.update(key, value, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


# --------------------------------------------------------------------------------------------------------------------
# The FFN on X0 enters each layer through a readout
# --------------------------------------------------------------------------------------------------------------------
class ComputedMemoryReadout:
    """Each layer's output of the FFNs on X0, computed by `TokenMemory` ([B, L, N, d]), split by layer.

    `unbind` over the layers (not one index per layer): in the backward pass the layers' gradients are joined in one
    step, where indexing would add a zero-filled [B, L, N, d] tensor per layer. A token lookup table provides the same
    `add_into` from the token ids instead (see `token_lookup.py`).
    """

    def __init__(self, outputs: torch.Tensor):
        self.layer_outputs = outputs.movedim(-2, 0).unbind(0)

    def add_into(self, hidden_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        return hidden_states + self.layer_outputs[layer_idx]


# --------------------------------------------------------------------------------------------------------------------
# Decoder layer, written once
# --------------------------------------------------------------------------------------------------------------------
class MemFFNDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MemFFNConfig, layer_idx: int, mlp: nn.Module | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.parallel_residual_ffn = config.parallel_residual_ffn
        self.self_attn = MemFFNAttention(config, layer_idx)
        self.input_layernorm = MemFFNRMSNorm(config.hidden_size, config.rms_norm_eps, config.decoder_kernels)
        self.mlp = mlp
        self.post_attention_layernorm = (
            MemFFNRMSNorm(config.hidden_size, config.rms_norm_eps, config.decoder_kernels)
            if self.mlp is not None else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        memory_output: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        memory_readout: ComputedMemoryReadout | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`memory_output`: this layer's FFN-on-X0 output as a tensor; `memory_readout`: an object that adds it
        (`add_into`, e.g. from a lookup table). The tensor is passed positionally so that activation checkpointing
        (also the reentrant kind, which sees only positional tensors) treats it as an input of the layer. The
        key/value cache comes as `cache` or `past_key_values` (see `take_cache`)."""
        layer_input = hidden_states
        attn_output, _ = self.self_attn(
            self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            kv_cache=take_cache(past_key_values, kwargs.pop("cache", None), kwargs, warn=False),
            **kwargs,
        )
        hidden_states = layer_input + attn_output
        if self.mlp is not None:
            ffn_input = layer_input if self.parallel_residual_ffn else hidden_states
            hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(ffn_input))
        if memory_output is not None:
            hidden_states = hidden_states + memory_output
        elif memory_readout is not None:
            hidden_states = memory_readout.add_into(hidden_states, self.layer_idx)
        return hidden_states


# --------------------------------------------------------------------------------------------------------------------
# Pretrained base: initialization, parameter counts, saving with tokenizer and model card
# --------------------------------------------------------------------------------------------------------------------
class MemFFNPreTrainedModel(PreTrainedModel):
    config_class = MemFFNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MemFFNDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # `output_hidden_states` / `output_attentions` are recorded by hooks on these modules (`capture_outputs`).
    _can_record_outputs = {"hidden_states": MemFFNDecoderLayer, "attentions": MemFFNAttention}

    def __init__(self, config, *args, **kwargs):
        # the classes of this file are the bases the architectures' modeling files build on (`refuse_the_base_class`)
        if type(self).__module__ == __name__:
            refuse_the_base_class(type(self).__name__)
        self.refuse_another_architectures_config(config)
        super().__init__(config, *args, **kwargs)

    @classmethod
    def refuse_another_architectures_config(cls, config) -> None:
        """A ValueError unless `config` is of this class's architecture: an instance of `config_class`, or of the
        same model type (the copy of `config_class` that a checkpoint's remote code defines). Built from another
        architecture's config, the model would hold that architecture's FFNs under this class's name, and its
        checkpoint would name this class beside the other model type (transformers' own classes take any config)."""
        expected = cls.config_class
        if isinstance(config, expected) or getattr(config, "model_type", None) == expected.model_type:
            return
        auto_class = getattr(cls, "auto_class_name", "AutoModel")
        raise ValueError(
            f"{cls.__name__} takes a {expected.__name__}, not a {type(config).__name__} (model_type "
            f"{getattr(config, 'model_type', None)!r}): build the model of this config with "
            f"{auto_class}.from_config(config), which picks its own class, or give {cls.__name__} a "
            f"{expected.__name__}")

    def _init_weights(self, module: nn.Module) -> None:
        std = initializer_std(self.config)
        if isinstance(module, nn.Linear):
            # Blocks that follow their paper's init (KV-FFN: N(0, kvffn_init_std)) tag their layers with `init_std`.
            init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            # the padding row gets no gradient (`padding_idx`): it starts at zero, as in transformers' own models
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, MemFFNRMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, MemFFNRotaryEmbedding):
            module.reset_frequencies()
        elif hasattr(module, "init_own_parameters"):  # FFN blocks holding plain parameters (FlashMHF, PKV, TokenMemory)
            module.init_own_parameters(std)

    @property
    def _device_mesh(self):
        """The device mesh `from_pretrained(distributed_config=...)` sets on the model (None without one)."""
        return self.__dict__.get("_memffn_device_mesh")

    @_device_mesh.setter
    def _device_mesh(self, mesh) -> None:
        # set right after the config's `distributed_config`, before transformers shards the model and loads the
        # weights: a block that this sharding would load wrong, or could not run on the mesh's devices, says so here
        # (`check_distributed_loading`)
        distributed_config = getattr(self.config, "distributed_config", None)
        if mesh is not None and distributed_config is not None:
            for module in self.modules():
                if hasattr(module, "check_distributed_loading"):
                    module.check_distributed_loading(distributed_config, type(self).__name__,
                                                     device_type=mesh.device_type)
        self.__dict__["_memffn_device_mesh"] = mesh

    def _token_memory(self) -> TokenMemory | None:
        base = getattr(self, self.base_model_prefix, self)
        return getattr(base, "memory", None)

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters (the model's size as trained), and active ones: those left on the device once the FFNs on
        the token embeddings X0 become token lookup tables (equal for architectures without such FFNs). Both stay the
        same after `drop_memory_ffn`: total still counts the dropped FFNs. Tied weights count once; parameters
        partitioned by DeepSpeed ZeRO-3 count with their full size."""
        def numel(param) -> int:  # DeepSpeed ZeRO-3 partitions parameters: `ds_numel` keeps the full size
            return getattr(param, "ds_numel", None) or param.numel()

        on_model = sum(numel(p) for p in self.parameters())
        memory = self._token_memory()
        if memory is None:  # (recorded by `drop_memory_ffn`; 0 for a model without FFNs on X0)
            base = getattr(self, self.base_model_prefix, self)
            return {"total": on_model + getattr(base, "_dropped_memory_parameters", 0), "active": on_model}
        return {"total": on_model, "active": on_model - sum(numel(p) for p in memory.parameters())}

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing: bool = True):
        """`PreTrainedModel.resize_token_embeddings`, with its arguments checked before anything changes. Unchecked,
        a negative `pad_to_multiple_of` shrinks the vocabulary below `new_num_tokens` (330 with -8 gives 328), 0
        divides by zero, `new_num_tokens=0` leaves a model without a vocabulary, and a bool, float or string fails
        inside torch. A resize that changes the number of token ids first passes `_before_vocabulary_change`; one
        to the size the embedding has changes nothing, as in transformers."""
        def positive_integer(value) -> bool:
            return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1

        if new_num_tokens is not None and not positive_integer(new_num_tokens):
            raise ValueError(f"resize_token_embeddings: new_num_tokens={new_num_tokens!r} is invalid; allowed values: "
                             "None or an integer >= 1")
        if pad_to_multiple_of is not None and not positive_integer(pad_to_multiple_of):
            raise ValueError(f"resize_token_embeddings: pad_to_multiple_of={pad_to_multiple_of!r} is invalid; allowed "
                             "values: None or an integer >= 1")
        if not isinstance(mean_resizing, bool):
            raise ValueError(f"resize_token_embeddings: mean_resizing={mean_resizing!r} is invalid; allowed values: "
                             "True or False")
        rows = embedding_rows(self.get_input_embeddings())
        rows_after = rows if new_num_tokens is None else new_num_tokens
        if pad_to_multiple_of is not None and rows_after is not None:  # (transformers rounds up the same way)
            rows_after = -(-rows_after // pad_to_multiple_of) * pad_to_multiple_of
        if rows_after != rows:
            self._before_vocabulary_change()
        return super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    def _before_vocabulary_change(self) -> None:
        """Called before `resize_token_embeddings` changes the number of token ids: a model holding something per
        token id that a resize would not follow refuses it here (MemoryLLM's loaded token lookup table)."""

    def attach_tokenizer(self, tokenizer) -> None:
        """Save this tokenizer with the model in `save_pretrained` (and `push_to_hub`)."""
        self._attached_tokenizer = tokenizer

    @property
    def attached_tokenizer(self):
        return getattr(self, "_attached_tokenizer", None)

    def attach_card_metadata(self, **fields) -> None:
        """Metadata of the model card that `save_pretrained` / `push_to_hub` write: `license`, `base_model`,
        `datasets`, `tags`, `language` (huggingface_hub's `ModelCardData` fields)."""
        model_card = _package_sibling("model_card")
        if model_card is None:
            # (this class is the copy of a checkpoint's code that `trust_remote_code` loaded: imported first, the
            # package registers its own classes, which transformers then loads the checkpoint with)
            try:
                installed = importlib.util.find_spec("hf_memffn") is not None
            except (ImportError, ValueError):
                installed = False
            remedy = "import hf_memffn before loading the model"
            if not installed:
                remedy = f"install the hf-memffn package (pip install hf-memffn) and {remedy}"
            raise RuntimeError(
                "attach_card_metadata: this model was loaded with the code saved beside its weights "
                f"(trust_remote_code), which writes no model card (the hf-memffn package writes it): {remedy} "
                "(`import hf_memffn`, then `from_pretrained(path)` as before), so that the package's classes load it")
        self.card_metadata = {**(getattr(self, "card_metadata", None) or {}), **model_card.check_card_metadata(fields)}

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint saved while FFN weights had adapters or int8
        attached (`hf_memffn.adapters`, e.g. the Trainer's checkpoints of such a model): their tensors are stored
        under `parametrizations.*` names that a fresh model lacks, so those weights would start at random."""
        output_loading_info = kwargs.pop("output_loading_info", False)
        use_own_checkpoint_conversions(cls.config_class)
        model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        if not getattr(model, "_weight_conversions", None):
            # transformers reverses on save the checkpoint conversions that matched while loading: none matched a
            # checkpoint without this architecture's FFN weights (a Llama's), and saving would keep the model's own
            # names (`mlp.key_up_value`, ...). Without a record, saving applies the architecture's, as for a new model.
            model.__dict__.pop("_weight_conversions", None)
        parametrized = sorted({before + "." + after.split(".")[0] for before, _, after in
                               (key.partition(".parametrizations.") for key in loading_info.get("unexpected_keys", ()))
                               if after})
        if parametrized:
            raise ValueError(
                f"from_pretrained: the checkpoint stores {len(parametrized)} weights ({', '.join(parametrized[:3])}"
                f"{', ...' if len(parametrized) > 3 else ''}) with adapters or int8 attached (hf_memffn.adapters), "
                "which a loaded model does not have: they would start at random. Load the model the adapters were "
                "added to, add the same adapters (add_weight_lora / quantize_weights_int8) and load the checkpoint's "
                "tensors with load_state_dict, as Trainer(resume_from_checkpoint=...) does; or merge the adapters "
                "(adapters.merge_weight_lora) before saving, for a checkpoint in the original format")
        # The checkpoint conversions that join FlashMHF's key/up/value and KV-FFN's key_proj/value_proj also match
        # the PKV baseline's key/value and KV-FFN's relu/densenet key_proj; loaded across the base model's prefix
        # (AutoModel from a causal LM's checkpoint, or the reverse), transformers then drops those tensors, which it
        # reports as unexpected under the joined names. A checkpoint without them (a Llama's, the SwiGLU baseline's)
        # starts the FFN at random as it starts any weight it lacks.
        dropped = sorted(key for key in loading_info.get("missing_keys", ())
                         if re.search(r"\.mlp\.(key|value|key_proj\.weight|key_proj\.bias)$", key))
        joined = any(re.search(r"\.mlp\.(key_up_value|key_value_proj\.weight|key_value_proj\.bias)$", key)
                     for key in loading_info.get("unexpected_keys", ()))
        if dropped and joined:
            raise ValueError(
                f"from_pretrained: {len(dropped)} FFN weights of the checkpoint ({', '.join(dropped[:3])}"
                f"{', ...' if len(dropped) > 3 else ''}) did not load into {cls.__name__}, so they would start at "
                "random. This happens for the ffn_variant pkv, relu and densenet baselines when the checkpoint was "
                "saved from the other class (a *ForCausalLM's checkpoint loaded as a base model, or the reverse): "
                "load it with the class it was saved from (`AutoModelForCausalLM.from_pretrained(path).model` for "
                "the base model)")
        return (model, loading_info) if output_loading_info else model

    def to(self, *args, **kwargs):
        """`PreTrainedModel.to`, naming the weights that hold no data where some are still on the meta device while
        the others are loaded (torch's own error names none). The usual cause: a model built under accelerate's
        `init_empty_weights()` and loaded with its `load_checkpoint_and_dispatch` or `load_checkpoint_in_model`,
        which copy a checkpoint's tensors by their names and skip the others; these architectures' checkpoints keep
        some weights under other names (the parts of a joined parameter, see the conversions in each modeling file),
        which only `from_pretrained` converts, and that dispatch then moves the model."""
        try:
            return super().to(*args, **kwargs)
        except NotImplementedError as error:
            empty = [name for name, param in self.named_parameters() if param.is_meta]
            if not empty or len(empty) == len(list(self.parameters())):
                raise  # (nothing loaded, or nothing empty: not this case)
            cls = type(self).__name__
            raise NotImplementedError(  # (the type torch raises here, for callers that catch it)
                f"{cls}.to: {len(empty)} weights hold no data (on the meta device: {', '.join(empty[:3])}"
                f"{', ...' if len(empty) > 3 else ''}) while the others are loaded. The usual cause: accelerate's "
                "load_checkpoint_and_dispatch or load_checkpoint_in_model, which load a checkpoint by its tensor "
                f"names, while {cls}'s checkpoints keep these weights under other names, which from_pretrained "
                f"converts: load with {cls}.from_pretrained(path, device_map=...) (or AutoModelForCausalLM's), which "
                "takes the same device_map, max_memory and offload_folder") from error

    def _adjust_missing_and_unexpected_keys(self, loading_info) -> None:
        """transformers' adjustment of the keys `from_pretrained` reports, plus the parts of joined parameters that
        the checkpoint lacked (`add_missing_checkpoint_parts`), under their checkpoint names."""
        super()._adjust_missing_and_unexpected_keys(loading_info)
        loading_info.missing_keys.update(self.__dict__.pop(MISSING_CHECKPOINT_PARTS, ()))

    def load_adapter(self, *args, **kwargs):
        """transformers' `load_adapter`, refusing a PEFT adapter saved on KV-FFN's former key and value layers
        (`refuse_adapters_of_former_key_value_layers`): transformers loads the rest of it, and its report of the
        keys left out says that such keys can be ignored. (Where the installed transformers returns no report, the
        check is not made.)"""
        loading_info = super().load_adapter(*args, **kwargs)
        if any(getattr(module, "key_value_proj", None) is not None for module in self.modules()):
            refuse_adapters_of_former_key_value_layers(getattr(loading_info, "unexpected_keys", None) or ())
        return loading_info

    def _refuse_an_incomplete_checkpoint(self) -> None:
        """A ValueError while a checkpoint saved now would not hold the model as it runs (see `save_pretrained`), or
        while its config would not load back: `from_pretrained` checks the fields that `__init__` checks, and a field
        changed since (a special token id past the vocabulary that `resize_token_embeddings` shrank, a field set by
        hand) would make the saved folder fail to load; while the attached tokenizer has more tokens than the
        vocabulary; or while transformers would refuse to save the generation config (`model.generation_config`, e.g.
        `top_k` set without `do_sample=True`) or a generation parameter set on `model.config`."""
        self.config.refuse_what_would_not_load()
        tokenizer = self.attached_tokenizer
        if tokenizer is not None and hasattr(tokenizer, "__len__") and len(tokenizer) > self.config.vocab_size:
            # (its ids past the embedding would be refused by every forward of the saved checkpoint)
            raise ValueError(
                f"save_pretrained: the attached tokenizer has {len(tokenizer)} tokens, more than the model's "
                f"vocab_size={self.config.vocab_size}; attach the model's own tokenizer, or make room for it first "
                f"(model.resize_token_embeddings({len(tokenizer)}))")
        if self.can_generate() and getattr(self, "generation_config", None) is not None:
            # transformers writes config.json and the remote code first and refuses a generation config with invalid
            # settings after them, leaving a folder without weights (or, saved over a checkpoint, the new config with
            # the old weights): its own check runs first, on a copy written to a temporary folder
            with tempfile.TemporaryDirectory(prefix="memffn-generation-config-") as folder:
                try:
                    self.generation_config.save_pretrained(folder)
                except (ValueError, TypeError) as error:
                    raise ValueError(f"save_pretrained: model.generation_config would not save: {error}") from error
        # transformers refuses generation parameters set on the config (`model.config.max_length = 64`) only when it
        # writes config.json, after the remote code: the folder would keep that code alone, or, saved over a
        # checkpoint, the new code beside the old config and weights
        on_config = getattr(self.config, "_get_generation_parameters", dict)()
        if on_config:
            moves = "; ".join(f"model.generation_config.{name} = {value!r}" for name, value in on_config.items())
            removals = "; ".join(f"del model.config.{name}" for name in on_config)
            raise ValueError(
                f"save_pretrained: generation parameters are set on model.config ({on_config}), where transformers "
                f"refuses to save them: set them on the generation config ({moves}) and remove them from the config "
                f"({removals})")
        base = getattr(self, self.base_model_prefix, self)
        if self.config.token_memory_size is not None and getattr(base, "memory", None) is None:
            raise ValueError("save_pretrained: the FFNs on the token embeddings were dropped (`drop_memory_ffn`), so "
                             "a checkpoint saved now would lack their weights; save the model before dropping them, "
                             "or load it again and save that")
        if "memory_readout" in vars(base):
            raise ValueError("save_pretrained: a token memory edit is applied (hf_memffn.analysis.TokenMemoryEdit): "
                             "it is held by this model instance, not by the weights, so a checkpoint saved now would "
                             "not hold it; revert it first (edit.revert()), or edit with method='value', which "
                             "changes the weights")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus the attached tokenizer and, with the hf-memffn package installed,
        a model card (README.md; see `model_card.py`). Refused, before anything is written, once the FFNs on the
        token embeddings were dropped (`drop_memory_ffn`): the checkpoint would lack their weights, and loading it
        would start them at random; while a token memory edit (`hf_memffn.analysis.TokenMemoryEdit`) is applied:
        the checkpoint would lack the edit; while the config would not load back (a special token id outside the
        vocabulary that `resize_token_embeddings` shrank); while the attached tokenizer has more tokens than
        `config.vocab_size`; and while `model.generation_config` holds settings that transformers refuses to save,
        or `model.config` a generation parameter (it would refuse them after writing config.json, or the remote
        code). With `push_to_hub=True` the folder is uploaded once it is complete (`repo_id`, by default the folder's
        name, `commit_message`, `commit_description`, `private`, `token`, `revision`, `create_pr`): with the
        package installed as `hf-memffn push` uploads it (`hub.push_folder`), else through `push_to_hub`;
        transformers' own upload would send its generic card and no tokenizer, written after the weights (and leave
        that card in the folder)."""
        push = kwargs.pop("push_to_hub", False)
        hub = _package_sibling("hub") if push else None
        if push:
            push_options = {name: kwargs.pop(name) for name in ("commit_message", "commit_description", "private",
                                                                "token", "revision", "create_pr") if name in kwargs}
            repo_id = kwargs.pop("repo_id", os.path.basename(os.path.abspath(os.fspath(save_directory))))
            if hub is not None:
                repo_id = hub.check_repo_id(repo_id)
                hub.refuse_parametrized_weights(self)  # (a checkpoint that from_pretrained refuses: before saving)
        self._refuse_an_incomplete_checkpoint()
        if any(parametrize.is_parametrized(module) for module in self.modules()):
            logger.warning_once(
                "save_pretrained: FFN weights have adapters or int8 attached (hf_memffn.adapters); the checkpoint "
                "stores them as such, which from_pretrained refuses (a Trainer's resume loads it). Merge them "
                "(adapters.merge_weight_lora) before saving for a checkpoint in the original format.")
        # FSDP2's `fully_shard` (accelerate's FSDP2, transformers' `fsdp_size`) swaps the model's class for one that
        # torch defines, `FSDP<name>(FSDPModule, <name>)`: transformers would copy torch's file as the modeling code
        # and name that class in `auto_map`. While saving, that class carries the name and module of the one it wraps.
        wrapper = type(self)
        wrapped = class_saved_as(wrapper)
        names = wrapper.__module__, wrapper.__name__, wrapper.__qualname__
        if wrapped is not wrapper:
            wrapper.__module__, wrapper.__name__, wrapper.__qualname__ = (
                wrapped.__module__, wrapped.__name__, wrapped.__qualname__)
        use_own_checkpoint_conversions(wrapped.config_class)  # (saving reverses them)
        try:
            result = super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            wrapper.__module__, wrapper.__name__, wrapper.__qualname__ = names
        if kwargs.get("is_main_process", True):
            if self.attached_tokenizer is not None:
                self.attached_tokenizer.save_pretrained(save_directory)
            model_card = _package_sibling("model_card")
            # (with adapters added through transformers' PEFT integration, `add_adapter`, the folder holds the
            # adapters alone, no config or weights: the card of a whole checkpoint would describe files it lacks)
            if model_card is not None and not getattr(self, "_hf_peft_config_loaded", False):
                model_card.write_model_card(self, save_directory)
            if hub is not None:
                hub.push_folder(save_directory, repo_id, **push_options)
            elif push:  # (what the folder holds: no token lookup table, as `hub.push_folder` uploads it)
                self.push_to_hub(repo_id, max_shard_size=kwargs.get("max_shard_size", "50GB"),
                                 include_token_lookup=False, **push_options)
        return result

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        commit_description: str | None = None,
        private: bool | None = None,
        token: bool | str | None = None,
        revision: str | None = None,
        create_pr: bool = False,
        max_shard_size: int | str | None = "50GB",
        tags: list[str] | str | None = None,
        tokenizer=None,
        include_token_lookup: bool = True,
    ):
        """With the hf-memffn package installed: upload exactly what `save_pretrained` writes (weights, config, remote
        code, tokenizer, this package's model card, and an attached token lookup table) in one commit. Takes
        `PreTrainedModel.push_to_hub`'s arguments (`tags` go into the card's metadata), plus `tokenizer` and
        `include_token_lookup`; see `hub.push_checkpoint` (transformers' own `push_to_hub` would replace the model card
        with a generic one). Loaded with `trust_remote_code` alone: transformers' `push_to_hub`, which saves through
        `save_pretrained` and so uploads `tokenizer` too, and the attached token lookup table's files (unless
        `include_token_lookup=False`)."""
        options = dict(commit_message=commit_message, commit_description=commit_description, private=private,
                       token=token, revision=revision, create_pr=create_pr, max_shard_size=max_shard_size, tags=tags)
        hub = _package_sibling("hub")
        if hub is None:
            if tags is None:  # transformers' `push_to_hub` iterates the `tags` it is given
                del options["tags"]
            self._refuse_an_incomplete_checkpoint()  # (transformers' creates the repository before it saves)
            attached = self.attached_tokenizer
            if tokenizer is not None:
                self.attach_tokenizer(tokenizer)
            self._push_token_lookup = include_token_lookup  # (read by `TokenLookupMixin.save_pretrained`)
            try:
                return super().push_to_hub(repo_id, **options)
            finally:
                self._attached_tokenizer = attached
                del self._push_token_lookup
        return hub.push_checkpoint(self, repo_id, tokenizer=tokenizer, include_token_lookup=include_token_lookup,
                                   **options)


def class_saved_as(model_class: type) -> type:
    """The class a model of `model_class` is saved as: the class itself, or the one that FSDP2's `fully_shard` wrapped
    in its `FSDP<name>(FSDPModule, <name>)` (see `save_pretrained`)."""
    return model_class.__bases__[-1] if model_class.__module__.startswith("torch.") else model_class


# --------------------------------------------------------------------------------------------------------------------
# The decoder stack
# --------------------------------------------------------------------------------------------------------------------
class MemFFNModel(MemFFNPreTrainedModel):
    # The FFN blocks a decoder layer may apply to its residual stream, by `config.residual_ffn` (each built from the
    # config). An architecture whose FFN lives in a file of its own adds it in its modeling file.
    residual_ffn_blocks: dict[str, Callable[[MemFFNConfig], nn.Module]] = {"swiglu": SwiGLUFeedForward.from_config}

    def __init__(self, config: MemFFNConfig):
        self.refuse_another_architectures_config(config)  # (before its fields are read)
        config.validate_fields()  # (fields set by hand after the config was built, `config.ffn_variant = ...`)
        # the parallel plans follow those fields too (transformers reads them from the config when it builds the
        # model's plans: a plan of the FFN the config had before would shard this one wrong)
        config.base_model_tp_plan = tensor_parallel_plan(config)
        config.base_model_pp_plan = pipeline_parallel_plan(config)
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            MemFFNDecoderLayer(config, i, self.build_residual_ffn(config)) for i in range(config.num_hidden_layers)
        )
        self.memory = build_token_memory(config)
        self.norm = MemFFNRMSNorm(config.hidden_size, config.rms_norm_eps, config.decoder_kernels)
        self.rotary_emb = MemFFNRotaryEmbedding(config)
        self.token_lookup = None  # set by `load_tols` (token_lookup.py) to read the FFNs on X0 from a table
        self.token_embedding_relay = None  # set under transformers' pipeline parallelism (see parallel.py)
        self.gradient_checkpointing = False
        self._decoder_path_logged = False
        self._long_sequence_logged = False
        self.post_init()

    @classmethod
    def build_residual_ffn(cls, config: MemFFNConfig) -> nn.Module | None:
        """The FFN that a decoder layer applies to its residual stream, as the config's wiring says."""
        kind = config.residual_ffn
        if kind is None:
            return None
        if kind not in cls.residual_ffn_blocks:
            raise ValueError(f"{cls.__name__}: residual FFN {kind!r} is not supported; allowed values: "
                             f"{', '.join(map(repr, cls.residual_ffn_blocks))}")
        return cls.residual_ffn_blocks[kind](config)

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def decoder_path(self, hidden_states: torch.Tensor | None = None) -> str:
        """What the decoder's RMSNorms and rotary embeddings run for `hidden_states` (by default the parameters'
        device and dtype): see `MemFFNConfig.decoder_kernels`, which the modules take when the model is built."""
        probe = hidden_states if hidden_states is not None else self.embed_tokens.weight[:1]
        # (the setting the norms were built with; a pipeline stage holds some of them, stand-ins for the others)
        built = next((module.kernels for module in self.modules() if isinstance(module, MemFFNRMSNorm)),
                     self.config.decoder_kernels)
        path = decoder_kernels_path(probe, built)
        if self.config.decoder_kernels != built:
            path += (f"; config.decoder_kernels={self.config.decoder_kernels!r} was set after the model was built "
                     f"with {built!r}, and its modules keep what they were built with: load the model with "
                     "from_pretrained(..., decoder_kernels=...) to change it")
        return path

    def plain_causal_mask(self, past_seen, query_length: int) -> bool:
        """Whether sdpa's `is_causal` flag can stand for the mask of a sequence without padding or packing that starts
        an empty cache (`past_seen` tokens cached, an int): training steps and the first forward of a prompt.
        transformers' `create_causal_mask` returns no mask there too, except while torch.compile traces (it cannot
        read the padding mask then; transformers 5.23 skips the mask under compile only from torch 2.14): the
        compiled graph then carries a [B, 1, L, L] mask, with which cuDNN's attention ran 2.8x slower than with the
        flag (H100, 370M preset). With a static cache, the unwritten positions after the prompt lie in every query's
        future, which the flag masks. transformers' sdpa drops the flag for a single query, so a one-token forward
        into an empty static cache needs the mask that hides the unwritten positions."""
        return (self.config._attn_implementation == "sdpa" and isinstance(past_seen, int) and past_seen == 0
                and query_length > 1)

    def memory_readout(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor):
        """Where each layer's FFN on X0 comes from: a token lookup table if one is loaded, else `TokenMemory`."""
        if self.token_lookup is not None:
            if input_ids is None:
                raise ValueError(
                    "token lookup tables are loaded: the FFNs on the token embeddings are read from them by token "
                    "id, so pass `input_ids` (not `inputs_embeds`; `generate()` given both feeds the prompt as "
                    "`inputs_embeds`), or call `unload_tols()` first")
            if self.training and torch.is_grad_enabled():
                self._refuse_training_the_table_inputs()
            if not is_torchdynamo_compiling():  # (an adapter put on the embedding or the FFNs after `load_tols`)
                self.token_lookup.check_sources(self)
            return self.token_lookup.readout(input_ids)
        if self.memory is None:
            if self.config.token_memory_size is None:
                return None
            raise RuntimeError(
                "the FFNs on the token embeddings were dropped (`drop_memory_ffn`) and no lookup table is loaded"
            )
        if self.gradient_checkpointing and self.training:
            outputs = torch.utils.checkpoint.checkpoint(self.memory, inputs_embeds, use_reentrant=False)
        else:
            outputs = self.memory(inputs_embeds)
        return ComputedMemoryReadout(outputs)

    def _refuse_training_the_table_inputs(self) -> None:
        """A table holds the FFNs on X0 of fixed weights: no gradient reaches those FFNs (or X0 through them), and a
        step that changed the weights would leave the table out of date."""
        # (every parameter of the embedding module: an adapter on it, such as PEFT's LoRA, changes X0 too)
        trained = ["embed_tokens"] if any(param.requires_grad for param in self.embed_tokens.parameters()) else []
        if self.memory is not None and any(param.requires_grad for param in self.memory.parameters()):
            trained.append("memory")
        if trained:
            names, freeze = " and ".join(trained), ", ".join(f"{name}.requires_grad_(False)" for name in trained)
            raise ValueError(
                f"a token lookup table is loaded and the parameters of {names} require gradients: the table replaces "
                "the FFNs on the token embeddings, so training would silently skip them; call unload_tols() before "
                f"training them, or freeze them ({freeze}) to train the rest")

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """The key/value cache: `cache` (transformers 5.24 and later) or `past_key_values` (see `take_cache`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of `input_ids` or `inputs_embeds`")
        name, tokens = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
        if (cache is not None or past_key_values is not None) and not is_torchdynamo_compiling() \
                and tokens.dim() >= 2 and tokens.shape[1] == 0:
            # (generate() feeds what follows the cached tokens: nothing, given no more tokens than the cache holds)
            raise ValueError(
                f"no new token to run beside the key/value cache ({name} of shape {tuple(tokens.shape)}): a forward "
                "with a cache takes the tokens after the cached ones, and generate() given a cache takes the whole "
                "sequence, the cached tokens included")
        if input_ids is not None and not (self.training and input_ids.device.type != "cpu"):
            # (not in accelerator training steps: the check reads the ids back, a sync per step that Llama does not pay)
            check_token_ids(input_ids, embedding_rows(self.embed_tokens))
        if input_ids is None and not is_torchdynamo_compiling() and 0 in inputs_embeds.shape[:-1]:
            # (as `check_token_ids` refuses empty ids: no sequence or no token would fail inside the mask's helpers)
            raise ValueError(f"inputs_embeds is empty (shape {tuple(inputs_embeds.shape)}): pass at least one token "
                             "per sequence")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        # (the compile check first: read while tracing, the flag would become a guard, and the eager forward that
        # sets it would make every compiled graph of the model recompile)
        if not is_torchdynamo_compiling() and not self._decoder_path_logged:
            logger.info("decoder runs the %s", self.decoder_path(inputs_embeds))
            self._decoder_path_logged = True
        cache = take_cache(past_key_values, cache, kwargs)
        # (before the mask's check: a cache of another batch makes the mask look wrong too, as transformers 5.17's
        # generate() passes the new tokens' mask alone)
        if cache is not None and not is_torchdynamo_compiling():
            check_cache_batch(cache, inputs_embeds.shape[0])
        # (a tensor: continuous batching passes its own masks, as a dict by layer type, and flex attention's callers
        # may pass a BlockMask)
        if isinstance(attention_mask, torch.Tensor):
            check_attention_mask(attention_mask, inputs_embeds.shape[:2], cache)
        if cache is not None and type(cache) is not DynamicCache and inputs_embeds.shape[1] > 1 \
                and not is_torchdynamo_compiling():
            # (a prompt or a chunk of one: a one-token decoding step overflows only a full cache, which the device's
            # count of cached tokens would say, a sync per step)
            check_static_cache_room(cache, inputs_embeds.shape[1], f"a forward of {inputs_embeds.shape[1]} new tokens")
        if position_ids is None and cache is None and kwargs.get("cu_seq_lens_q") is not None:
            # (sequences packed into one row and marked for flash attention alone: the positions mark them for the mask;
            # not checked in accelerator training steps, as the token ids)
            bounds = kwargs["cu_seq_lens_q"]
            check = not (self.training and bounds.device.type != "cpu")
            position_ids = packed_sequence_positions(bounds, inputs_embeds.shape[:2], check).to(inputs_embeds.device)
        # no padding, no packed positions: the mask is causal alone (see `plain_causal_mask`)
        causal_only = attention_mask is None and position_ids is None
        if position_ids is not None and not is_torchdynamo_compiling():
            check_position_ids(position_ids, inputs_embeds.shape[:2])
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen
            position_ids = position_ids.unsqueeze(0)
            # (the compile check first: a static cache counts its tokens in a tensor, which a traced comparison would
            # branch on, breaking the graph of a compiled decoding step)
            length = None if is_torchdynamo_compiling() else int(past_seen) + inputs_embeds.shape[1]
            if length is not None and length > self.config.max_position_embeddings and not self._long_sequence_logged:
                # (once per model: a decoding loop past the limit would otherwise log each new length)
                logger.warning(
                    f"sequence length {length} exceeds max_position_embeddings={self.config.max_position_embeddings}: "
                    "positions beyond it were never trained, expect degraded outputs"
                )
                self._long_sequence_logged = True

        if causal_only and self.plain_causal_mask(past_seen, inputs_embeds.shape[1]):
            causal_mask = None
        else:
            # (the cache positionally: transformers 5.24 renamed that argument)
            causal_mask = create_causal_mask(self.config, inputs_embeds, attention_mask, cache,
                                             position_ids=position_ids)
        if use_cache and cache is None:
            # (made after the mask: given no cache, the mask keeps sequences packed into one row, which restart their
            # `position_ids` at 0, apart, as `DataCollatorWithFlattening` needs; an empty cache adds nothing to it)
            cache = DynamicCache(config=self.config)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        token_embeddings = inputs_embeds
        if self.token_embedding_relay is not None and self.config.token_memory_size is not None:
            token_embeddings = self.token_embedding_relay.exchange(inputs_embeds)  # X0 on every pipeline stage
        memory_readout = self.memory_readout(input_ids, token_embeddings)

        hidden_states = inputs_embeds
        computed = isinstance(memory_readout, ComputedMemoryReadout)
        for index, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            # (a layer another pipeline stage owns is an identity that returns the hidden states)
            hidden_states = layer(
                hidden_states,
                memory_readout.layer_outputs[index] if computed else None,
                attention_mask=causal_mask,
                position_embeddings=position_embeddings,
                memory_readout=None if computed else memory_readout,
                position_ids=position_ids,
                **{CACHE_KWARG: cache},
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, **{CACHE_KWARG: cache})


def positions_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions whose logits are asked for (generation needs the last one only), as transformers' models take
    `logits_to_keep`: an int keeps the last that many positions (0: all); a 2-D integer tensor [batch, k] each row's
    own positions; a 2-D boolean mask [batch, length] the positions it marks, flattened to [marked, hidden]; anything
    else (a 1-D tensor, a list, a slice) indexes the positions of every row."""
    if isinstance(logits_to_keep, int):
        return hidden_states[:, -logits_to_keep:, :] if logits_to_keep else hidden_states
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden_states[logits_to_keep]
        return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
    return hidden_states[:, logits_to_keep, :]


class MemFFNHeadModel(MemFFNPreTrainedModel):
    """The decoder (`self.model`, a `base_model_class`) under a task head: what the causal LM, the sequence and token
    classifiers and the question-answering model share.

    Each head names the Auto class it is registered with (`auto_class_name`) and transformers' table of the model
    classes of its task (`task_class_names`; see `register_for_auto_classes`)."""

    base_model_class = MemFFNModel
    auto_class_name: str
    task_class_names: dict[str, str]
    # transformers' pipeline parallelism (`pp_size`) runs a causal LM's forward only: the last stage's output must have
    # `logits` of [batch, length, vocab] and a cache, which it broadcasts to every stage; the other heads are refused
    runs_in_pipeline = False

    @property
    def _pp_stage(self):
        """The pipeline stage transformers' pipeline parallelism sets on the model (None without it)."""
        return self.__dict__.get("_memffn_pp_stage")

    @_pp_stage.setter
    def _pp_stage(self, stage) -> None:
        if stage is not None and not self.runs_in_pipeline:
            # set while the model is built, on every stage, before any weight is loaded: without this the last stage
            # fails in transformers' broadcast of the logits and the other stages wait for it forever
            raise ValueError(
                f"{type(self).__name__} does not work under pipeline parallelism (pp_size > 1): transformers' "
                "pipeline passes on a causal LM's logits only. Use tensor parallelism (tp_size), FSDP or DeepSpeed for "
                "this head, or pipeline parallelism with AutoModelForCausalLM")
        self.__dict__["_memffn_pp_stage"] = stage
        if stage is not None and self.config.token_memory_size is not None:
            self.model.token_embedding_relay = TokenEmbeddingRelay(stage)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def load_tols(self, *args, **kwargs):
        """Token lookup tables replace FFNs on the token embeddings: MemoryLLM and FlexMemoryLLM override this."""
        raise ValueError(f"{type(self).__name__} has no FFNs on the token embeddings: load_tols applies to "
                         "MemoryLLM and FlexMemoryLLM models")

    def run_decoder(self, input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds, use_cache,
                    kwargs: dict) -> BaseModelOutputWithPast:
        """The decoder's outputs for a head's forward arguments (the key/value cache: `cache` on transformers 5.24
        and later, else `past_key_values`; see `take_cache`)."""
        cache = take_cache(past_key_values, cache, kwargs)
        return self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_KWARG: cache},
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )


class MemFFNForCausalLM(MemFFNHeadModel, GenerationMixin):
    auto_class_name, task_class_names = "AutoModelForCausalLM", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    runs_in_pipeline = True

    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, batch_size,
                                      max_cache_length, *args, **kwargs):
        """generate()'s cache, as transformers prepares it; a static cache the caller passed is first checked to
        hold `max_cache_length` positions (the prompt's, the cached ones included, and the new tokens' but the last,
        which is never fed back), once before the first step."""
        for name in ("cache", "past_key_values"):
            check_static_cache_room(model_kwargs.get(name), max_cache_length,
                                    f"generate() of up to max_length={generation_config.max_length} tokens",
                                    " (or cache_implementation='static', which sizes one)")
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
                                                     max_cache_length, *args, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        """The key/value cache: `cache` (transformers 5.24 and later) or `past_key_values` (see `take_cache`)."""
        outputs = self.run_decoder(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                   use_cache, kwargs)
        hidden_states = outputs.last_hidden_state
        logits = self.lm_head(positions_to_keep(hidden_states, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# transformers' generate() reads the forward's signature at every decoding step of a model with its own code (to see
# whether it takes `cache_position`), and `inspect` rebuilds it each time: host time that transformers' own models do
# not pay, and that a static-cache step, bound by the host, shows. Computed once, and stored on the undecorated
# function, where `inspect` finds it after following the decorators: the bound method's signature still drops `self`,
# also through wrappers that copy the decorated function's attributes (accelerate's hooks).
_undecorated_forward = inspect.unwrap(MemFFNForCausalLM.forward)
_undecorated_forward.__signature__ = inspect.signature(_undecorated_forward)


class MemFFNForSequenceClassification(MemFFNHeadModel):
    """The decoder with a linear head (`score`, `config.num_labels` outputs) read at each sequence's last token, as
    transformers' Llama does. `AutoModelForSequenceClassification.from_pretrained` of a causal LM's checkpoint loads
    its decoder and starts the head at random. The loss follows `config.problem_type` (regression, single-label or
    multi-label classification; guessed from the labels when unset).

    The last token of each row: the last position that `attention_mask` (2-D; with a cache, its columns of the new
    tokens) keeps, else the last token that is not `config.pad_token_id` (padding on either side), else the last
    position, which needs one sequence per batch or no padding (a batch of embeddings without a mask needs
    `config.pad_token_id` set, and is read at its last positions with a warning, as Llama's)."""

    auto_class_name = "AutoModelForSequenceClassification"
    task_class_names = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
    # The loss is the batch's mean whatever the problem type, never divided by the HF Trainer's `num_items_in_batch`:
    # without this the Trainer, seeing `**kwargs` in forward, would leave it undivided by the accumulation steps
    accepts_loss_kwargs = False

    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self._unmasked_embeddings_logged = False
        self.post_init()

    def last_token_positions(self, input_ids, attention_mask, batch_size: int, length: int, device) -> torch.Tensor:
        """[batch] index of each row's last token (see the class's docstring)."""
        positions = torch.arange(length, device=device)
        if attention_mask is not None and attention_mask.dim() == 2:
            # (with a key/value cache the mask covers the cached tokens too: its last `length` columns are these)
            current = attention_mask[:, -length:]
            return (positions * current.to(device=device, dtype=torch.long)).argmax(-1)
        if input_ids is not None and self.config.pad_token_id is not None:
            return (positions * (input_ids != self.config.pad_token_id).to(device=device, dtype=torch.long)).argmax(-1)
        given = "" if attention_mask is None else f" (a {attention_mask.dim()}-D `attention_mask` marks no padding)"
        if batch_size > 1 and (input_ids is not None or self.config.pad_token_id is None):
            raise ValueError(f"{type(self).__name__}: a batch of {batch_size} sequences needs a 2-D `attention_mask` "
                             f"[batch, tokens] or `config.pad_token_id` to find each sequence's last token{given}")
        if batch_size > 1 and not is_torchdynamo_compiling() and not self._unmasked_embeddings_logged:
            # (Llama warns here too: a padded row would be scored at a padding token; once per model, as PEFT's prompt
            # tuning without a mask passes embeddings at every step)
            logger.warning(f"{type(self).__name__}: a batch of `inputs_embeds` without a 2-D `attention_mask` is "
                           "scored at each row's last position (`config.pad_token_id` cannot find padding in "
                           f"embeddings){given}; pass a 2-D `attention_mask` [batch, tokens] if the rows are padded")
            self._unmasked_embeddings_logged = True
        return torch.full((batch_size,), length - 1, device=device, dtype=torch.long)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutputWithPast:
        outputs = self.run_decoder(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                   use_cache, kwargs)
        logits = self.score(outputs.last_hidden_state)
        batch_size, length = logits.shape[:2]
        last = self.last_token_positions(input_ids, attention_mask, batch_size, length, logits.device)
        pooled_logits = logits[torch.arange(batch_size, device=logits.device), last]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, pooled_logits=pooled_logits, config=self.config)
        return SequenceClassifierOutputWithPast(
            loss=loss,
            logits=pooled_logits,
            **{CACHE_KWARG: getattr(outputs, CACHE_KWARG)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class MemFFNForTokenClassification(MemFFNHeadModel):
    """The decoder with a linear head (`score`, `config.num_labels` outputs, with a bias unless
    `config.token_classification_bias` is False) on every token, after dropout (`config.classifier_dropout`, else
    `config.hidden_dropout`, else 0.1), as transformers' Llama reads them. The loss is the
    cross-entropy over the tokens whose label is not -100 (padding, and the sub-words a labelling leaves out). Given
    `num_items_in_batch` (the HF Trainer's count of labelled tokens over the accumulated batches), it is their sum
    divided by that count, as the causal LM's is, so that gradient accumulation gives the update of one large batch;
    transformers' Llama drops the count here and keeps each batch's mean, which the Trainer then leaves undivided by
    the accumulation steps."""

    auto_class_name = "AutoModelForTokenClassification"
    task_class_names = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        dropout = next((value for value in (getattr(config, "classifier_dropout", None),
                                            getattr(config, "hidden_dropout", None)) if value is not None), 0.1)
        self.dropout = nn.Dropout(dropout)
        self.score = nn.Linear(config.hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> TokenClassifierOutput:
        # (no key/value cache unless asked for: the output carries none)
        outputs = self.run_decoder(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                   bool(use_cache), kwargs)
        logits = self.score(self.dropout(outputs.last_hidden_state))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config, **kwargs)
        return TokenClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class MemFFNForQuestionAnswering(MemFFNHeadModel):
    """Extractive question answering, as transformers' Llama does it: a linear head (`qa_outputs`, with a bias) scores
    every token as the start and as the end of the answer span. The loss is the mean of the start's and the end's
    cross-entropies (transformers' `ForQuestionAnsweringLoss`, Llama's): a position past the end of the sequence
    counts as its length and is ignored, a negative one (-100 too) counts as 0, the first token, and is scored."""

    auto_class_name = "AutoModelForQuestionAnswering"
    task_class_names = MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES

    def __init__(self, config: MemFFNConfig):
        super().__init__(config)
        self.model = self.base_model_class(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        outputs = self.run_decoder(input_ids, attention_mask, position_ids, past_key_values, cache, inputs_embeds,
                                   bool(use_cache), kwargs)  # (no cache unless asked for, as above)
        start_logits, end_logits = (scores.squeeze(-1).contiguous()
                                    for scores in self.qa_outputs(outputs.last_hidden_state).split(1, dim=-1))
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = self.loss_function(start_logits, end_logits, start_positions, end_positions, **kwargs)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


# model type -> this copy's checkpoint conversions (`register_checkpoint_conversions`). transformers keeps one table of
# conversions per process, by model type, which each copy of these files fills when imported: another copy (a
# checkpoint's remote code, perhaps older) imported later would otherwise convert the weights this copy loads and saves.
_CHECKPOINT_CONVERSIONS: dict[str, list] = {}


def register_checkpoint_conversions(model_type: str, conversions: list) -> None:
    """Register `conversions` for `model_type` with transformers, and again before each load and save by a class of this
    copy of the code (`use_own_checkpoint_conversions`)."""
    _CHECKPOINT_CONVERSIONS[model_type] = conversions
    register_checkpoint_conversion_mapping(model_type, conversions, overwrite=True)


def use_own_checkpoint_conversions(config_class) -> None:
    """Put this copy's conversions of `config_class`'s model type back in transformers' table (see above)."""
    model_type = getattr(config_class, "model_type", None)
    if model_type in _CHECKPOINT_CONVERSIONS:
        register_checkpoint_conversion_mapping(model_type, _CHECKPOINT_CONVERSIONS[model_type], overwrite=True)


def register_for_auto_classes(config_class, model_class, *head_classes) -> None:
    """Mark an architecture's classes so that `save_pretrained` copies their modeling file and its sibling imports
    next to the weights; config.json's `auto_map` points the Auto classes at them (`MemFFNConfig.default_auto_map`).

    Each head class is also named in transformers' table of its task's model classes (`task_class_names`). The HF
    Trainer shifts the labels for its label smoothing only for the classes named among the causal LMs (the
    text-generation pipeline and `transformers serve` look there too; each other pipeline in its task's table). Done
    here, it also happens when the code is loaded with `trust_remote_code` and this package is absent."""
    config_class.register_for_auto_class("AutoConfig")
    model_class.register_for_auto_class("AutoModel")
    for head_class in head_classes:
        head_class.register_for_auto_class(head_class.auto_class_name)
        head_class.task_class_names.setdefault(config_class.model_type, head_class.__name__)


__all__ = [
    "MemFFNPreTrainedModel",
    "MemFFNModel",
    "MemFFNHeadModel",
    "MemFFNForCausalLM",
    "MemFFNForSequenceClassification",
    "MemFFNForTokenClassification",
    "MemFFNForQuestionAnswering",
    "MemFFNDecoderLayer",
]
