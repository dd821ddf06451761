"""Configurations of the four FFN-as-memory architectures.

All four are Llama-style decoders and share the Llama field names; each adds the fields of its FFN. A config also
says how its decoder is wired (see `MemFFNConfig.residual_ffn` / `token_memory_size`), so the modeling code is written
once and reads the wiring from here.

This file is copied next to saved checkpoints for `trust_remote_code`: it imports only transformers.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import math
import numbers
import os
import shutil

from transformers import GenerationConfig, PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Activations of the SwiGLU FFNs (`hidden_act`), by their transformers names.
HIDDEN_ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "tanh", "sigmoid")


def check_choice(field: str, value, allowed, owner: str | None = None) -> None:
    """A clear one-line error unless `value` is one of `allowed`, naming the field (and the class it belongs to)."""
    if value not in allowed:
        where = f"{owner}: " if owner else ""
        raise ValueError(f"{where}`{field}`={value!r} is not supported; allowed values: {', '.join(map(repr, allowed))}")


def _check(config_name: str, condition: bool, field: str, value, requirement: str) -> None:
    if not condition:
        raise ValueError(f"{config_name}: `{field}`={value!r} is invalid: {requirement}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_positive_ints(config, fields) -> None:
    for field in fields:
        value = getattr(config, field)
        _check(type(config).__name__, _is_int(value) and value > 0, field, value, "must be a positive integer")


def _check_bools(config, fields) -> None:
    for field in fields:
        value = getattr(config, field)
        _check(type(config).__name__, isinstance(value, bool), field, value, "must be True or False")


def _check_number(config, field: str, low: float, low_inclusive: bool, high: float | None = None,
                  hint: str | None = None) -> None:
    value = getattr(config, field)
    interval = f"{'[' if low_inclusive else '('}{low:g}, {'inf)' if high is None else f'{high:g})'}"
    within = (_is_number(value) and math.isfinite(value) and (value >= low if low_inclusive else value > low)
              and (high is None or value < high))
    requirement = f"must be a number in {interval}" if high is not None else (
        f"must be a finite number {'>=' if low_inclusive else '>'} {low:g}")
    _check(type(config).__name__, within, field, value, requirement + (f" ({hint})" if hint else ""))


def _refuse_unread(config, field: str, default, reason: str) -> None:
    """A field that the chosen FFN does not read must keep its default: another value would build the model of the
    default while the config names another one."""
    value = getattr(config, field)
    _check(type(config).__name__, value == default, field, value,
           f"must be {default!r} here: {reason} (a saved config.json with another value loads with "
           f"`from_pretrained(path, {field}={default!r})`)")


# `dtype` (or `torch_dtype`) of a config, by name: the floating-point dtypes a model can be built in
FLOATING_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64", "float", "half", "double")


def _check_base_fields(config_name: str, fields: dict) -> None:
    """The fields of `fields` that PreTrainedConfig reads as it sets them (`head_dim` by its RoPE check, `num_labels`
    by counting labels, `id2label` by its keys, `dtype` by its name in torch, `layer_types` by each entry): a wrong
    type there raises a TypeError or AttributeError from inside transformers that names no field."""
    for field, value in fields.items():
        if field == "num_labels":  # (None only where `id2label` is unset: not given as a number of labels)
            # (any integer type transformers counts labels with: NumPy's too, as `labels.max() + 1` gives it)
            integer = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            _check(config_name, integer and value >= 1, field, value,
                   "must be >= 1 (an integer: the outputs of the classification heads)")
        elif value is None:
            continue
        elif field == "head_dim":
            _check(config_name, _is_int(value) and value > 0, field, value, "must be a positive integer")
        elif field in ("id2label", "label2id"):
            _check(config_name, isinstance(value, dict), field, value,
                   "must be None or a dict, one entry per label (such as {0: 'negative', 1: 'positive'})")
        elif field in ("dtype", "torch_dtype"):
            if isinstance(value, dict) or value == "auto":  # (transformers' per-module dtypes and "auto": its own)
                continue
            # (a torch.dtype is compared by its name: this file imports no torch. float8 and float4 dtypes are
            # floating-point too, but transformers builds the model under torch's default dtype, which cannot be one
            # of them, and config.json would hold a name that this check refuses when the config is read back)
            name = str(value).removeprefix("torch.") if type(value).__name__ == "dtype" else value
            _check(config_name, isinstance(name, str) and name in FLOATING_DTYPE_NAMES, field, value,
                   "must be None, 'auto', one of torch.float32, torch.float16, torch.bfloat16, torch.float64, or its "
                   f"name: {', '.join(map(repr, FLOATING_DTYPE_NAMES))}")
        elif field == "layer_types":
            _check(config_name, isinstance(value, (list, tuple)), field, value,
                   "must be None or 'full_attention' for every layer: the decoder's attention is full causal")
        elif field == "output_hidden_states":  # (transformers 5.17 refused it itself, without the allowed values)
            _check(config_name, isinstance(value, bool), field, value, OUTPUT_HIDDEN_STATES_REQUIREMENT)


OUTPUT_HIDDEN_STATES_REQUIREMENT = "must be True or False"
# the fields `_check_base_fields` checks, wherever they are given (the config's keywords, from_pretrained's)
BASE_FIELDS = ("head_dim", "num_labels", "id2label", "label2id", "dtype", "torch_dtype", "layer_types",
               "output_hidden_states")

# `config.problem_type` of the sequence classifier's loss (None: guessed from `num_labels` and the labels' dtype)
PROBLEM_TYPES = (None, "regression", "single_label_classification", "multi_label_classification")

# Keys of the RoPE dicts of `ROPE_TYPES` that transformers reads from `rope_parameters` only (it moves `rope_theta`,
# `partial_rotary_factor` and `original_max_position_embeddings` given beside the fields into the dict itself)
ROPE_DICT_KEYS = ("rope_type", "factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                  "short_factor", "long_factor", "low_freq_factor", "high_freq_factor")

# RoPE types the decoder supports: the default and every type of transformers' RoPE init functions that scales the
# frequencies of a plain (text, one-axis) rotary embedding, as LlamaForCausalLM does.
ROPE_TYPES = ("default",) + tuple(name for name in ("linear", "dynamic", "yarn", "longrope", "llama3")
                                  if name in ROPE_INIT_FUNCTIONS)


# Fields that only some FFN blocks read, with the default that the others require (`_refuse_unread`)
UNREAD_FIELD_DEFAULTS = {"hidden_act": "silu", "kvffn_activation": "silu", "kvffn_composition": "product",
                         "kvffn_inner_residual": False}


# Keys transformers keeps on a config besides this package's fields: PreTrainedConfig's own, the generation
# parameters it drops from a config, those it takes as keywords, and those configs saved by transformers 4 or by
# Llama carry (a Llama config's `pretraining_tp` is read by neither Llama's forward nor this decoder's): never taken
# for a misspelled field of this package.
_GENERATION_PARAMS = getattr(GenerationConfig, "_get_default_generation_params", dict)()
TRANSFORMERS_CONFIG_KEYS = frozenset(getattr(PreTrainedConfig, "__dataclass_fields__", {})) | frozenset(
    _GENERATION_PARAMS) | frozenset((
        "name_or_path", "torch_dtype", "output_attentions", "attn_implementation", "experts_implementation",
        "per_layer_config", "auto_map", "rope_scaling", "quantization_config", "pretraining_tp", "mlp_bias",
        "sliding_window", "attention_chunk_size", "layer_types", "num_labels", "classifier_dropout", "hidden_dropout",
        "token_classification_bias", "tie_last_hidden_states", "tp_plan", "pp_plan", "tp_size", "use_return_dict",
        "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "is_decoder", "add_cross_attention",
        "tie_encoder_decoder", "cross_attention_hidden_size", "finetuning_task", "tokenizer_class", "prefix",
        "sep_token_id", "decoder_start_token_id", "task_specific_params", "max_length", "min_length",
        "original_max_position_embeddings", "partial_rotary_factor"))  # (RoPE fields transformers moves into the dict)


@functools.cache
def _fields_of(config_class) -> frozenset[str]:
    """The fields `config_class` defines: its keyword arguments (its own and those of the shared decoder) and the
    fields it derives from them."""
    fields = set()
    for klass in config_class.__mro__:
        if isinstance(klass, type) and issubclass(klass, MemFFNConfig) and "__init__" in vars(klass):
            fields.update(name for name, parameter in inspect.signature(vars(klass)["__init__"]).parameters.items()
                          if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name != "self")
        fields.update(name for name, item in vars(klass).items()
                      if isinstance(item, property) and not name.startswith("_"))
    return frozenset(fields)


def unknown_field_requirement(config_class, key: str) -> str | None:
    """Why `key` is refused as a field of `config_class`, or None where it is accepted. transformers keeps any unknown
    keyword on a config, where nothing reads it: a misspelled field of this package (`ffn_num_head=8`) or a field of
    another of its architectures (`ffn_kernel` on KVFFN) would build the model of the default without a word. Other
    unknown keys (a note kept on the config, a field of another library) stay accepted, as transformers accepts them."""
    own = _fields_of(config_class)
    if key.startswith("_") or key in own or key in TRANSFORMERS_CONFIG_KEYS:
        return None
    if key in ROPE_DICT_KEYS:
        return ("a key of `rope_parameters`, read there only (beside the fields the rotary embedding never reads "
                "it): give it in that dict, such as rope_parameters={'rope_type': 'linear', 'factor': 2.0}; a saved "
                "config.json with it loads once the key is removed from the file (its model ran without it)")
    if key.endswith(("_token_id", "_token_index")):  # (a tokenizer's other special tokens, kept as Llama keeps them)
        return None
    readers = [other.__name__ for other in CONFIG_CLASSES if key in _fields_of(other)]
    matches = difflib.get_close_matches(key, sorted(own), n=3, cutoff=0.8)
    meant = f" (did you mean {' or '.join(f'`{match}`' for match in matches)}?)" if matches else ""
    if readers:
        reason = f"a field of {' and '.join(readers)}, which {config_class.__name__} does not read{meant}"
    elif matches:
        reason = f"not a field of {config_class.__name__}{meant}"
    else:
        return None
    return reason + "; leave it out (a saved config.json with it loads once the key is removed from the file)"


def _refuse_unknown_fields(config) -> None:
    """`unknown_field_requirement` of every key on the config: given to `__init__`, or set by hand since."""
    for key, value in vars(config).items():
        requirement = unknown_field_requirement(type(config), key)
        _check(type(config).__name__, requirement is None, key, value, requirement)


# Tensor-parallel style (registered by parallel.py) of a block whose hidden units are split over the ranks.
PARTIAL_SUM_STYLE = "memffn_partial_sum"


def tensor_parallel_plan(config) -> dict[str, str]:
    """`base_model_tp_plan` of a config: which modules and parameters shard how (module names under the base model)."""
    plan = {"embed_tokens": "embedding_rowwise"} if config.tie_word_embeddings else {}  # the head's weight is sharded
    plan.update({f"layers.*.self_attn.{name}": "colwise" for name in ("q_proj", "k_proj", "v_proj")})
    plan["layers.*.self_attn.o_proj"] = "rowwise"
    kind = config.residual_ffn
    variant = getattr(config, "ffn_variant", None)
    if kind == "swiglu":
        plan.update({"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
                     "layers.*.mlp.down_proj": "rowwise"})
    elif kind == "kvffn" and variant != "densenet":  # DenseNet's out_proj also reads the replicated input: kept whole
        if variant == "relu":
            plan["layers.*.mlp.key_proj"] = "colwise"
        else:  # its rows interleave keys and values: a contiguous share of them is a share of the hidden units
            plan["layers.*.mlp.key_value_proj"] = "colwise"
        plan["layers.*.mlp.out_proj"] = "rowwise"
    elif kind == "flash_mhf" and variant != "pkv":  # PKV's softmax over all slots does not split: kept whole
        plan["layers.*.mlp"] = PARTIAL_SUM_STYLE
        plan["layers.*.mlp.key_up_value"] = "colwise"  # key, up and value split alike, each by its columns d_e
    if config.token_memory_size is not None:
        plan.update({"memory": PARTIAL_SUM_STYLE, "memory.gate_proj": "colwise", "memory.up_proj": "colwise",
                     "memory.down_proj": "rowwise"})
    return plan


def pipeline_parallel_plan(config) -> dict[str, tuple[list[str], list[str]]]:
    """`base_model_pp_plan`: the base model's children in pipeline order, with the inputs and outputs each needs.
    With FFNs on X0 every stage needs the token embeddings besides the hidden states."""
    plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"])}
    layer_inputs = ["hidden_states", "attention_mask"]
    if config.token_memory_size is not None:
        plan["memory"] = (["inputs_embeds"], ["memory_outputs"])
        layer_inputs = ["hidden_states", "attention_mask", "inputs_embeds"]
    plan["layers"] = (layer_inputs, ["hidden_states"])
    plan["norm"] = (["hidden_states"], ["hidden_states"])
    return plan


# FFN head widths the FlashMHF Triton kernels take (`flash_mhf_op.SUPPORTED_HEAD_DIMS`, which only FlashMHFLlama
# checkpoints carry)
TRITON_FFN_HEAD_DIMS = (64, 128, 256)
DECODER_KERNELS = ("auto", "triton", "torch")  # decoder's norms and rotations, KV-FFN's activation (*_triton.py)
ROPE_PARAMETERS_REQUIREMENT = "must be None or a dict such as {'rope_type': 'linear', 'factor': 2.0}"
ROPE_FIELDS = ("rope_parameters", "rope_scaling")  # (transformers' RoPE dict, and its older name)


def _copy_rope_dicts(fields: dict) -> None:
    """Replaces the RoPE dicts of `fields` (keyword arguments) by copies: transformers standardizes the `rope_scaling`
    it is given in place, adding this config's `rope_theta` to the caller's dict, so one dict given to two configs
    (the checkpoints of several thetas) carried the first one's theta into the second."""
    for field in ROPE_FIELDS:
        if isinstance(fields.get(field), dict):
            fields[field] = dict(fields[field])


