"""Configurations of the four FFN-as-memory architectures.

All four are Llama-style decoders and share the Llama field names; each adds the fields of its FFN. A config also
says how its decoder is wired (see `MemFFNConfig.residual_ffn` / `token_memory_size`), so the modeling code is written
once and reads the wiring from here.

This file is copied next to saved checkpoints for `trust_remote_code`: it imports only transformers.
"""

from __future__ import annotations

from transformers import PretrainedConfig

_AUTO_CLASSES = ("AutoConfig", "AutoModel", "AutoModelForCausalLM")


def _check_choice(config_name: str, field: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{config_name}: `{field}`={value!r} is not supported; allowed values: {list(allowed)}.")


def _check(config_name: str, condition: bool, field: str, value, requirement: str) -> None:
    if not condition:
        raise ValueError(f"{config_name}: `{field}`={value!r} is invalid: {requirement}.")


class MemFFNConfig(PretrainedConfig):
    """Fields shared by every architecture of this package (the Llama decoder's fields).

    Subclasses set `residual_ffn` (the FFN reading the residual stream: "flash_mhf", "swiglu", "kvffn" or None),
    `token_memory_size` (width of the per-layer FFNs reading the token embeddings X0, or None) and
    `parallel_residual_ffn` (the residual FFN reads the layer input X_L in parallel with attention instead of
    X_L + Attn(X_L)).
    """

    model_type = "memffn"
    keys_to_ignore_at_inference = ["past_key_values"]
    # Class prefix used in `auto_map`; set by subclasses.
    class_prefix = ""

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
        tie_word_embeddings: bool = False,
        initializer_range: float = 0.02,
        hidden_act: str = "silu",
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | list[int] | None = 2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_attention_heads if num_key_value_heads is None else num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads if head_dim is None else head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.rope_theta = rope_theta
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
            kwargs.setdefault("auto_map", self.default_auto_map())
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.validate_fields()

    @classmethod
    def default_auto_map(cls) -> dict[str, str]:
        prefix = cls.class_prefix
        return {
            "AutoConfig": f"configuration_memffn.{prefix}Config",
            "AutoModel": f"modeling_memffn.{prefix}Model",
            "AutoModelForCausalLM": f"modeling_memffn.{prefix}ForCausalLM",
        }

    # -- wiring of the decoder (overridden by subclasses) --------------------------------------------------------
    residual_ffn = "swiglu"
    parallel_residual_ffn = False

    @property
    def residual_ffn_size(self) -> int:
        """Width of the FFN on the residual stream."""
        return self.intermediate_size

    @property
    def token_memory_size(self) -> int | None:
        """Width of each layer's FFN on the token embeddings X0 (None: the architecture has none)."""
        return None

    # -- validation ----------------------------------------------------------------------------------------------
    def validate_fields(self) -> None:
        name = type(self).__name__
        for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            value = getattr(self, field)
            _check(name, isinstance(value, int) and value > 0, field, value, "must be a positive integer")
        _check(
            name,
            isinstance(self.intermediate_size, int) and self.intermediate_size > 0,
            "intermediate_size",
            self.intermediate_size,
            "must be a positive integer",
        )
        _check(
            name,
            self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
            "num_key_value_heads",
            self.num_key_value_heads,
            f"must divide num_attention_heads={self.num_attention_heads}",
        )
        _check(name, self.head_dim % 2 == 0, "head_dim", self.head_dim, "must be even (rotary embeddings)")
        _check(name, 0.0 <= self.attention_dropout < 1.0, "attention_dropout", self.attention_dropout, "in [0, 1)")


class FlashMHFLlamaConfig(MemFFNConfig):
    """Llama decoder whose FFN is a Flash Multi-Head FFN (flash-mhf.md eq. 10-14).

    Per head h (of `ffn_num_heads`, width `ffn_head_dim = hidden_size // ffn_num_heads`) the FFN runs
    `ffn_num_subnetworks` (E) SwiGLU sub-networks of width `subnetwork_size = intermediate_size // E` on the head's
    query, mixed by sigmoid gates normalized over E. `intermediate_size` is each head's total width.

    `ffn_variant` selects the paper's baselines: "swiglu" (plain Llama MLP), "mh_ffn" (naive multi-head FFN: one
    sub-network per head, no gates), "dense_moe" (a single head: d_h = hidden_size), "pkv" (per-head softmax
    attention over `intermediate_size` learned key/value slots). `ffn_num_heads` defaults to 16 (1 for dense_moe),
    `ffn_num_subnetworks` to 8 (1 for mh_ffn).

    `ffn_kernel` chooses how the fused op runs: "auto" (Triton on CUDA, the memory-bounded PyTorch reference on CPU),
    "triton" or "torch" (forced). `ffn_recompute_chunk_tokens` > 0 makes the FFN keep only its input for the backward
    pass and recompute its activations in chunks of that many tokens (backward memory independent of batch and
    sequence length, for one extra forward of the FFN); 0 keeps the activations.
    """

    model_type = "memffn_flash_mhf"
    class_prefix = "FlashMHFLlama"
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
        _check_choice(type(self).__name__, "ffn_variant", ffn_variant, self.variants)
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
        return "swiglu" if self.ffn_variant == "swiglu" else "flash_mhf"

    @property
    def ffn_head_dim(self) -> int:
        return self.hidden_size // self.ffn_num_heads

    @property
    def subnetwork_size(self) -> int:
        return self.intermediate_size // self.ffn_num_subnetworks

    def validate_fields(self) -> None:
        super().validate_fields()
        name = type(self).__name__
        _check_choice(name, "ffn_kernel", self.ffn_kernel, self.kernels)
        _check(name, isinstance(self.ffn_recompute_chunk_tokens, int) and self.ffn_recompute_chunk_tokens >= 0,
               "ffn_recompute_chunk_tokens", self.ffn_recompute_chunk_tokens, "must be an integer >= 0")
        if self.ffn_variant == "swiglu":
            return
        _check(name, self.ffn_num_heads > 0, "ffn_num_heads", self.ffn_num_heads, "must be positive")
        _check(
            name,
            self.hidden_size % self.ffn_num_heads == 0,
            "ffn_num_heads",
            self.ffn_num_heads,
            f"must divide hidden_size={self.hidden_size}",
        )
        _check(
            name,
            self.ffn_num_kv_heads > 0 and self.ffn_num_heads % self.ffn_num_kv_heads == 0,
            "ffn_num_kv_heads",
            self.ffn_num_kv_heads,
            f"must divide ffn_num_heads={self.ffn_num_heads}",
        )
        _check(name, self.ffn_gate_eps >= 0, "ffn_gate_eps", self.ffn_gate_eps, "must be >= 0")
        if self.ffn_variant == "pkv":
            return
        _check(
            name,
            self.ffn_num_subnetworks > 0 and self.intermediate_size % self.ffn_num_subnetworks == 0,
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


class MemoryLLMConfig(MemFFNConfig):
    """MemoryLLM (memoryllm.md): every layer's FFN reads the token embeddings X0,
    `X_{L+1} = X_L + Attn(X_L) + FFN_L(X0)`. `intermediate_size` is the width of each layer's FFN."""

    model_type = "memffn_memoryllm"
    class_prefix = "MemoryLLM"
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
    residual_ffn = "swiglu"
    parallel_residual_ffn = True

    def __init__(self, memory_intermediate_size: int | None = None, **kwargs):
        self.memory_intermediate_size = memory_intermediate_size
        super().__init__(**kwargs)
        if self.memory_intermediate_size is None:
            self.memory_intermediate_size = self.intermediate_size

    @property
    def token_memory_size(self) -> int:
        return self.memory_intermediate_size

    def validate_fields(self) -> None:
        super().validate_fields()
        value = self.memory_intermediate_size
        _check(type(self).__name__, value is None or (isinstance(value, int) and value > 0),
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
    residual stream of a 12-layer, 768-wide model grow to an RMS of 12.3 at layer 11 instead of 3.3); it is kept as
    an ablation.

    Ablations: `kvffn_activation` (silu/gelu/relu), `kvffn_composition` ("product" or "sum" of key and value),
    `kvffn_bias`, `kvffn_inner_residual`, `kvffn_init` (std of the FFN weights:
    "inv_sqrt_d" = 1/sqrt(hidden_size), "inv_d" = 1/hidden_size, "inv_sqrt_h" = 1/sqrt(intermediate_size)).
    Baselines through `ffn_variant`: "relu" (W_o relu(W_k x + b_k) + b_o), "glu" (sigmoid-gated linear unit,
    W_o(sigmoid(W_k x + b_k) * (W_v x + b_v)) + b_o) and "densenet" (the output layer reads the hidden features
    concatenated with the block input: W_o [relu(W_k x + b_k); x] + b_o). The activation, composition and inner
    residual options apply to the "kvffn" variant; `kvffn_bias`, `kvffn_init` and `kvffn_dropout` (dropout on the
    block's output while training; kv-ffn.md trains with 0.1 on attention and FFN, i.e. with
    `attention_dropout=0.1`) to all four. With `kvffn_bias=False` the "kvffn" block is a SwiGLU FFN.
    """

    model_type = "memffn_kvffn"
    class_prefix = "KVFFN"
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
        _check_choice(name, "ffn_variant", self.ffn_variant, self.variants)
        _check_choice(name, "kvffn_activation", self.kvffn_activation, self.activations)
        _check_choice(name, "kvffn_composition", self.kvffn_composition, self.compositions)
        _check_choice(name, "kvffn_init", self.kvffn_init, self.inits)
        _check(name, isinstance(self.kvffn_dropout, (int, float)) and 0.0 <= self.kvffn_dropout < 1.0,
               "kvffn_dropout", self.kvffn_dropout, "must be a number in [0, 1)")


CONFIG_CLASSES = (FlashMHFLlamaConfig, MemoryLLMConfig, FlexMemoryLLMConfig, KVFFNConfig)

__all__ = ["MemFFNConfig", "FlashMHFLlamaConfig", "MemoryLLMConfig", "FlexMemoryLLMConfig", "KVFFNConfig"]
