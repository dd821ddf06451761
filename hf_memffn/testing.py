"""Tiny configurations of every architecture, for tests, examples and quick experiments."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys

from .architectures import BASELINE, architecture
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


# What a checkpoint of each architecture carries for `trust_remote_code` (transformers copies the modeling file named
# in `auto_map` and its sibling imports): the code its architecture runs, and nothing else.
_SHARED_REMOTE_CODE = {"configuration_memffn.py", "modeling_memffn.py", "ffn.py", "rms_norm.py", "parallel.py",
                       "decoder_triton.py", "ffn_triton.py", "triton_launch.py"}
_TOKEN_LOOKUP_RUNTIME = {"modeling_memoryllm.py", "token_lookup.py", "token_lookup_triton.py"}
REMOTE_CODE_FILES = {
    "flash_mhf": _SHARED_REMOTE_CODE
    | {"modeling_flash_mhf.py", "ffn_multihead.py", "flash_mhf_op.py", "flash_mhf_triton.py", "flash_mhf_gluon.py",
       "flash_mhf_layer_triton.py"},
    "memoryllm": _SHARED_REMOTE_CODE | _TOKEN_LOOKUP_RUNTIME,
    "flex_memoryllm": _SHARED_REMOTE_CODE | _TOKEN_LOOKUP_RUNTIME,
    "kvffn": _SHARED_REMOTE_CODE | {"modeling_kvffn.py"},
}


def tiny_config(arch: str, **overrides):
    """A tiny config of `arch` ("llama" for the transformers Llama baseline, or a key of `ARCHITECTURES`); the FFN
    fields of each architecture are its `tiny_ffn` in `hf_memffn.architectures.REGISTRY`."""
    entry = architecture(arch)
    fields = {**TINY_DECODER, **entry.tiny_ffn, **overrides}
    if arch == BASELINE:
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
        rope_theta = fields.pop("rope_theta")
        fields.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return entry.config_class(**fields)


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


def blocked_imports(*packages: str) -> str:
    """Python source that makes the packages `packages` (top-level names) absent in the interpreter that runs it, as
    on a machine without them: importing one raises ModuleNotFoundError naming it, and `importlib.util.find_spec`,
    which transformers asks before it imports an optional package, finds nothing (a finder that raised instead would
    break transformers' own checks). Prepend it to a script run with `python -c`."""
    return "import sys as _sys\n" + "".join(f"_sys.modules[{name!r}] = None\n" for name in packages)


def run_python(script: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `script` with `python -c` in a child process (this environment, offline), its output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=timeout)


def recording_backend():
    """(backend, graphs): a `torch.compile` backend that runs each graph Dynamo traces as traced and appends it to
    `graphs`, to count compilations and read what a graph holds."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend, graphs


@contextlib.contextmanager
def logged_records(name: str = "transformers"):
    """The log records of logger `name` and its children emitted within the block, in a list (transformers' loggers
    do not propagate to the root logger, which pytest's `caplog` reads)."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(name)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def left_padded(rows, pad_token_id: int = 0):
    """1-D token tensors of different lengths -> (input_ids, attention_mask) of one batch, each row padded on the
    left to the longest (mask 0 on the padding)."""
    import torch

    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, width - len(row):] = row
        attention_mask[i, width - len(row):] = 1
    return input_ids, attention_mask


def train_losses(model, input_ids, parameters, lr: float, steps: int) -> list[float]:
    """Trains `parameters` of `model` on `input_ids` (labels = inputs) with AdamW for `steps` steps; the losses."""
    import torch

    optimizer = torch.optim.AdamW(parameters, lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# transformers 5.25 renamed gradient checkpointing to activation checkpointing: there the model's
# `gradient_checkpointing_enable`, `gradient_checkpointing_disable` and `is_gradient_checkpointing`, and the
# TrainingArguments fields `gradient_checkpointing` and `gradient_checkpointing_kwargs`, are deprecated aliases that
# warn (FutureWarning). The helpers below use the installed version's names, so that the tests run on 5.17 to 5.25
# without a deprecation warning of their own making.


def _has_activation_checkpointing_methods() -> bool:
    from transformers import PreTrainedModel

    return hasattr(PreTrainedModel, "activation_checkpointing_enable")


def enable_activation_checkpointing(model, checkpoint_kwargs: dict | None = None) -> None:
    """Turns activation checkpointing on for `model` (a `PreTrainedModel`), with `checkpoint_kwargs` for
    `torch.utils.checkpoint` (such as `{"use_reentrant": False}`)."""
    if _has_activation_checkpointing_methods():
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def disable_activation_checkpointing(model) -> None:
    """Turns activation checkpointing off for `model` (a `PreTrainedModel`)."""
    if _has_activation_checkpointing_methods():
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


def is_activation_checkpointing(model) -> bool:
    """Whether activation checkpointing is on in `model` (a `PreTrainedModel`)."""
    if _has_activation_checkpointing_methods():
        return model.is_activation_checkpointing
    return model.is_gradient_checkpointing


def activation_checkpointing_arguments(enabled: bool, checkpoint_kwargs: dict | None = None) -> dict:
    """The `TrainingArguments` fields that turn activation checkpointing on or off (with `checkpoint_kwargs` for
    `torch.utils.checkpoint`), under the installed transformers' names."""
    from transformers import TrainingArguments

    fields = {field.name for field in dataclasses.fields(TrainingArguments)}
    name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    return {name: enabled, f"{name}_kwargs": checkpoint_kwargs}


def torchrun_command(processes: int, script, *args) -> list[str]:
    """The command that runs `script` in `processes` local processes with `torch.distributed.run`, on a port that
    nothing else can take first: the launcher's own rendezvous store binds a free port and keeps it, and the processes
    join their process group through that store (a port found free and released before the launch can be taken by
    another program in between)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nproc_per_node", str(processes), str(script), *map(str, args)]