def _refuse_per_layer_rope(config_name: str, field: str, value) -> None:
    """Per-layer RoPE (one dict per layer type, as `{"full_attention": {...}}`) is refused: the rotary embedding reads
    the top level only, so the nested types and their scaling would go unused."""
    nested = sorted(key for key, item in (value or {}).items() if isinstance(item, dict))
    _check(config_name, not nested, field, value,
           f"per-layer RoPE (the nested {', '.join(map(repr, nested))}) is not supported: every layer shares one "
           "rotary embedding; give one dict such as {'rope_type': 'linear', 'factor': 2.0}")


class MemFFNConfig(PreTrainedConfig):
    """Fields shared by every architecture of this package (the Llama decoder's fields).

    Subclasses set `residual_ffn` (the FFN reading the residual stream: "swiglu", "flash_mhf", "pkv", "kvffn" or
    None; the architecture's model class names the block of each),
    `token_memory_size` (width of the per-layer FFNs reading the token embeddings X0, or None) and
    `parallel_residual_ffn` (the residual FFN reads the layer input X_L in parallel with attention instead of
    X_L + Attn(X_L)).

    `decoder_kernels` chooses how the decoder's RMSNorms and rotary embeddings (and KV-FFN's activation between its
    projections) run: "auto" (one fused Triton kernel each, forward and backward, on CUDA in eager mode; the PyTorch
    operations on CPU, for float64 tensors and while torch.compile traces, which fuses them itself, except KV-FFN's
    activation, whose kernels a compiled graph on CUDA launches as Triton operators), "triton" (the kernels, or an
    error where they cannot run) or "torch" (the PyTorch operations, as transformers' Llama). The paths compute the
    same maths; the kernels compute in float32 and round once per output.

    A key that is no field of the architecture but a field of another one of this package (`ffn_kernel` on KVFFN), or
    close to one of its own (`ffn_num_head`), is refused, naming the fields meant; transformers' own keys and other
    unknown keys are kept, as transformers keeps them.
    """

    model_type = "memffn"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the cache field before and since transformers 5.24
    # Class prefix and modeling file (without .py) named in `auto_map`; set by subclasses.
    class_prefix = ""
    modeling_module = ""

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 1024,
        intermediate_size: int = 2816,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 16,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        max_position_embeddings: int = 4096,
        rms_norm_eps: float = 1e-5,
        rope_theta: float = 10000.0,
        rope_parameters: dict | None = None,
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        hidden_act: str = "silu",
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        decoder_kernels: str = "auto",
        **kwargs,
    ):
        if type(self) is MemFFNConfig:
            refuse_the_base_class(type(self).__name__)
        # (a config.json's `model_type`, passed back by `from_dict`: the class's own stands, see below)
        self.refuse_another_architectures_model_type(kwargs.pop("model_type", None))
        derived = self._pop_derived_fields(kwargs)
        _copy_rope_dicts(kwargs)
        self.vocab_size = vocab_size
        self.decoder_kernels = decoder_kernels
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        given_head_dim = head_dim
        if head_dim is None and _is_int(hidden_size) and _is_int(num_attention_heads) and num_attention_heads > 0:
            # (as Llama's config: heads of hidden_size // num_attention_heads rounded down would make an attention
            # narrower than the hidden states; invalid sizes are reported by `validate_fields`)
            _check(type(self).__name__, hidden_size <= 0 or hidden_size % num_attention_heads == 0,
                   "num_attention_heads", num_attention_heads, f"must divide hidden_size={hidden_size} (head_dim = "
                   "hidden_size // num_attention_heads); give `head_dim` for heads of another width")
            head_dim = hidden_size // num_attention_heads
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
        # transformers' RoPE fields: `rope_parameters` (or the older `rope_scaling`, passed through kwargs) is
        # standardized by PreTrainedConfig.__init__ into {"rope_type", "rope_theta", <the type's fields>}.
        for field, value in (("rope_parameters", rope_parameters), ("rope_scaling", kwargs.get("rope_scaling"))):
            _check(type(self).__name__, value is None or isinstance(value, dict), field, value,
                   ROPE_PARAMETERS_REQUIREMENT)
            # (before transformers reads it: 5.17's RoPE check fails on a per-layer dict beside `rope_theta`)
            _refuse_per_layer_rope(type(self).__name__, field, value)
        self.rope_parameters = dict(rope_parameters) if rope_parameters is not None else None
        self.initializer_range = initializer_range
        self.hidden_act = hidden_act
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        if self.class_prefix:
            # The package's classes always point at its current files (a config.json written by an older version
            # may name another modeling file).
            kwargs["auto_map"] = {**(kwargs.get("auto_map") or {}), **self.default_auto_map()}
        _check_positive_ints(self, ("vocab_size",))  # (transformers compares the token ids with it first)
        # (a `head_dim` derived from invalid sizes is left to `validate_fields`, which names those sizes first)
        _check_base_fields(type(self).__name__, {
            **{field: kwargs[field] for field in BASE_FIELDS if field in kwargs}, "head_dim": given_head_dim})
        try:
            super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        except KeyError as exc:  # transformers' RoPE validation names a missing field with a KeyError
            raise ValueError(f"{type(self).__name__}: `rope_parameters`={self.rope_parameters!r} is invalid: {exc}") from exc
        except Exception as exc:  # huggingface_hub 2's strict-dataclass validators (not a ValueError): one line
            if not type(exc).__name__.startswith("StrictDataclass"):
                raise
            reason = str(exc).strip().splitlines()[-1].strip()
            raise ValueError(f"{type(self).__name__}: invalid configuration: {reason}") from exc
        self._standardize_rope()
        # transformers reads the parallel plans from the config (they are not saved in config.json)
        self.base_model_tp_plan = tensor_parallel_plan(self)
        self.base_model_pp_plan = pipeline_parallel_plan(self)
        self.validate_fields()
        self._check_derived_fields(derived)

    def __init_subclass__(cls, **kwargs):
        # transformers makes every config class a dataclass, and gives one without an `__init__` of its own the
        # dataclass's, which sets the given fields and skips the inherited `__init__` (defaults, checks, `auto_map`):
        # a subclass that only sets class attributes (a user's `model_type`) gets one calling its base class's
        if "__init__" not in cls.__dict__:
            def __init__(self, **fields):
                super(cls, self).__init__(**fields)

            __init__.__qualname__ = f"{cls.__qualname__}.__init__"
            cls.__init__ = __init__
        super().__init_subclass__(**kwargs)

    @classmethod
    def _pop_derived_fields(cls, fields: dict) -> dict:
        """The fields of `fields` that the config derives from others (`ffn_head_dim`, `subnetwork_size`, ...:
        properties without a setter) or that its class fixes (`WIRING_FIELDS`), taken out of it."""
        derived = [key for key in fields if key in cls.WIRING_FIELDS
                   or (isinstance(getattr(cls, key, None), property) and getattr(cls, key).fset is None)]
        return {key: fields.pop(key) for key in derived}

    def _check_derived_fields(self, given: dict) -> None:
        """Derived fields given with the others are accepted where they equal what the config derives, and refused,
        naming the field, where they do not (transformers would fail to set them, after logging the whole config).
        So are the fields of the decoder's wiring, which the architecture's class fixes."""
        for key, value in given.items():
            derived = getattr(self, key)
            if isinstance(getattr(type(self), key, None), property):
                requirement = (f"it is derived from the config's other fields (here {derived!r}) and cannot be set; "
                               "leave it out or change the fields it is derived from")
            else:
                requirement = self._wiring_requirement(derived)
            _check(type(self).__name__, value == derived, key, value, requirement)

    def _wiring_requirement(self, fixed) -> str:
        return (f"it is the wiring of {type(self).__name__}'s decoder (here {fixed!r}), fixed by the architecture, "
                "and cannot be set; leave it out (the FFN is chosen by the architecture, and by `ffn_variant` where "
                "it has one)")

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """`PreTrainedConfig.from_dict`. Fields given as keyword arguments (`from_pretrained(path, ffn_kernel=...)`)
        are set after the config is built, past `__init__`'s checks: check them too, and rebuild the parallel plans,
        which depend on the FFN's fields."""
        cls.refuse_another_architectures_model_type(config_dict.get("model_type"))  # (before any field is read)
        config_dict = cls._from_earlier_versions(config_dict)
        derived = cls._pop_derived_fields(kwargs)
        _copy_rope_dicts(kwargs)
        for field, value in kwargs.items():  # (transformers sets the known ones and returns or drops the others)
            requirement = unknown_field_requirement(cls, field)
            _check(cls.__name__, requirement is None, field, value, requirement)
        for field in ROPE_FIELDS:  # (read below as a dict)
            value = kwargs.get(field)
            _check(cls.__name__, value is None or isinstance(value, dict), field, value, ROPE_PARAMETERS_REQUIREMENT)
        _check_base_fields(cls.__name__, {field: kwargs[field] for field in BASE_FIELDS if field in kwargs})
        for field in ("ffn_kernel", "ffn_gate_eps", *UNREAD_FIELD_DEFAULTS):
            if field in kwargs and field in config_dict:
                # (into the fields `__init__` checks: a file's "triton" for FFN shapes the kernels never take, its
                # `ffn_gate_eps` of 0, or a field its FFN does not read set to another value than the default, is
                # refused there, and `ffn_kernel="torch"`, `ffn_gate_eps=1e-6` or the default given here is what
                # loads it)
                config_dict = {**config_dict, field: kwargs[field]}
        result = super().from_dict(config_dict, **kwargs)
        config = result[0] if isinstance(result, tuple) else result
        config._check_derived_fields(derived)
        if "rope_parameters" in kwargs or "rope_scaling" in kwargs:
            if "rope_scaling" in kwargs:
                config.rope_parameters = kwargs["rope_scaling"]
            config._standardize_rope()
        config.base_model_tp_plan = tensor_parallel_plan(config)
        config.base_model_pp_plan = pipeline_parallel_plan(config)
        config.validate_fields()
        return result

    @classmethod
    def refuse_another_architectures_model_type(cls, model_type: str | None) -> None:
        """A ValueError for the `model_type` of a config.json (or `to_dict`) of another of this package's
        architectures, naming its config class: read as this class, its fields would build a model of other weights
        (MemoryLLM's config read as FlexMemoryLLM's builds an FFN-C that starts at random), where transformers only
        warns. Any other model type (a Llama's, whose decoder these models share) is read as this class's own: the
        config keeps `type(self).model_type`, which its checkpoint conversions and model card follow."""
        owner = next((config_class for config_class in CONFIG_CLASSES if config_class.model_type == model_type), None)
        if owner is None or any(getattr(base, "model_type", None) == model_type for base in cls.__mro__):
            return
        _check(cls.__name__, False, "model_type", model_type,
               f"it is {owner.__name__}'s, another architecture; load it with {owner.__name__} (its models with "
               f"{owner.class_prefix}ForCausalLM and the other {owner.class_prefix} classes), or with the Auto "
               "classes, which pick the class of its model type")

    @classmethod
    def _from_earlier_versions(cls, config_dict: dict) -> dict:
        """The fields of a config.json written by an earlier version of the package, as this version reads them
        (the same model; what a file can hold that this version would refuse although the model did not read it)."""
        return config_dict

    def __setattr__(self, name, value):
        # a RoPE dict set on the config once `rope_theta` is (`config.rope_parameters = {...}`) reads as one given to
        # `__init__`: the rotary embedding reads its type and theta, which a dict without them, with the older key
        # `type`, or None lacked (a KeyError or TypeError while the model was built)
        standardized = (name == "rope_parameters" and (value is None or isinstance(value, dict))
                        and "rope_theta" in self.__dict__)
        if standardized:
            value = self._standardized_rope(value)
        super().__setattr__(name, value)
        # `rope_theta` mirrors `rope_parameters["rope_theta"]`, which the rotary embedding reads: a new theta
        # (`config.rope_theta = ...`, `from_pretrained(path, rope_theta=...)`) goes into it, and the theta of a new
        # `rope_parameters` into `rope_theta`
        if name == "rope_theta":
            params = self.__dict__.get("rope_parameters")
            if isinstance(params, dict) and params.get("rope_theta") != value:
                self.rope_parameters = {**params, "rope_theta": value}
        elif standardized and self.__dict__["rope_theta"] != value["rope_theta"]:
            super().__setattr__("rope_theta", value["rope_theta"])

    def _standardized_rope(self, rope_parameters: dict | None) -> dict:
        """A copy of `rope_parameters` with the type and theta the rotary embedding reads (`rope_theta` where it has
        none) and the pretraining length of the types that scale from it."""
        params = dict(rope_parameters or {})
        # (the older key `type` where `rope_type` is not given, as transformers reads them: `rope_type` first)
        legacy_type = params.pop("type", None)
        params["rope_type"] = params.get("rope_type") or legacy_type or "default"
        params.setdefault("rope_theta", self.rope_theta)
        if params["rope_type"] in ("llama3", "yarn", "longrope"):
            params.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        return params

    def _standardize_rope(self) -> None:
        """One source of truth for RoPE: `rope_parameters` carries the type and theta, `rope_theta` mirrors it."""
        params = self._standardized_rope(self.rope_parameters)
        self.rope_parameters = params
        self.rope_theta = params["rope_theta"]

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """`PreTrainedConfig.save_pretrained`, plus the modeling code that `auto_map` names (the architecture's
        modeling file and the siblings it imports, as `model.save_pretrained` copies them) where this process has
        it beside this file: a folder of the config alone then builds the model where the package is absent
        (`AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder, trust_remote_code=True),
        trust_remote_code=True)`), instead of naming modeling files it lacks. (With `push_to_hub=True` the upload
        happens inside transformers' save, before the code is copied: `config.push_to_hub(repo_id)` uploads it.)
        Refused, before anything is written, while a field would not load back (`from_pretrained` checks the fields
        that `__init__` checks: a field set by hand since, a special token id past a shrunk vocabulary)."""
        self.refuse_what_would_not_load(saved_alone=True)
        result = super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        modeling_file = self._modeling_code_file()
        if modeling_file is not None:
            from transformers.dynamic_module_utils import get_relative_import_files

            for source in (modeling_file, *get_relative_import_files(modeling_file)):
                target = os.path.join(save_directory, os.path.basename(source))
                if os.path.abspath(source) != os.path.abspath(target):
                    partial = f"{target}.{os.getpid()}.partial"  # (one a process: two may save into one folder)
                    try:
                        shutil.copyfile(source, partial)
                        os.replace(partial, target)  # (a file is complete or absent)
                    except BaseException:  # (a copy cut short leaves nothing half written beside it)
                        if os.path.exists(partial):
                            os.remove(partial)
                        raise
        return result

    def _modeling_code_file(self) -> str | None:
        """The file of the modeling module `auto_map` names, a sibling of this config's module (the package's, or
        the copy transformers fetched with it); None where that module is absent."""
        package = type(self).__module__.rpartition(".")[0]
        if not (self.class_prefix and self.modeling_module and package):
            return None
        name = f"{package}.{self.modeling_module}"
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            return None
        return getattr(module, "__file__", None)

    @classmethod
    def default_auto_map(cls) -> dict[str, str]:
        prefix, modeling = cls.class_prefix, cls.modeling_module
        return {
            "AutoConfig": f"configuration_memffn.{prefix}Config",
            "AutoModel": f"{modeling}.{prefix}Model",
            "AutoModelForCausalLM": f"{modeling}.{prefix}ForCausalLM",
            "AutoModelForSequenceClassification": f"{modeling}.{prefix}ForSequenceClassification",
            "AutoModelForTokenClassification": f"{modeling}.{prefix}ForTokenClassification",
            "AutoModelForQuestionAnswering": f"{modeling}.{prefix}ForQuestionAnswering",
        }

    # -- wiring of the decoder (overridden by subclasses) --------------------------------------------------------
    residual_ffn = "swiglu"
    parallel_residual_ffn = False
    # Set by each architecture's class, not by config fields: refused as fields (`_check_derived_fields`) unless equal
    WIRING_FIELDS = ("residual_ffn", "parallel_residual_ffn")

    @property
    def residual_ffn_size(self) -> int:
        """Width of the FFN on the residual stream."""
        return self.intermediate_size

    @property
    def token_memory_size(self) -> int | None:
        """Width of each layer's FFN on the token embeddings X0 (None: the architecture has none)."""
        return None

    # -- validation ----------------------------------------------------------------------------------------------
    def refuse_what_would_not_load(self, saved_alone: bool = False) -> None:
        """`validate_fields` as `save_pretrained` says it: a field set by hand since `__init__` checked it (or a
        special token id past a vocabulary that `resize_token_embeddings` shrank) would make the saved folder fail to
        load, since `from_pretrained` checks the same fields. `saved_alone` (the config's own save) adds `dtype`,
        which a model's save replaces by the dtype of its weights before it writes the config."""
        try:
            self.validate_fields()
            if saved_alone:
                _check_base_fields(type(self).__name__, {"dtype": getattr(self, "dtype", None)})
        except ValueError as error:
            raise ValueError(f"save_pretrained: the config would not load back from the folder: {error} Set the field "
                             "to an allowed value before saving") from error

    def validate_fields(self) -> None:
        name = type(self).__name__
        _refuse_unknown_fields(self)
        for field in self.WIRING_FIELDS:  # (set by hand on the config: `config.parallel_residual_ffn = True`)
            fixed = getattr(type(self), field)
            _check(name, vars(self).get(field, fixed) == fixed, field, vars(self).get(field),
                   self._wiring_requirement(fixed))
        _check_positive_ints(self, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                    "head_dim", "intermediate_size", "num_key_value_heads", "max_position_embeddings"))
        _check_number(self, "rms_norm_eps", 0.0, low_inclusive=False)
        _check_number(self, "rope_theta", 0.0, low_inclusive=False)
        _check_number(self, "initializer_range", 0.0, low_inclusive=True)
        _check_number(self, "attention_dropout", 0.0, low_inclusive=True, high=1.0)
        check_choice("hidden_act", self.hidden_act, HIDDEN_ACTIVATIONS, name)
        check_choice("decoder_kernels", self.decoder_kernels, DECODER_KERNELS, name)
        _check_bools(self, ("attention_bias", "tie_word_embeddings", "use_cache"))
        # (transformers' flag, read by every forward: another type failed there, in transformers' output collection)
        value = getattr(self, "output_hidden_states", None)
        _check(name, value is None or isinstance(value, bool), "output_hidden_states", value,
               OUTPUT_HIDDEN_STATES_REQUIREMENT)
        # (Llama's field: a Llama config's MLP biases would be dropped by the FFNs here, which have none or their own)
        _check(name, not getattr(self, "mlp_bias", False), "mlp_bias", getattr(self, "mlp_bias", False),
               "must be False: the FFNs take no MLP biases (KV-FFN's biases are `kvffn_bias`)")
        # the token classifier's fields, which transformers' Llama reads too (a dropout of None: the next one, or 0.1)
        for field in ("classifier_dropout", "hidden_dropout"):
            if getattr(self, field, None) is not None:
                _check_number(self, field, 0.0, low_inclusive=True, high=1.0)
        _check(name, isinstance(getattr(self, "token_classification_bias", True), bool), "token_classification_bias",
               getattr(self, "token_classification_bias", True), "must be True or False (the token classifier's bias)")
        # the classification heads' fields: transformers takes any value, and the head then has no output (0 labels)
        # or the loss fails at the first labelled batch (an unknown problem type)
        num_labels = getattr(self, "num_labels", None)  # (None where `id2label` is unset)
        _check(name, num_labels is None or num_labels >= 1, "num_labels", num_labels, "must be >= 1 (the outputs of "
               "the classification heads; `id2label` has one entry per label)")
        check_choice("problem_type", getattr(self, "problem_type", None), PROBLEM_TYPES, name)
        for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(self, field)
            ids = value if field == "eos_token_id" and isinstance(value, (list, tuple)) else [value]
            _check(name, all(i is None or (_is_int(i) and 0 <= i < self.vocab_size) for i in ids), field, value,
                   f"token ids must be None or in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size})"
                   + ("; a list of them for eos_token_id only" if field != "eos_token_id" else ""))
        _check(
            name,
            self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"must divide num_attention_heads={self.num_attention_heads}",
        )
        _check(name, self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (rotary embeddings)")
        # (a dict by `__init__`; set on the config since, another value failed inside the checks below)
        _check(name, isinstance(self.rope_parameters, dict), "rope_parameters", self.rope_parameters,
               ROPE_PARAMETERS_REQUIREMENT)
        # per-layer RoPE (one dict per layer type, as `{"full_attention": {...}}`): the rotary embedding reads the top
        # level only, so the nested types and their scaling would go unused
        _refuse_per_layer_rope(name, "rope_parameters", self.rope_parameters)
        check_choice("rope_parameters['rope_type']", self.rope_parameters["rope_type"], ROPE_TYPES, name)
        validate_rope = getattr(self, "validate_rope", None)  # transformers' per-type check of the RoPE fields
        if validate_rope is not None:
            try:
                validate_rope()
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{name}: `rope_parameters`={self.rope_parameters!r} is invalid: {exc}") from exc
        # transformers only logs a warning for a scaling factor below 1; 0 gives infinite frequencies, negative ones
        # reversed rotations
        factor = self.rope_parameters.get("factor")
        _check(name, factor is None or (_is_number(factor) and math.isfinite(factor) and factor >= 1),
               "rope_parameters['factor']", factor, "a finite number >= 1 (the context's scaling)")
        # the rotations cover every dimension of a head: a partial factor would go unused ("default") or give
        # frequency tables narrower than the heads (the scaled types)
        partial = self.rope_parameters.get("partial_rotary_factor", 1.0)
        _check(name, partial == 1.0, "rope_parameters['partial_rotary_factor']", partial,
               "must be 1.0: the decoder rotates all head_dim dimensions of each head")
        if self.rope_parameters["rope_type"] == "longrope":  # (transformers only logs a warning for a wrong length)
            for key in ("short_factor", "long_factor"):
                factors = self.rope_parameters.get(key)
                _check(name, isinstance(factors, (list, tuple)) and len(factors) == self.head_dim // 2,
                       f"rope_parameters['{key}']", factors,
                       f"must be a list of head_dim // 2 = {self.head_dim // 2} numbers, one per frequency")
        # transformers' caches read these fields: a sliding-window or chunked cache keeps only the last tokens' keys,
        # which this decoder's full causal attention still reads (decoding with the cache would drift from a forward)
        for field in ("sliding_window", "attention_chunk_size"):
            value = getattr(self, field, None)
            _check(name, value is None, field, value,
                   "must be None: the decoder's attention is full causal (every token attends to all earlier ones)")
        layer_types = getattr(self, "layer_types", None)
        _check(name, layer_types is None or all(kind == "full_attention" for kind in layer_types), "layer_types",
               layer_types, "must be None or 'full_attention' for every layer: the decoder's attention is full causal")
        # (transformers checks the count when a config is built, and again when it is saved: a model loaded with
        # another `num_hidden_layers`, or given one by hand, failed in its save_pretrained, the weights unwritten)
        _check(name, layer_types is None or len(layer_types) == self.num_hidden_layers, "layer_types", layer_types,
               f"must be None or have one entry per layer (num_hidden_layers={self.num_hidden_layers}); a checkpoint "
               "loaded with another `num_hidden_layers` takes `layer_types=None` with it")
        _check(name, 0.0 <= self.attention_dropout < 1.0, "attention_dropout", self.attention_dropout, "in [0, 1)")


class FlashMHFLlamaConfig(MemFFNConfig):
    """Llama decoder whose FFN is a Flash Multi-Head FFN (flash-mhf.md eq. 10-14).

    Per head h (of `ffn_num_heads`, width `ffn_head_dim = hidden_size // ffn_num_heads`) the FFN runs
    `ffn_num_subnetworks` (E) SwiGLU sub-networks of width `subnetwork_size = intermediate_size // E` on the head's
    query, mixed by sigmoid gates normalized over E. `intermediate_size` is each head's total width.

    `ffn_variant` selects the paper's baselines: "swiglu" (plain Llama MLP), "mh_ffn" (naive multi-head FFN: one
    sub-network per head, no gates), "dense_moe" (a single head: d_h = hidden_size), "pkv" (per-head softmax
    attention over `intermediate_size` learned key/value slots; every head has its own, so it ignores
    `ffn_num_kv_heads`, and it keeps its activations whatever `ffn_recompute_chunk_tokens`). `ffn_num_heads` defaults
    to 16 (1 for dense_moe), `ffn_num_subnetworks` to 8 (1 for mh_ffn). `hidden_act` applies to the "swiglu"
    variant only: the sub-networks are SwiGLU (SiLU) as in the paper, and the other variants refuse any other value.

    `ffn_kernel` chooses how the fused op runs: "auto" (Triton on CUDA, the memory-bounded PyTorch reference on CPU),
    "triton" or "torch" (forced; "triton" is refused here for FFN heads or sub-networks the kernels never take).
    `ffn_recompute_chunk_tokens` > 0 makes the FFN keep only its input for the backward pass and recompute its
    activations in chunks of that many tokens (backward memory independent of batch and sequence length, for one
    extra forward of the FFN); 0 keeps the activations. In training mode the FFN runs in those chunks also without
    gradients (the first forward of reentrant activation checkpointing), so that it draws the random numbers of its
    recompute. Under torch.compile the recompute runs between the graphs, one graph break per layer (`fullgraph=True`
    refuses it).
    """

    model_type = "memffn_flash_mhf"
    class_prefix = "FlashMHFLlama"
    modeling_module = "modeling_flash_mhf"
    variants = ("flash_mhf", "swiglu", "mh_ffn", "dense_moe", "pkv")
    kernels = ("auto", "triton", "torch")

    def __init__(
        self,
        ffn_variant: str = "flash_mhf",
        ffn_num_heads: int | None = None,
        ffn_num_subnetworks: int | None = None,
        ffn_num_kv_heads: int | None = None,
        ffn_query_norm: bool = True,
        ffn_io_projections: bool = True,
        ffn_gate_eps: float = 1e-6,
        ffn_kernel: str = "auto",
        ffn_recompute_chunk_tokens: int = 0,
        **kwargs,
    ):
        check_choice("ffn_variant", ffn_variant, self.variants, type(self).__name__)
        self.ffn_variant = ffn_variant
        if ffn_num_heads is None:
            ffn_num_heads = 1 if ffn_variant == "dense_moe" else 16
        if ffn_num_subnetworks is None:
            ffn_num_subnetworks = 1 if ffn_variant == "mh_ffn" else 8
        self.ffn_num_heads = ffn_num_heads
        self.ffn_num_subnetworks = ffn_num_subnetworks
        self.ffn_num_kv_heads = ffn_num_heads if ffn_num_kv_heads is None else ffn_num_kv_heads
        self.ffn_query_norm = ffn_query_norm
        self.ffn_io_projections = ffn_io_projections
        self.ffn_gate_eps = ffn_gate_eps
        self.ffn_kernel = ffn_kernel
        self.ffn_recompute_chunk_tokens = ffn_recompute_chunk_tokens
        super().__init__(**kwargs)

    @property
    def residual_ffn(self) -> str:
        return self.ffn_variant if self.ffn_variant in ("swiglu", "pkv") else "flash_mhf"

    @property
    def ffn_head_dim(self) -> int:
        return self.hidden_size // self.ffn_num_heads

    @property
    def subnetwork_size(self) -> int:
        return self.intermediate_size // self.ffn_num_subnetworks

    def validate_fields(self) -> None:
        super().validate_fields()
        name = type(self).__name__
        check_choice("ffn_variant", self.ffn_variant, self.variants, name)
        check_choice("ffn_kernel", self.ffn_kernel, self.kernels, name)
        _check(name, _is_int(self.ffn_recompute_chunk_tokens) and self.ffn_recompute_chunk_tokens >= 0,
               "ffn_recompute_chunk_tokens", self.ffn_recompute_chunk_tokens, "must be an integer >= 0")
        _check_bools(self, ("ffn_query_norm", "ffn_io_projections"))
        # (> 0: the gates divide by sum_E sigmoid + ffn_gate_eps, and the sigmoids of scores below about -88 are 0 in
        # float32, so a token whose scores all fall there would get 0 / 0 = NaN gates)
        _check_number(self, "ffn_gate_eps", 0.0, low_inclusive=False,
                      hint="a saved config.json of 0 loads with `from_pretrained(path, ffn_gate_eps=1e-6)`")
        _check_positive_ints(self, ("ffn_num_heads", "ffn_num_subnetworks", "ffn_num_kv_heads"))
        if self.ffn_variant == "swiglu":
            return
        _refuse_unread(self, "hidden_act", UNREAD_FIELD_DEFAULTS["hidden_act"],
                       f"ffn_variant={self.ffn_variant!r} does not read it (FlashMHF's sub-networks are SwiGLU, with "
                       "SiLU, as in the paper; PKV's heads take a softmax); it applies to ffn_variant='swiglu' only")
        _check(
            name,
            self.hidden_size % self.ffn_num_heads == 0,
            "ffn_num_heads",
            self.ffn_num_heads,
            f"must divide hidden_size={self.hidden_size}",
        )
        if self.ffn_variant == "pkv":  # (every head has its own slots: `ffn_num_kv_heads` is not read)
            return
        _check(
            name,
            self.ffn_num_heads % self.ffn_num_kv_heads == 0,
            "ffn_num_kv_heads",
            self.ffn_num_kv_heads,
            f"must divide ffn_num_heads={self.ffn_num_heads}",
        )
        _check(
            name,
            self.intermediate_size % self.ffn_num_subnetworks == 0,
            "ffn_num_subnetworks",
            self.ffn_num_subnetworks,
            f"must divide intermediate_size={self.intermediate_size}",
        )
        if self.ffn_variant == "mh_ffn":
            _check(name, self.ffn_num_subnetworks == 1, "ffn_num_subnetworks", self.ffn_num_subnetworks,
                   "must be 1 for ffn_variant='mh_ffn' (one sub-network per head)")
        if self.ffn_variant == "dense_moe":
            _check(name, self.ffn_num_heads == 1, "ffn_num_heads", self.ffn_num_heads,
                   "must be 1 for ffn_variant='dense_moe' (a single head)")
        if self.ffn_kernel == "triton":  # (shapes the kernels never take: refused here, not at the first forward)
            _check(name, self.ffn_head_dim in TRITON_FFN_HEAD_DIMS, "ffn_kernel", self.ffn_kernel,
                   f"the Triton kernels take FFN heads of {', '.join(map(str, TRITON_FFN_HEAD_DIMS))} "
                   f"(ffn_head_dim = hidden_size // ffn_num_heads = {self.hidden_size} // {self.ffn_num_heads} = "
                   f"{self.ffn_head_dim}); change ffn_num_heads, or set ffn_kernel='torch' (the PyTorch reference)")
            _check(name, self.subnetwork_size % 16 == 0, "ffn_kernel", self.ffn_kernel,
                   f"the Triton kernels take sub-networks of a multiple of 16 (subnetwork_size = intermediate_size "
                   f"// ffn_num_subnetworks = {self.intermediate_size} // {self.ffn_num_subnetworks} = "
                   f"{self.subnetwork_size}); change intermediate_size or ffn_num_subnetworks, or set "
                   "ffn_kernel='torch' (the PyTorch reference)")


class MemoryLLMConfig(MemFFNConfig):
    """MemoryLLM (memoryllm.md): every layer's FFN reads the token embeddings X0,
    `X_{L+1} = X_L + Attn(X_L) + FFN_L(X0)`. `intermediate_size` is the width of each layer's FFN."""

    model_type = "memffn_memoryllm"
    class_prefix = "MemoryLLM"
    modeling_module = "modeling_memoryllm"
    residual_ffn = None

    def __init__(self, **kwargs):  # an explicit __init__ keeps the shared one (transformers wraps classes without)
        super().__init__(**kwargs)

    @property
    def token_memory_size(self) -> int:
        return self.intermediate_size


class FlexMemoryLLMConfig(MemFFNConfig):
    """Flex-MemoryLLM: `X_{L+1} = X_L + Attn(X_L) + FFN-C_L(X_L) + FFN-M_L(X0)`.

    FFN-C (width `intermediate_size`) reads the layer input X_L in parallel with attention, as the equation says;
    FFN-M (width `memory_intermediate_size`, default `intermediate_size`) reads the token embeddings X0.
    """

    model_type = "memffn_flex_memoryllm"
    class_prefix = "FlexMemoryLLM"
    modeling_module = "modeling_memoryllm"
    residual_ffn = "swiglu"
    parallel_residual_ffn = True

    def __init__(self, memory_intermediate_size: int | None = None, **kwargs):
        self.memory_intermediate_size = memory_intermediate_size
        super().__init__(**kwargs)
        if self.memory_intermediate_size is None:
            self.memory_intermediate_size = self.intermediate_size

    @property
    def token_memory_size(self) -> int:
        return self.memory_intermediate_size or self.intermediate_size

    def validate_fields(self) -> None:
        super().validate_fields()
        value = self.memory_intermediate_size
        _check(type(self).__name__, value is None or (_is_int(value) and value > 0),
               "memory_intermediate_size", value, "must be a positive integer")


class KVFFNConfig(MemFFNConfig):
    """Llama decoder whose FFN is the KV-FFN block (kv-ffn.md eq. 1-3):
    `y = W_o(act(W_k x + b_k) * (W_v x + b_v)) + b_o + x`.

    The `+ x` of eq. 3 is the residual connection around the FFN sub-layer: the paper says it "preserves gradient
    flow through residual connection". In this pre-norm decoder the layer already computes
    `h + FFN(RMSNorm(h))`, so that residual is the decoder's, and by default (`kvffn_inner_residual=False`) the
    block itself returns `W_o(k * v) + b_o`: the layer output is exactly eq. 3 with `x` the residual stream.
    `kvffn_inner_residual=True` adds the block's (normalised) input once more, `h + RMSNorm(h) + W_o(k * v) + b_o`:
    a second copy of the stream at every layer that the paper does not describe (at initialisation it makes the
    residual stream of a 12-layer, 768-wide model enter its last layer at an RMS of 12.8 instead of 4.0); it is kept
    as an ablation.

    Ablations: `kvffn_activation` (silu/gelu/relu), `kvffn_composition` ("product" or "sum" of key and value),
    `kvffn_bias`, `kvffn_inner_residual`, `kvffn_init` (std of the FFN weights:
    "inv_sqrt_d" = 1/sqrt(hidden_size), "inv_d" = 1/hidden_size, "inv_sqrt_h" = 1/sqrt(intermediate_size)).
    Baselines through `ffn_variant`: "relu" (W_o relu(W_k x + b_k) + b_o), "glu" (sigmoid-gated linear unit,
    W_o(sigmoid(W_k x + b_k) * (W_v x + b_v)) + b_o) and "densenet" (the output layer reads the hidden features
    concatenated with the block input: W_o [relu(W_k x + b_k); x] + b_o). The activation, composition and inner
    residual options apply to the "kvffn" variant (the baselines refuse values other than their defaults, as the
    block refuses `hidden_act` other than "silu": its activation is `kvffn_activation`); `kvffn_bias`, `kvffn_init`
    and `kvffn_dropout` (dropout on the block's output while training; kv-ffn.md trains with 0.1 on attention and
    FFN, i.e. with `attention_dropout=0.1`) to all four. With `kvffn_bias=False` the "kvffn" block is a SwiGLU FFN.
    """

    model_type = "memffn_kvffn"
    class_prefix = "KVFFN"
    modeling_module = "modeling_kvffn"
    residual_ffn = "kvffn"
    variants = ("kvffn", "relu", "glu", "densenet")
    activations = ("silu", "gelu", "relu")
    compositions = ("product", "sum")
    inits = ("inv_sqrt_d", "inv_d", "inv_sqrt_h")

    def __init__(
        self,
        ffn_variant: str = "kvffn",
        kvffn_activation: str = "silu",
        kvffn_composition: str = "product",
        kvffn_bias: bool = True,
        kvffn_inner_residual: bool = False,
        kvffn_init: str = "inv_sqrt_d",
        kvffn_dropout: float = 0.0,
        **kwargs,
    ):
        self.ffn_variant = ffn_variant
        self.kvffn_activation = kvffn_activation
        self.kvffn_composition = kvffn_composition
        self.kvffn_bias = kvffn_bias
        self.kvffn_inner_residual = kvffn_inner_residual
        self.kvffn_init = kvffn_init
        self.kvffn_dropout = kvffn_dropout
        super().__init__(**kwargs)

    @classmethod
    def _from_earlier_versions(cls, config_dict: dict) -> dict:
        # Until `kvffn_dropout` came (in the same change), `kvffn_inner_residual` defaulted to True and every file
        # held it, the baselines' too, which never read it: their checkpoints load with the default they keep now.
        if ("kvffn_dropout" not in config_dict and config_dict.get("kvffn_inner_residual") is True
                and config_dict.get("ffn_variant", "kvffn") != "kvffn"):
            return {**config_dict, "kvffn_inner_residual": False}
        return config_dict

    @property
    def kvffn_init_std(self) -> float:
        return {
            "inv_sqrt_d": self.hidden_size**-0.5,
            "inv_d": 1.0 / self.hidden_size,
            "inv_sqrt_h": self.intermediate_size**-0.5,
        }[self.kvffn_init]

    def validate_fields(self) -> None:
        super().validate_fields()
        name = type(self).__name__
        check_choice("ffn_variant", self.ffn_variant, self.variants, name)
        check_choice("kvffn_activation", self.kvffn_activation, self.activations, name)
        check_choice("kvffn_composition", self.kvffn_composition, self.compositions, name)
        check_choice("kvffn_init", self.kvffn_init, self.inits, name)
        _check_bools(self, ("kvffn_bias", "kvffn_inner_residual"))
        _refuse_unread(self, "hidden_act", UNREAD_FIELD_DEFAULTS["hidden_act"],
                       "KVFFN's block does not read it: its keys' activation is `kvffn_activation` "
                       f"({', '.join(map(repr, self.activations))})")
        if self.ffn_variant != "kvffn":  # (each baseline fixes its activation and composition: see the docstring)
            for field in ("kvffn_activation", "kvffn_composition", "kvffn_inner_residual"):
                _refuse_unread(self, field, UNREAD_FIELD_DEFAULTS[field],
                               f"ffn_variant={self.ffn_variant!r} does not read it; it applies to ffn_variant='kvffn' "
                               "only")
        _check(name, _is_number(self.kvffn_dropout) and 0.0 <= self.kvffn_dropout < 1.0,
               "kvffn_dropout", self.kvffn_dropout, "must be a number in [0, 1)")


CONFIG_CLASSES = (FlashMHFLlamaConfig, MemoryLLMConfig, FlexMemoryLLMConfig, KVFFNConfig)

# The model classes of each architecture, named `<class_prefix><kind>`
MODEL_CLASS_KINDS = ("Model", "ForCausalLM", "ForSequenceClassification", "ForTokenClassification",
                     "ForQuestionAnswering")


def refuse_the_base_class(class_name: str) -> None:
    """A ValueError for building one of the base classes the four architectures share (`MemFFNConfig`,
    `MemFFNForCausalLM`, ...), naming the classes of the same kind to build instead. Built, a base class would run,
    but its checkpoint would not load back: its config.json names no modeling code (`auto_map`), and its model
    type, `memffn`, is registered with no Auto class, while its model card says that `from_pretrained` loads it."""
    kind = class_name.removeprefix("MemFFN")
    if kind not in ("Config", *MODEL_CLASS_KINDS):  # (the models' shared bases: `MemFFNPreTrainedModel`, ...)
        kind = "ForCausalLM"
    choices = ", ".join(config_class.class_prefix + kind for config_class in CONFIG_CLASSES)
    raise ValueError(
        f"{class_name} is the base class that the four architectures share, not a model of its own: a checkpoint of it "
        f"would not load back (config.json names no modeling code and `memffn` is no registered model type). Build "
        f"one of the four architectures instead: {choices} (transformers' Auto classes build them from their configs; "
        "FlashMHFLlamaConfig(ffn_variant='swiglu') has the Llama decoder's FFN)")


__all__ = ["MemFFNConfig", "FlashMHFLlamaConfig", "MemoryLLMConfig", "FlexMemoryLLMConfig", "KVFFNConfig"]
