"""Tiny configurations of every architecture, for tests, examples and quick experiments."""

from __future__ import annotations

from transformers import LlamaConfig

from . import ARCHITECTURES
from .tokenization import train_tokenizer

# Shared decoder shape of the tiny models: small enough to train in seconds on a CPU.
TINY_DECODER = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)

# Per-architecture FFN fields of the tiny models.
TINY_FFN = {
    "llama": dict(intermediate_size=128),
    "flash_mhf": dict(intermediate_size=96, ffn_num_heads=4, ffn_num_subnetworks=2, ffn_num_kv_heads=2),
    "memoryllm": dict(intermediate_size=128),
    "flex_memoryllm": dict(intermediate_size=64, memory_intermediate_size=64),
    "kvffn": dict(intermediate_size=128),
}


def tiny_config(arch: str, **overrides):
    """A tiny config of `arch` ("llama" for the transformers Llama baseline, or a key of `ARCHITECTURES`)."""
    if arch not in TINY_FFN:
        raise ValueError(f"arch={arch!r} is not supported; allowed values: {sorted(TINY_FFN)}")
    fields = {**TINY_DECODER, **TINY_FFN[arch], **overrides}
    if arch == "llama":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        rope_theta = fields.pop("rope_theta")
        fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
        return LlamaConfig(**fields)
    return ARCHITECTURES[arch](**fields)


def tiny_tokenizer(vocab_size: int = 320):
    """A tokenizer trained on a few generated sentences; its vocabulary fits the tiny configs."""
    words = ["memory", "key", "value", "token", "layer", "head", "the", "a", "of", "is", "reads", "stores"]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(200)]
    return train_tokenizer(texts, vocab_size=vocab_size)



# Python source that makes `hf_memffn` unimportable in the interpreter that runs it, as on a machine where only the
# code saved beside a checkpoint exists. Prepend it to a script run with `python -c` to prove remote-code loading.
BLOCK_PACKAGE_IMPORT = """
import importlib.abc as _importlib_abc
import sys as _sys


class _BlockPackage(_importlib_abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "hf_memffn" or name.startswith("hf_memffn."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: only the code saved with the model may run)")
        return None


_sys.meta_path.insert(0, _BlockPackage())
"""
