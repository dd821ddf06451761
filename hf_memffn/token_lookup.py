"""Token lookup tables (ToLs): the FFNs that read the token embeddings X0, precomputed per vocabulary token.

MemoryLLM's FFNs (and FlexMemoryLLM's FFN-M) see only X0, so their output for token `t` at layer `l` is a fixed
vector. A token lookup table stores, for every token id, all layers' outputs in one contiguous row
(`[vocab_size, num_kept_layers * hidden_size]`, possibly compressed). This module holds:

* the on-disk format (`TokenLookupFormat`, the index file, the row codecs: float, int8/int4 with group-wise scales,
  low-rank per-layer factors) shared by the exporter (`hf_memffn.conversion.export`) and the runtime;
* `weights_fingerprint`, which identifies the weights a table was computed from;
* `TokenLookupTable`, the runtime that replaces the memory FFN computation by a lookup, one class per placement
  (`gpu`, `cpu`, `disk`: `PLACEMENT_CLASSES`, built by `open_table`), and the readout object the decoder layers call
  (`readout.add_into(hidden, layer_idx)`);
* `TokenLookupMixin`, which gives the MemoryLLM / FlexMemoryLLM model classes `load_tols`, `unload_tols` and
  `drop_memory_ffn`.

Imported by the remote-code modeling file of MemoryLLM / FlexMemoryLLM (`modeling_memoryllm.py`), so it imports only
torch and the standard library (+ `check_choice` from the configuration file and the guarded Triton kernels next to
it).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import threading
import weakref
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch
from torch import nn
from torch.nn.utils import prune

from .configuration_memffn import check_choice
from .modeling_memffn import embedding_rows
from .token_lookup_triton import HAS_TRITON, KERNEL_DTYPES, gather_rows_triton, lookup_add_triton
from .triton_launch import autocast_off

INDEX_NAME = "token_lookup.safetensors.index.json"
SHARD_PATTERN = "token_lookup{suffix}.safetensors"
REPORT_NAME = "token_lookup_report.json"
TABLE_FORMAT_VERSION = 1

FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "lowrank")
PLACEMENTS = ("gpu", "cpu", "disk")
KERNELS = ("auto", "triton", "torch")
VERIFY_MODES = ("full", "size")
FLOAT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
QUANT_MAX = {"int8": 127, "int4": 7}
DEFAULT_GROUP_SIZE = {"int8": 128, "int4": 64}
SCALE_DTYPE = torch.bfloat16

# safetensors dtype tags <-> torch dtypes (only those a table uses)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8, "U8": torch.uint8}
_DTYPE_NAMES = {v: k for k, v in {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                                  "int8": torch.int8, "uint8": torch.uint8}.items()}


class TokenLookupError(ValueError):
    """A token lookup table that is incomplete, damaged, or computed from other weights than the model's."""


# ----------------------------------------------------------------------------------------------------------------------
# Format


def _integer(name: str, value) -> int:
    """`value` as an int (an int or an integer scalar such as numpy's), else a ValueError naming the option."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return value.__index__()
    except (AttributeError, TypeError, RuntimeError):
        raise ValueError(f"{name} takes integers; got {value!r}") from None


def _number(name: str, value) -> float:
    """`value` as a float (a real number, not a string or a bool), else a ValueError naming the option."""
    try:
        if isinstance(value, (bool, str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} takes a number; got {value!r}") from None


@dataclass
class TokenLookupFormat:
    """How a table is stored.

    name: fp32 | fp16 | bf16 | int8 | int4 | lowrank.
    group_size: int8/int4 only, number of consecutive hidden units sharing one scale (divides hidden_size; default
        the largest power of two up to 128 for int8, 64 for int4, that divides hidden_size).
    rank / energy: lowrank only, exactly one of them: a fixed rank for every layer, or the smallest per-layer rank
        keeping this fraction of the layer's squared singular values.
    factor_dtype: lowrank only, dtype of the stored coefficients and bases (fp32 | fp16 | bf16).
    drop_layers: layers whose memory output is not stored (they contribute nothing in lookup mode).
    """

    name: str = "bf16"
    group_size: int | None = None
    rank: int | None = None
    energy: float | None = None
    factor_dtype: str = "bf16"
    drop_layers: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        check_choice("format", self.name, FORMATS)
        if isinstance(self.drop_layers, (str, bytes)) or not hasattr(self.drop_layers, "__iter__"):
            raise ValueError(f"drop_layers={self.drop_layers!r} must be a list of layer indices, e.g. [8, 9]")
        self.drop_layers = tuple(sorted({_integer("drop_layers", layer) for layer in self.drop_layers}))
        if self.name in QUANT_MAX:
            if self.group_size is not None:  # (None: chosen by check_model from the hidden size)
                group_size = _integer("group_size", self.group_size)
                if group_size < 2 or group_size % 2:
                    raise ValueError(f"group_size={self.group_size!r} must be an even integer >= 2")
                self.group_size = group_size
        elif self.group_size is not None:
            raise ValueError(f"group_size={self.group_size!r} applies only to formats int8 and int4, not {self.name!r}")
        if self.name == "lowrank":
            check_choice("factor_dtype", self.factor_dtype, tuple(FLOAT_DTYPES))
            if (self.rank is None) == (self.energy is None):
                raise ValueError(f"format 'lowrank' needs exactly one of rank or energy (got rank={self.rank!r}, "
                                 f"energy={self.energy!r})")
            if self.rank is not None:
                self.rank = _integer("rank", self.rank)
                if self.rank < 1:
                    raise ValueError(f"rank={self.rank!r} must be >= 1")
            if self.energy is not None:
                self.energy = _number("energy", self.energy)
                if not 0.0 < self.energy <= 1.0:
                    raise ValueError(f"energy={self.energy!r} must be in (0, 1]")
        elif self.rank is not None or self.energy is not None:
            raise ValueError(f"rank/energy apply only to format 'lowrank', not {self.name!r}")

    def check_model(self, num_layers: int, hidden_size: int) -> None:
        bad = [layer for layer in self.drop_layers if not 0 <= layer < num_layers]
        if bad:
            raise ValueError(f"drop_layers={list(self.drop_layers)} has layers outside 0..{num_layers - 1}: {bad}")
        if len(self.drop_layers) == num_layers:
            raise ValueError(f"drop_layers={list(self.drop_layers)} drops every layer; keep at least one")
        if self.name in QUANT_MAX and self.group_size is None:
            # default: the largest power of two up to 128 (int8) / 64 (int4) dividing hidden_size
            self.group_size = math.gcd(DEFAULT_GROUP_SIZE[self.name], hidden_size)
            if self.group_size < 2:
                raise ValueError(f"hidden_size={hidden_size} is odd: pass an even group_size that divides it")
        if self.group_size is not None and hidden_size % self.group_size:
            raise ValueError(f"group_size={self.group_size} must divide hidden_size={hidden_size}")
        if self.rank is not None and self.rank > hidden_size:
            raise ValueError(f"rank={self.rank} exceeds hidden_size={hidden_size}")

    def kept_layers(self, num_layers: int) -> list[int]:
        return [layer for layer in range(num_layers) if layer not in self.drop_layers]

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.name in FLOAT_DTYPES:
            return FLOAT_DTYPES[self.name]
        if self.name == "int8":
            return torch.int8
        if self.name == "int4":
            return torch.uint8
        return FLOAT_DTYPES[self.factor_dtype]

    def to_dict(self) -> dict:
        data = asdict(self)
        data["drop_layers"] = list(self.drop_layers)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> "TokenLookupFormat":
        return cls(**{k: (tuple(v) if k == "drop_layers" else v) for k, v in data.items()})


# ----------------------------------------------------------------------------------------------------------------------
# Row codecs (quantize at export, dequantize at lookup). Rows are [T, K*d] with layer k at columns [k*d, (k+1)*d).


def quantize_rows(values: torch.Tensor, fmt: TokenLookupFormat) -> dict[str, torch.Tensor]:
    """Encode fp32 rows [T, K*d] (float formats and int8/int4; lowrank is encoded by the exporter)."""
    if fmt.name in FLOAT_DTYPES:
        return {"rows": values.to(FLOAT_DTYPES[fmt.name]).contiguous()}
    qmax = QUANT_MAX[fmt.name]
    groups = values.float().reshape(values.shape[0], -1, fmt.group_size)
    # Scales are stored in bf16 (fp32 range, 2 bytes); rounding them up keeps every value inside [-qmax, qmax].
    scale = (groups.abs().amax(-1) / qmax * (1.0 + 2.0**-7)).to(SCALE_DTYPE)
    safe_scale = torch.where(scale > 0, scale.float(), torch.ones((), device=values.device))
    q = torch.round(groups / safe_scale.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8).reshape(values.shape[0], -1)
    if fmt.name == "int4":
        q = pack_int4(q)
    return {"rows": q.contiguous(), "scales": scale.contiguous()}


def dequantize_rows(rows: torch.Tensor, scales: torch.Tensor | None, fmt: TokenLookupFormat) -> torch.Tensor:
    """Decode stored rows (any column range that starts and ends on a group boundary) to fp32."""
    if fmt.name in FLOAT_DTYPES or fmt.name == "lowrank":
        return rows.float()
    q = unpack_int4(rows) if fmt.name == "int4" else rows
    grouped = q.float().reshape(q.shape[0], -1, fmt.group_size)
    return (grouped * scales.float().unsqueeze(-1)).reshape(q.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], [T, 2n] -> uint8 [T, n]; element 2i in the low nibble, 2i+1 in the high nibble."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 15).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def row_relative_errors(exact: torch.Tensor, approx: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """Relative L2 error of every (token, layer) vector; an exactly-zero vector reproduced exactly counts 0."""
    exact = exact.float().reshape(exact.shape[0], -1, hidden_size)
    diff = (approx.float().reshape_as(exact) - exact).norm(dim=-1)
    norm = exact.norm(dim=-1)
    return torch.where(norm > 0, diff / norm.clamp_min(torch.finfo(torch.float32).tiny), (diff > 0).float())


# ----------------------------------------------------------------------------------------------------------------------
# Fingerprint


def _memory_base(model: nn.Module) -> nn.Module:
    """The module holding `embed_tokens` and `memory` (the base model of a *ForCausalLM, or the model itself; through
    a PEFT wrapper, `get_base_model()`)."""
    if hasattr(model, "embed_tokens"):
        return model
    if callable(getattr(model, "get_base_model", None)):  # (PEFT's PeftModel: its `model` is not the decoder)
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return inner
    raise ValueError(f"{type(model).__name__} has no embed_tokens / model.embed_tokens; token lookup tables need a "
                     "MemoryLLM or FlexMemoryLLM model")


def _offload_hooks(module: nn.Module) -> list:
    """The hooks accelerate's dispatch (`from_pretrained(device_map=...)`) set on `module` (none without it)."""
    hook = getattr(module, "_hf_hook", None)
    return [] if hook is None else list(getattr(hook, "hooks", (hook,)))


def stored_tensor(root: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (named `name` under `root`); if a device map offloaded it to the CPU or the disk, it stays on the meta
    device between forwards and this is the copy the offload hooks load for a forward, in its dtype."""
    if tensor.device.type != "meta":
        return tensor
    module_name, _, key = name.rpartition(".")
    while True:  # from the module that holds the tensor out to `root`: the first hook that keeps it
        for hook in _offload_hooks(root.get_submodule(module_name)):
            weights_map = getattr(hook, "weights_map", None)
            if weights_map is None:
                continue
            try:  # (a lookup, not `in`: that would read a tensor on the disk twice)
                return weights_map[key].to(tensor.dtype)
            except KeyError:
                pass
        if not module_name:
            raise TokenLookupError(f"{name} is on the meta device and no offload hook of the device map holds it: "
                                   "load the model's weights before computing or checking a token lookup table")
        module_name, _, parent = module_name.rpartition(".")
        key = f"{parent}.{key}"


def execution_device(module: nn.Module) -> torch.device:
    """Where `module` computes: its weight's device, or, for a module a device map offloaded (its weight on the meta
    device), the device its offload hook loads the weight onto for a forward."""
    device = module.weight.device
    if device.type == "meta":
        for hook in _offload_hooks(module):
            if getattr(hook, "execution_device", None) is not None:
                return torch.device(hook.execution_device)
    return device


def saved_tensors(module: nn.Module):
    """(name, module holding it, its key there, tensor) of each tensor under `module` that `state_dict` saves (the
    parameters and persistent buffers), named as it names them, without running its hooks: FSDP2's hook reshards the
    weights that `fully_shard` gathered, and a check in the middle of a forward freed those the forward was reading."""
    for path, owner in module.named_modules():
        persistent_buffers = [(key, tensor) for key, tensor in owner._buffers.items()
                              if key not in owner._non_persistent_buffers_set]
        for key, tensor in (*owner._parameters.items(), *persistent_buffers):
            if tensor is not None:
                yield f"{path}{'.' if path else ''}{key}", owner, key, tensor


# config fields that change what the memory FFN computes from the same weights
_FINGERPRINT_CONFIG_FIELDS = ("rms_norm_eps", "hidden_act", "vocab_size", "hidden_size", "num_hidden_layers",
                              "token_memory_size")


def weights_fingerprint(model: nn.Module, through: torch.dtype | None = None) -> str:
    """sha256 of everything a table row depends on: embedding rows, every memory FFN tensor, the FFN's config.

    The whole tensors are hashed (not samples), so any change (a fine-tuned embedding row, another checkpoint) is
    seen. Tensors are hashed after rounding to bf16, so a table exported from the fp32 weights is accepted by the same
    checkpoint loaded in bf16. `through=torch.float16` rounds them to fp16 first: the fingerprint of the same weights
    loaded in fp16 (whose range and precision differ from bf16's, so bf16 rounding alone does not match them). Cost:
    about one second per GB of bf16 weights, twice at export (both fingerprints) and once at load, less than reading
    the table itself (vocab x layers x hidden values against vocab x hidden + layers x 3 x I x hidden).
    """
    base = _memory_base(model)
    memory = getattr(base, "memory", None)
    if memory is None:
        stored = getattr(base, "_token_lookup_fingerprints", {}).get(through)
        if stored is None:
            raise TokenLookupError("the memory FFN weights are not on this model and no fingerprint was kept; "
                                   "load the model again to compute or check a token lookup table")
        return stored
    tensors = [("embed_tokens.weight", base.embed_tokens.weight)]
    tensors += [(f"memory.{name}", tensor) for name, _, _, tensor in saved_tensors(memory)]
    # (hashed under the checkpoint's names: `TokenMemory.rmsnorm_weight` is saved as `norm_weight`)
    saved_name = {"memory.rmsnorm_weight": "memory.norm_weight"}

    def whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
        tensor = stored_tensor(base, name, tensor.detach())  # (offloaded by a device map: the stored copy)
        if hasattr(tensor, "full_tensor"):  # sharded by tensor parallelism or FSDP (a DTensor): hash the whole tensor
            tensor = tensor.full_tensor()
        return tensor

    named = sorted(((saved_name.get(name, name), lambda name=name, tensor=tensor: whole(name, tensor))
                    for name, tensor in tensors), key=lambda item: item[0])
    return fingerprints(getattr(base, "config", None), named, (through,))[0]


def fingerprints(config, named_tensors, throughs: Sequence[torch.dtype | None]) -> list[str]:
    """The fingerprints (see `weights_fingerprint`) of `config`'s fields that the FFNs on X0 depend on and of
    `named_tensors` ((checkpoint name, function giving the tensor), sorted by name), one per dtype of `throughs` that
    the tensors are rounded to before bf16 (None: bf16 alone), in one pass over the tensors: shared by the model's
    fingerprint and that of the weights saved in a checkpoint folder (`conversion.export.checkpoint_fingerprints`)."""
    settings = {k: getattr(config, k, None) for k in _FINGERPRINT_CONFIG_FIELDS}
    digests = [hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()) for _ in throughs]
    for name, get_tensor in named_tensors:
        tensor = get_tensor()
        for digest in digests:
            digest.update(f"{name}:{tuple(tensor.shape)};".encode())
        flat = tensor.reshape(-1)
        chunk = 1 << 26  # elements per device->host copy
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk]
            for digest, through in zip(digests, throughs):
                # (a copy always: `numpy()` marks the storage it shares as not resizable, and FSDP2 frees the
                # weights it gathered for a forward by resizing theirs, which a bf16 weight on the CPU would be)
                rounded = (part.to(through) if through is not None else part).to("cpu", torch.bfloat16, copy=True)
                digest.update(rounded.contiguous().view(torch.uint8).numpy().tobytes())
    return [digest.hexdigest() for digest in digests]


def table_takes(table: dict, fingerprint: str, fingerprint_fp16) -> bool:
    """Whether the token lookup table whose index metadata is `table` was computed from the weights of `fingerprint`
    (`weights_fingerprint`) and `fingerprint_fp16` (the same through fp16; a function giving it, called only where
    needed): the same weights, or the same rounded to fp16, as the table's fingerprints record them."""
    # (`fingerprint_fp16`: the exported weights rounded to fp16, as the same checkpoint loaded in fp16 holds them)
    table_fp16 = table.get("fingerprint_fp16")
    if fingerprint in (table.get("fingerprint"), table_fp16):
        return True
    # A table exported from the weights loaded in fp16 holds fingerprints of fp16 weights only: these weights
    # rounded to fp16 are those weights when they are fp32 (in bf16 they were rounded once already).
    if table_fp16 is None:
        return False
    return (fingerprint_fp16() if callable(fingerprint_fp16) else fingerprint_fp16) == table_fp16


# ----------------------------------------------------------------------------------------------------------------------
# Files: index + shards


def shard_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _valid_header_entry(info) -> bool:
    """Whether `info` describes a tensor of a table: a dtype a table uses, a shape of counts, and data offsets
    [begin, end] spanning exactly the shape's bytes."""
    if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
        return False
    shape, offsets = info.get("shape"), info.get("data_offsets")

    def is_count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not (isinstance(shape, list) and all(map(is_count, shape)) and isinstance(offsets, list) and len(offsets) == 2
            and all(map(is_count, offsets))):
        return False
    return offsets[1] - offsets[0] == math.prod(shape) * _ST_DTYPES[info["dtype"]].itemsize


def read_safetensors_header(path: str) -> tuple[int, dict]:
    """(offset of the data section, header dict) of a safetensors file; raises TokenLookupError if unreadable."""
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as handle:
        raw = handle.read(8)
        if len(raw) < 8:
            raise TokenLookupError(f"shard {name} is truncated: {size} bytes, no safetensors header")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise TokenLookupError(f"shard {name} is truncated: header of {header_len} bytes in a {size}-byte file")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as error:
            raise TokenLookupError(f"shard {name} has a damaged safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise TokenLookupError(f"shard {name} has a damaged safetensors header: not a JSON object")
    for key, info in header.items():
        if key != "__metadata__" and not _valid_header_entry(info):
            raise TokenLookupError(f"shard {name} has a damaged safetensors header: the entry of tensor {key!r} "
                                   f"lacks a dtype of {sorted(_ST_DTYPES)}, a shape, or data offsets spanning it")
    data_start = 8 + header_len
    end = max((info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"), default=0)
    if data_start + end > size:
        raise TokenLookupError(f"shard {name} is truncated: {size} bytes on disk, its header needs {data_start + end}")
    return data_start, header


@dataclass
class TableIndex:
    """The parsed index file of a table."""

    directory: str
    fmt: TokenLookupFormat
    vocab_size: int
    num_hidden_layers: int
    hidden_size: int
    layers: list[int]
    ranks: list[int] | None
    rows_per_block: int
    fingerprint: str
    shards: dict[str, dict]  # file -> {"sha256", "size"}
    weight_map: dict[str, str]  # tensor -> file
    metadata: dict

    @property
    def row_width(self) -> int:
        """Stored elements per token row."""
        if self.fmt.name == "lowrank":
            return sum(self.ranks)
        width = len(self.layers) * self.hidden_size
        return width // 2 if self.fmt.name == "int4" else width

    @property
    def scale_width(self) -> int:
        return len(self.layers) * self.hidden_size // self.fmt.group_size if self.fmt.group_size else 0

    @property
    def block_starts(self) -> list[int]:
        return list(range(0, self.vocab_size, self.rows_per_block))

    @classmethod
    def read(cls, directory: str) -> "TableIndex":
        path = os.path.join(directory, INDEX_NAME)
        if not os.path.isfile(path):
            # (a checkpoint folder also holds the remote code token_lookup*.py: not a sign of an export; a shard being
            # written is a hidden `.token_lookup*.tmp`)
            partial = [n for n in os.listdir(directory) if n.lstrip(".").startswith("token_lookup")
                       and n.endswith((".safetensors", ".tmp"))] if os.path.isdir(directory) else []
            hint = " (shards without an index: an export was interrupted; run it again)" if partial else ""
            raise TokenLookupError(f"no token lookup table in {directory}: {INDEX_NAME} is missing{hint}")
        with open(path) as handle:
            try:
                raw = json.load(handle)
            except ValueError as error:
                raise TokenLookupError(f"{path} is not valid JSON: {error}") from None
        metadata = raw.get("metadata") if isinstance(raw, dict) else None
        meta = metadata.get("token_lookup") if isinstance(metadata, dict) else None
        written_version = meta.get("format_version") if isinstance(meta, dict) else None
        if isinstance(written_version, int) and not isinstance(written_version, bool) \
                and written_version != TABLE_FORMAT_VERSION:
            written_by = "a later" if written_version > TABLE_FORMAT_VERSION else "an earlier"
            raise TokenLookupError(
                f"{path} holds a token lookup table of format version {written_version}, written by {written_by} "
                f"version of hf-memffn; this version reads format version {TABLE_FORMAT_VERSION}: export the table "
                "again from the model's weights with this version (`hf-memffn export-tols`), or load it with the "
                "version that wrote it")
        if written_version != TABLE_FORMAT_VERSION:
            raise TokenLookupError(f"{path} is not a token lookup index of format version {TABLE_FORMAT_VERSION}")
        fields = _checked_index_fields(path, raw, meta)
        return cls(directory=directory, ranks=meta.get("ranks"), metadata=meta, **fields)

    def verify(self, mode: str = "full") -> None:
        """Check every shard: present, of the recorded size, (mode 'full') of the recorded sha256."""
        check_choice("verify", mode, VERIFY_MODES)
        for name, info in self.shards.items():
            path = os.path.join(self.directory, name)
            if not os.path.isfile(path):
                raise TokenLookupError(f"shard {name} of the token lookup table in {self.directory} is missing")
            size = os.path.getsize(path)
            if size != info["size"]:
                raise TokenLookupError(f"shard {name} is truncated or altered: {size} bytes on disk, the index "
                                       f"records {info['size']}")
            read_safetensors_header(path)
            if mode == "full" and shard_sha256(path) != info["sha256"]:
                raise TokenLookupError(f"shard {name} is altered: its sha256 differs from the one in the index")

    def open_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the table, memory-mapped (read lazily from disk), keyed by name."""
        tensors: dict[str, torch.Tensor] = {}
        for name in self.shards:
            path = os.path.join(self.directory, name)
            data_start, header = read_safetensors_header(path)
            file_bytes = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                raw = file_bytes[data_start + begin:data_start + end]
                dtype = _ST_DTYPES[info["dtype"]]
                if (data_start + begin) % dtype.itemsize:
                    raw = raw.clone()  # unaligned: copy (never happens for tables written by the exporter)
                tensors[key] = raw.view(dtype).reshape(info["shape"])
        missing = sorted(set(self.weight_map) - set(tensors))
        if missing:
            raise TokenLookupError(f"tensors {missing[:3]} listed in the index are not in the shards")
        for key, shape in self.tensor_shapes().items():
            if key not in tensors:
                raise TokenLookupError(f"tensor {key} of the token lookup table in {self.directory} is not in its "
                                       "shards")
            if tuple(tensors[key].shape) != shape:
                raise TokenLookupError(f"tensor {key} of the token lookup table in {self.directory} has shape "
                                       f"{tuple(tensors[key].shape)} but its index describes {shape}")
            dtype = SCALE_DTYPE if key.startswith("scales.") else self.fmt.storage_dtype
            if tensors[key].dtype != dtype:
                raise TokenLookupError(f"tensor {key} of the token lookup table in {self.directory} has dtype "
                                       f"{tensors[key].dtype} but its format {self.fmt.name!r} stores {dtype}")
        return tensors

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the runtime reads, by name, with the shape the index describes."""
        shapes = {}
        for start in self.block_starts:
            rows = min(self.rows_per_block, self.vocab_size - start)
            shapes[block_keys(start)[0]] = (rows, self.row_width)
            if self.fmt.group_size:
                shapes[block_keys(start)[1]] = (rows, self.scale_width)
        for layer, rank in zip(self.layers, self.ranks if self.fmt.name == "lowrank" else []):
            shapes[basis_key(layer)] = (rank, self.hidden_size)
        return shapes


def _checked_index_fields(path: str, raw: dict, meta: dict) -> dict:
    """The fields of a token lookup index, each of the type and value the runtime reads (TokenLookupError if not)."""

    def damaged(field: str, requirement: str):
        value = repr(raw.get("weight_map") if field == "weight_map" else meta.get(field.rpartition(".")[2]))
        value = value if len(value) <= 60 else value[:60] + "..."
        return TokenLookupError(f"{path} is damaged: `{field}`={value} {requirement}; export the table again")

    def is_count(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value > 0

    fields = {}
    for key in ("vocab_size", "num_hidden_layers", "hidden_size", "rows_per_block"):
        if not is_count(meta.get(key)):
            raise damaged(f"token_lookup.{key}", "must be a positive integer")
        fields[key] = meta[key]
    if not isinstance(meta.get("format"), dict):
        raise damaged("token_lookup.format", "must be an object")
    try:
        fmt = TokenLookupFormat.from_dict(meta["format"])
        fmt.check_model(fields["num_hidden_layers"], fields["hidden_size"])
    except (TypeError, ValueError) as error:
        raise damaged("token_lookup.format", f"is not a valid format ({error})") from None
    layers = fmt.kept_layers(fields["num_hidden_layers"])
    if meta.get("layers") != layers:
        raise damaged("token_lookup.layers", f"must be the layers its format keeps, {layers}")
    ranks = meta.get("ranks")
    if fmt.name == "lowrank" and not (isinstance(ranks, list) and len(ranks) == len(layers)
                                      and all(is_count(rank) and rank <= fields["hidden_size"] for rank in ranks)):
        raise damaged("token_lookup.ranks", f"must be {len(layers)} ranks in 1..{fields['hidden_size']}, one per kept "
                      "layer")
    if not isinstance(meta.get("fingerprint"), str):
        raise damaged("token_lookup.fingerprint", "must be a string")
    shards = meta.get("shards")
    if not isinstance(shards, dict) or not shards or not all(
            isinstance(info, dict) and isinstance(info.get("sha256"), str) and isinstance(info.get("size"), int)
            for info in shards.values()):
        raise damaged("token_lookup.shards", 'must map each shard file name to {"sha256": str, "size": int}')
    # (names the export writes: a name with a folder in it would be read from outside the table's folder, and copied
    # outside the folder a checkpoint is saved or staged into, `copy_table_files`)
    outside = [name for name in shards if not (os.path.basename(name) == name and "\\" not in name
                                               and name.startswith("token_lookup") and name.endswith(".safetensors"))]
    if outside:
        raise damaged("token_lookup.shards", f"must name files token_lookup*.safetensors in the table's folder, not "
                      f"{outside[0]!r}")
    weight_map = raw.get("weight_map")
    if not isinstance(weight_map, dict) or not all(file in shards for file in weight_map.values()):
        raise damaged("weight_map", "must map tensor names to the shard files of token_lookup.shards")
    return {**fields, "fmt": fmt, "layers": layers, "fingerprint": meta["fingerprint"], "shards": shards,
            "weight_map": weight_map}


def block_keys(start: int) -> tuple[str, str]:
    return f"rows.{start:09d}", f"scales.{start:09d}"


def basis_key(layer: int) -> str:
    return f"basis.{layer:03d}"


# ----------------------------------------------------------------------------------------------------------------------
# Runtime


def _host_mapped_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor reading `host` (pinned memory) in place: kernels fetch its rows over PCIe, no copy, no sync.

    Pinned host memory is mapped into the device address space under unified addressing (every 64-bit CUDA system),
    at the same address; the alias owns nothing, the caller keeps `host` alive.
    """

    class _Interface:
        __cuda_array_interface__ = {"shape": (host.numel() * host.element_size(),), "typestr": "|u1",
                                    "data": (host.data_ptr(), False), "version": 2, "strides": None}

    flat = torch.as_tensor(_Interface(), device=device)
    return flat.view(host.dtype).view(host.shape)


class TokenLookupReadout:
    """The memory outputs of one forward's tokens, read from a table: `hidden = readout.add_into(hidden, layer)`."""

    def __init__(self, table: "TokenLookupTable", row_ids: torch.Tensor, rows: torch.Tensor,
                 scales: torch.Tensor | None, gathered: bool = False):
        """`gathered`: `rows` and `scales` are already the tokens' own, in order (`row_ids` counts 0..T-1)."""
        self.table = table
        self.row_ids = row_ids  # [T] index into rows/scales
        self.rows = rows
        self.scales = scales
        # (rows, scales) of the tokens, every layer's columns: gathered once, on first use
        self._tokens_rows = (rows, scales) if gathered else None

    def tokens_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens' rows and scales [T, width], gathered by the first layer that reads them (PyTorch path): one
        gather per forward, then each layer adds its columns."""
        if self._tokens_rows is None:
            scales = None if self.scales is None else self.scales.index_select(0, self.row_ids)
            self._tokens_rows = (self.rows.index_select(0, self.row_ids), scales)
        return self._tokens_rows

    def layer_values(self, position: int) -> torch.Tensor:
        """The tokens' memory outputs of the table's layer `position` [T, d] by PyTorch operations, where the rows
        are: the stored rows themselves when they need no decoding (a float format), else decoded to float32 (also
        under autocast, as the export computed them)."""
        table = self.table
        if table.fmt.name == "lowrank":
            offset, rank = table.rank_offsets[position], table.index.ranks[position]
            coefficients = self.rows.index_select(0, self.row_ids)[:, offset:offset + rank]
            with autocast_off(coefficients.device.type):
                return coefficients.float() @ getattr(table, f"basis_{position}").float()
        d = table.index.hidden_size
        columns = d // 2 if table.fmt.name == "int4" else d
        tokens_rows, tokens_scales = self.tokens_rows()
        rows = tokens_rows[:, position * columns:(position + 1) * columns]
        if tokens_scales is None:
            return rows
        groups = d // table.fmt.group_size
        return dequantize_rows(rows, tokens_scales[:, position * groups:(position + 1) * groups], table.fmt)

    def add_into(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor:
        table = self.table
        position = table.layer_position[layer_idx]
        if position < 0:  # dropped layer
            return hidden
        if hidden.device != self.rows.device:
            # a model split over devices (`device_map`): this layer's hidden states are not where the table is; its
            # values are read where the rows are and added on the hidden states' device, by PyTorch operations
            if table.requested_kernel == "triton" and table.fmt.name != "lowrank":
                raise RuntimeError(
                    f"kernel='triton' cannot add the table into hidden states on {hidden.device}: the table's rows "
                    f"are on {self.rows.device}, and the Triton add reads both on one device (a model split over "
                    "devices by a device_map); load the table with kernel='auto' (the Triton add beside the table, "
                    "PyTorch operations on the other devices) or 'torch'")
            values = self.layer_values(position).to(hidden.device)
        else:
            kernel = table.compiled_kernel if torch.compiler.is_compiling() else table.kernel
            if kernel == "triton" and table.fmt.name != "lowrank":
                if hidden.dtype in KERNEL_DTYPES:  # (float64 takes the PyTorch add under "auto")
                    # (the table's rows, scales and layers were checked when it loaded, its row ids are its own; the
                    # sum comes back in hidden's shape, not as a view, which FSDP2 would warn of as a layer's output)
                    return lookup_add_triton(hidden.contiguous(), self.row_ids, self.rows, self.scales, position,
                                             table.index.hidden_size, table.fmt.name, table.fmt.group_size or 1,
                                             check_layout=False)
                if table.requested_kernel == "triton":
                    raise RuntimeError(f"kernel='triton' cannot add the table into hidden states of dtype "
                                       f"{hidden.dtype}: the kernel computes in float32; allowed: float16, bfloat16, "
                                       "float32 (load the table with kernel='auto' or 'torch')")
            values = self.layer_values(position)
        # (the sum is made in the hidden states' shape, not reshaped after: a decoder layer returns it, and a layer
        # output that is a view makes FSDP2 warn that an in-place op on it would skip its all-gather)
        values = values.reshape(hidden.shape)
        if values.dtype == hidden.dtype:
            # one addition: PyTorch adds 16-bit tensors in float32 and rounds once, as the branch below does
            return hidden + values
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32  # (float64 keeps its precision)
        return (hidden.to(compute) + values.to(compute)).to(hidden.dtype)


class TokenLookupTable(nn.Module):
    """The runtime of a token lookup table; set as `base_model.token_lookup` by `load_tols`.

    One subclass per placement (`PLACEMENT_CLASSES`, built by `open_table`), each holding the rows where its
    placement says and implementing `_readout`:
      gpu (`DeviceTokenLookupTable`): the whole table in device memory; each layer gathers its slice of the tokens'
            rows, dequantizes and adds into the hidden state in one kernel.
      cpu (`HostTokenLookupTable`): the table in pinned host memory, with a device cache of `cache_rows` frequent
            tokens (filled on a side stream); each forward gathers all its tokens' rows at once (prefill: the whole
            prompt) into a device buffer, cached rows from the cache and the others straight from host memory over
            PCIe (no host sync, so it works under CUDA graphs). Without a GPU: plain host memory, no cache.
      disk (`DiskTokenLookupTable`): the table memory-mapped from its shards (read lazily by the OS); a device cache
            as for `cpu`, half of it frequent tokens, half least-recently-used: each forward reads its token ids on the
            host, copies the missing rows from the mapped files into the cache on a side stream and reads every row
            from the cache; a forward with more new tokens than the cache's LRU half (a long prompt) copies all its
            rows at once into a device buffer instead. The host sync per forward rules out CUDA graphs. Without a
            GPU: rows are read from the mapped files directly.
    Triton kernels (`kernel="triton"`, the default on CUDA): gpu placement adds each layer's slice with the fused
    gather / dequantize / add kernel; cpu and disk gather whole rows once per forward, then use the same add kernel
    on that buffer. Low-rank tables always use PyTorch (gather coefficients, one small matmul per layer): their
    `kernel` is "torch" but for the cpu placement's gather, and `kernel="triton"` is refused for the others.
    Under torch.compile (`compiled_kernel`), the add is PyTorch operations unless `kernel="triton"` was asked for:
    inductor fuses the gather, dequantization and add into the kernels around them, where the Triton kernel, opaque
    to it, runs as a kernel of its own per layer (a compiled static-cache decoding step of the 370M MemoryLLM on an
    H100: 778 against 834 us of GPU work at batch 1). The cpu placement's gather of host rows stays a Triton kernel.
    Table tensors are non-persistent buffers: they never enter the model's state dict.
    """

    placement = ""  # set by each subclass
    # the parameter names of the FFNs on X0 when the table was loaded (`load_tols`; None: not recorded), which
    # `check_sources` compares at each forward: an adapter added since changes them
    memory_parameters_at_load: tuple[str, ...] | None = None
    # What the table's rows are computed from, as `record_sources` saw it: the token embedding and FFNs on X0 modules,
    # and (name, module holding it, its key there, tensor, version counter) of each of their tensors (None: not
    # recorded yet, as in a copy); `check_sources` compares them at each eager forward. (Tensors, not weak references:
    # `torch.utils.swap_tensors`, which casts use under torch.__future__'s setting, refuses a tensor that has one.)
    source_modules: tuple[nn.Module, nn.Module | None] | None = None
    # the model holding them (a weak reference: the table is its submodule), for `__getstate__`
    source_model: "weakref.ReferenceType[nn.Module] | None" = None
    source_versions: list[tuple[str, nn.Module, str, torch.Tensor, int]] | None = None
    copied_changed_source: str | None = None

    def __init__(self, index: TableIndex, device: torch.device | str | None = None, kernel: str = "auto"):
        super().__init__()
        check_choice("kernel", kernel, KERNELS)
        # a low-rank table's values are its coefficients times a basis, PyTorch operations: only the cpu placement's
        # gather of host rows is a Triton kernel
        without_kernels = index.fmt.name == "lowrank" and self.placement != "cpu"
        if kernel == "triton" and without_kernels:
            raise ValueError(
                f"kernel='triton' does not apply to a lowrank table with placement={self.placement!r}: its values are "
                "computed by PyTorch operations (its coefficients times a basis, per layer), which no Triton kernel "
                "replaces; use kernel='auto' or 'torch' (placement='cpu' gathers its host rows with a Triton kernel)")
        device = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self._check_device(device)
        if kernel == "triton" and (device.type != "cuda" or not HAS_TRITON):
            raise ValueError(f"kernel='triton' needs triton and a CUDA device (device={str(device)!r}, "
                             f"triton available: {HAS_TRITON})")
        self.index = index
        self.fmt = index.fmt
        self.device = device
        self.requested_kernel = kernel  # (an explicit "triton" refuses what its kernel cannot do; "auto" goes around)
        self.kernel = "triton" if (kernel == "auto" and device.type == "cuda" and HAS_TRITON
                                   and not without_kernels) else ("torch" if kernel == "auto" else kernel)
        # the add's path under torch.compile (a low-rank table's is PyTorch operations)
        self.compiled_kernel = "triton" if kernel == "triton" and self.fmt.name != "lowrank" else "torch"
        positions = {layer: k for k, layer in enumerate(index.layers)}
        self.layer_position = [positions.get(layer, -1) for layer in range(index.num_hidden_layers)]
        self.rank_offsets = [0]
        for rank in index.ranks or []:
            self.rank_offsets.append(self.rank_offsets[-1] + rank)
        self.cache_hits = 0
        self.cache_lookups = 0
        mapped = index.open_tensors()
        for k, layer in enumerate(index.layers if self.fmt.name == "lowrank" else []):
            # (a copy even on the CPU, where `.to` would keep a view of the mapped shard: such a view cannot be
            # pickled for torch.multiprocessing, and torch.save would write the whole shard)
            self.register_buffer(f"basis_{k}", mapped[basis_key(layer)].to(device, copy=True), persistent=False)
        self._place_rows(mapped)

    def _check_device(self, device: torch.device) -> None:
        """Refuse a device this placement cannot use."""

    def _apply(self, fn, recurse=True):
        """The table stays as `load_tols` placed it: casting the model (`.to(torch.bfloat16)`, `.half()`) leaves its
        storage dtypes alone; moving it to another device is refused (the model refuses first, before anything
        moves: see `TokenLookupMixin._apply`)."""
        refuse_device_change(self, fn)
        return self

    def _place_rows(self, mapped: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def _copy_rows(self, mapped: dict[str, torch.Tensor], target: torch.device, pin: bool):
        """The table's rows and scales ([vocab, width]) copied out of the mapped shards into one tensor each."""
        index, quantized = self.index, self.fmt.group_size is not None
        rows = torch.empty(index.vocab_size, index.row_width, dtype=self.fmt.storage_dtype, device=target,
                           pin_memory=pin)
        scales = (torch.empty(index.vocab_size, index.scale_width, dtype=SCALE_DTYPE, device=target, pin_memory=pin)
                  if quantized else None)
        for start in index.block_starts:
            block_rows = mapped[block_keys(start)[0]]
            rows[start:start + block_rows.shape[0]].copy_(block_rows)
            if quantized:
                scales[start:start + block_rows.shape[0]].copy_(mapped[block_keys(start)[1]])
        return rows, scales

    def _mark_static(self) -> None:
        if self.device.type == "cuda":
            # fixed addresses: CUDA graphs (torch.compile "reduce-overhead") read the table in place, never copy it
            for buffer in self.buffers():
                torch._dynamo.mark_static_address(buffer, guard=False)

    def readout(self, input_ids: torch.Tensor) -> TokenLookupReadout:
        """The memory outputs of `input_ids` ([B, L]) for every layer, ready for `add_into`."""
        if input_ids is None:
            raise ValueError("lookup mode needs input_ids (the table is indexed by token id); got inputs_embeds only")
        # (int64 ids: the cache's index_copy_ takes no others, and continuous batching passes int32 ones)
        return self._readout(input_ids.reshape(-1).to(self.device, torch.long))

    def _readout(self, ids: torch.Tensor) -> TokenLookupReadout:
        raise NotImplementedError

    def check_sources(self, base: nn.Module) -> None:
        """A TokenLookupError if an adapter was put on the token embedding or on the FFNs on X0 (`memory`) of `base`
        after `load_tols` (PEFT's LoRA, `target_parameters` or `modules_to_save`, as `load_adapter` or `get_peft_model`
        add them; `hf_memffn.adapters`' LoRA or int8): the table holds the FFNs on X0 of the weights it was exported
        from, so reading it would leave the adapter out of them; so is a change of those weights since
        (`check_source_versions`)."""
        refuse_embedding_adapters(base.embed_tokens, loaded=True)
        memory = getattr(base, "memory", None)
        refuse_pruned_memory(memory, "the table holds the FFNs on X0 of the weights it was exported from; call "
                                     "unload_tols() to compute them again, or make the pruning permanent with "
                                     "prune.remove and export the table from the pruned model")
        names = memory_parameter_names(memory) if memory is not None else None
        if None not in (names, self.memory_parameters_at_load) and names != self.memory_parameters_at_load:
            changed = sorted(set(names) - set(self.memory_parameters_at_load)) or sorted(
                set(self.memory_parameters_at_load) - set(names))
            # The same names in another order: a weight registered again, as `prune.remove` does with values set
            # through `.data`, which neither the tensor's identity nor its version counter shows.
            cause = (f"{changed[0]}: an adapter put on them after load_tols, such as PEFT's target_parameters LoRA or "
                     "modules_to_save, or hf_memffn.adapters' LoRA or int8" if changed else
                     f"{list(names)} against {list(self.memory_parameters_at_load)}: a weight registered again, as "
                     "prune.remove does")
            raise TokenLookupError(
                f"the FFNs on X0 (memory) have other parameters than when the table was loaded ({cause}), which the "
                "table does not hold; call unload_tols() to compute the FFNs on X0 again, or merge the adapter and "
                "export the table from the merged model")

        self.check_source_versions(base)

    def record_sources(self, base: nn.Module) -> None:
        """Remember the tensors of `base` that the table's rows depend on and their version counters (which every
        in-place change bumps), for `check_source_versions`; called when the weights are known to be the table's."""
        memory = getattr(base, "memory", None)
        self.source_modules = (base.embed_tokens, memory)
        self.source_model = weakref.ref(base)
        self.source_versions = [
            (f"{prefix}.{name}", owner, key, tensor, tensor._version)
            for prefix, module in (("embed_tokens", base.embed_tokens), ("memory", memory)) if module is not None
            for name, owner, key, tensor in saved_tensors(module)
            # (no counter: a meta tensor, which a device map's offloading puts in place of a weight between forwards,
            # its stored copy being what changes, and an inference tensor, made under torch.inference_mode)
            if not tensor.is_meta and not tensor.is_inference()]
        self.copied_changed_source = None

    def changed_source(self, base: nn.Module | None) -> str | None:
        """The name of the first tensor that the rows depend on that was changed in place or replaced in `base` since
        `record_sources` (the cost of a forward: two attribute reads, then a dict lookup, an identity and an int
        compare per tensor). `base` None (the model is gone): the recorded modules' tensors only."""
        recorded = self.source_versions
        if recorded is None:  # a copy that has not run a forward yet (see `__getstate__`)
            return self.copied_changed_source
        embedding, memory = self.source_modules
        if base is not None and base.embed_tokens is not embedding:
            return "embed_tokens"
        if base is not None and getattr(base, "memory", None) is not memory:
            return "memory"
        for name, owner, key, tensor, version in recorded:
            current = owner._parameters.get(key)
            if current is None:
                current = owner._buffers.get(key)
            if current is not tensor or tensor._version != version:
                return name
        return None

    def check_source_versions(self, base: nn.Module) -> None:
        """A TokenLookupError if the token embedding or the FFNs on X0 of `base` changed since `load_tols` (an
        in-place edit, `model.apply`, `copy_`, an optimizer step, a tensor assigned in place of one): the table holds
        the FFNs on X0 of the weights it was exported from. A changed tensor is checked against the table's
        fingerprint, as `load_tols` checks it, so weights changed and restored, or cast, are taken again.

        Not seen: writes through `tensor.data` (PEFT's `merge_and_unload` writes so, and `torch.nn.utils.prune`'s
        `remove` on the last weight registered; on another, `check_sources` sees the order change), fused optimizers
        (`fused=True`: torch 2.13's fused step left the counter as it was, on the CPU), tensors on the meta device
        (offloaded by a device map: their stored copy is what changes) and inference tensors (created under
        `torch.inference_mode`), which have no version counter."""
        if self.source_versions is None:  # a copy: its tensors are others, with counters of their own
            changed = self.copied_changed_source
            if changed is None:
                self.record_sources(base)
                return
        else:
            changed = self.changed_source(base)
            if changed is None:
                return
        remedy = ("call unload_tols() to compute the FFNs on X0 from the weights as they are now, or export the table "
                  "again from them (export_tols) and load_tols it")
        if getattr(base, "memory", None) is None:  # (dropped: the weights cannot be checked against the table)
            remedy = ("the FFNs on X0 were dropped (drop_memory_ffn), so this model can neither compute them nor "
                      "export their table: load the model again, change its weights there and export the table again "
                      "from them (export_tols)")
        else:
            try:
                check_table_matches(self.index, base)
            except TokenLookupError:
                pass
            else:
                self.record_sources(base)
                return
        raise TokenLookupError(
            f"{changed} changed since the token lookup table in {self.index.directory} was loaded (an in-place edit, "
            f"model.apply, an optimizer step, a copy_ or another tensor put in its place): the table holds the FFNs "
            f"on X0 of the weights it was exported from, not of these; {remedy}")

    def __getstate__(self):
        # A copy's tensors are others, with counters of their own (and the table alone, pickled, must not carry the
        # model's weights): the copy records its tensors at its first forward, keeping which one had changed here
        # (in place, or replaced by another tensor or module) so that it is refused as this table is
        state = dict(super().__getstate__())
        for name in ("source_modules", "source_versions", "source_model"):
            state.pop(name, None)
        if self.source_versions is not None:
            state["copied_changed_source"] = self.changed_source(self.source_model())
        return state

    def _host_buffers(self) -> tuple[str, ...]:
        """Buffers that live in host memory even when they are CUDA tensors (aliases of pinned host memory)."""
        return ()

    def extra_repr(self) -> str:
        return (f"format={self.fmt.name}, placement={self.placement}, device={self.device}, kernel={self.kernel}, "
                f"compiled_kernel={self.compiled_kernel}, "
                f"vocab_size={self.index.vocab_size}, layers={len(self.index.layers)}/{self.index.num_hidden_layers}")

    def device_bytes(self) -> int:
        """Bytes this table holds in device memory (table or cache, scales, bases)."""
        host = self._host_buffers()
        return sum(buffer.numel() * buffer.element_size() for name, buffer in self.named_buffers()
                   if buffer is not None and buffer.device.type == "cuda" and name not in host)


class DeviceTokenLookupTable(TokenLookupTable):
    """placement "gpu": the whole table in device memory (see `TokenLookupTable`)."""

    placement = "gpu"

    def __init__(self, index: TableIndex, device=None, kernel: str = "auto", cache_rows: int = 0,
                 frequent_tokens=None):
        super().__init__(index, device, kernel)  # no cache: every row is on the device already
        self._mark_static()

    def _check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"placement='gpu' needs a CUDA device, got device={str(device)!r}; use 'cpu' or 'disk'")

    def _place_rows(self, mapped: dict[str, torch.Tensor]) -> None:
        rows, scales = self._copy_rows(mapped, self.device, pin=False)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def _readout(self, ids: torch.Tensor) -> TokenLookupReadout:
        return TokenLookupReadout(self, ids, self.rows, self.scales)


def _checked_token_ids(name: str, ids, vocab_size: int) -> torch.Tensor | None:
    """`ids` (a sequence or tensor of token ids, or None) as a flat CPU long tensor; a ValueError naming `name` for
    anything but integer ids in 0..vocab_size-1."""
    if ids is None:
        return None
    try:
        tokens = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} takes integer token ids; got {ids!r}") from None
    if tokens.numel() == 0:  # (no ids: an empty list becomes a float tensor)
        return torch.empty(0, dtype=torch.long)
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"{name} takes integer token ids; got dtype {tokens.dtype}")
    tokens = tokens.reshape(-1).long().cpu()
    outside = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if outside.numel():
        raise ValueError(f"{name} contains token id {outside[0].item()}: allowed ids are 0..{vocab_size - 1}")
    return tokens


def checked_cache_rows(cache_rows) -> int:
    """`cache_rows` of the cpu and disk placements as an int >= 0, else a ValueError naming it."""
    cache_rows = _integer("cache_rows", cache_rows)
    if cache_rows < 0:
        raise ValueError(f"cache_rows={cache_rows} must be >= 0 (the device cache's size in token rows)")
    return cache_rows


def device_cache_rows(cache_rows: int, device: torch.device, vocab_size: int) -> int:
    """Token rows of the device cache that the cpu and disk placements build for `cache_rows` (as `checked_cache_rows`
    gives it) on `device`: none off CUDA (the rows are read on the host) and none for 0, which both placements take
    on every device: without a cache, cpu reads every row from pinned host memory and disk copies each forward's rows
    to the device at once."""
    return min(cache_rows, vocab_size) if torch.device(device).type == "cuda" else 0


# a device cache's tensors: its rows and scales, and which token is in which slot (the device's and the host's view)
CACHE_BUFFERS = ("cache_rows", "cache_scales", "slot_of_token")
CACHE_BOOKKEEPING = ("host_slot_of_token", "token_in_slot", "slot_last_used")


class _CachedTokenLookupTable(TokenLookupTable):
    """Tables whose rows stay off the device (placements "cpu" and "disk"): on a GPU, a device cache of `cache_rows`
    token rows, of which `static_fraction` hold `frequent_tokens` for good and the rest the least recently used."""

    static_fraction = 1.0

    def __init__(self, index: TableIndex, device=None, kernel: str = "auto", cache_rows: int = 1024,
                 frequent_tokens: Sequence[int] | torch.Tensor | None = None):
        # (checked on every device, before the table is read: the same call must not pass on a CPU and fail on a GPU)
        cache_rows = checked_cache_rows(cache_rows)
        frequent_tokens = _checked_token_ids("frequent_tokens", frequent_tokens, index.vocab_size)
        super().__init__(index, device, kernel)
        cache_rows = device_cache_rows(cache_rows, self.device, index.vocab_size)
        self.use_cache = cache_rows > 0
        if self.use_cache:
            self._init_cache(cache_rows, frequent_tokens)
        self._mark_static()

    def _host_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of `tokens` (CPU long tensor) read on the host."""
        raise NotImplementedError

    def _priority_tokens(self, frequent_tokens) -> list[int]:
        """Distinct token ids, most important first, for the static part of the cache."""
        vocab = self.index.vocab_size
        if frequent_tokens is None:
            # Byte-level BPE vocabularies give low ids to early (frequent) merges: a usable default order.
            return list(range(min(self.static_slots, vocab)))
        order, seen = [], set()
        for token in frequent_tokens.tolist():  # (checked by `_checked_token_ids`)
            if token not in seen:
                seen.add(token)
                order.append(token)
                if len(order) == self.static_slots:
                    break
        return order

    def _init_cache(self, cache_rows: int, frequent_tokens) -> None:
        device, index = self.device, self.index
        self.register_buffer("cache_rows", torch.empty(cache_rows, index.row_width, dtype=self.fmt.storage_dtype,
                                                       device=device), persistent=False)
        self.register_buffer("cache_scales", torch.empty(cache_rows, index.scale_width, dtype=SCALE_DTYPE,
                                                         device=device) if self.fmt.group_size else None,
                             persistent=False)
        self.register_buffer("slot_of_token", torch.full((index.vocab_size,), -1, dtype=torch.int32, device=device),
                             persistent=False)
        self.copy_stream = torch.cuda.Stream(device)
        self.static_slots = max(int(cache_rows * self.static_fraction), 0)
        self.host_slot_of_token = torch.full((index.vocab_size,), -1, dtype=torch.int64)
        self.token_in_slot = torch.full((cache_rows,), -1, dtype=torch.int64)
        self.slot_last_used = torch.zeros(cache_rows, dtype=torch.int64)
        self._clock = 0
        self._init_slot_readers()
        tokens = torch.tensor(self._priority_tokens(frequent_tokens), dtype=torch.long)
        self._fill_slots(torch.arange(tokens.numel()), tokens)
        self.copy_stream.synchronize()

    def _init_slot_readers(self) -> None:
        """The bookkeeping that keeps a slot from being refilled while a forward may still read it (`_disk_rows`)."""
        # forwards whose row ids are alive that read each slot
        self.slot_readers = torch.zeros(self.token_in_slot.numel(), dtype=torch.int64)
        # (slots, stream) of forwards whose row ids were freed since; appended by a finalizer, which may run in any
        # thread at any moment (a deque's append needs no lock), and taken under the lock by the next lookup
        self._finished_readers = deque()
        self._cache_lock = threading.Lock()

    def __getstate__(self):
        # A CUDA stream and a lock cannot be copied or pickled (`copy.deepcopy`, `torch.save` and torch.multiprocessing
        # of the model failed on "cannot pickle 'torch.Stream' object"): a copy makes its own; no forward reads its
        # slots yet.
        state = dict(super().__getstate__())
        for name in ("copy_stream", "_finished_readers", "_cache_lock"):
            state.pop(name, None)
        if "slot_readers" in state:
            state["slot_readers"] = torch.zeros_like(state["slot_readers"])
            # The cache and its bookkeeping are the copy's own: torch.multiprocessing shares a tensor it sends (a CUDA
            # one by IPC, a CPU one moved into shared memory), and two tables filling the same slots under locks of
            # their own would read each other's rows.
            state["_buffers"] = {name: buffer.clone() if name in CACHE_BUFFERS and buffer is not None else buffer
                                 for name, buffer in state["_buffers"].items()}
            for name in CACHE_BOOKKEEPING:
                state[name] = state[name].clone()
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if "slot_readers" in state:  # (a table with a device cache)
            self.copy_stream = torch.cuda.Stream(self.device)
            self._finished_readers = deque()
            self._cache_lock = threading.Lock()
            self._mark_static()

    def _fill_slots(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Copy `tokens`' rows into cache `slots` on the side stream; the compute stream waits for it."""
        if tokens.numel() == 0:
            return
        rows, scales = self._host_rows(tokens)
        compute = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(compute)  # slots may still be read by queued kernels
        evicted = self.token_in_slot[slots]
        evicted = evicted[evicted >= 0]
        with torch.cuda.stream(self.copy_stream):
            device_slots = slots.to(self.device, non_blocking=True)
            self.cache_rows.index_copy_(0, device_slots, rows.pin_memory().to(self.device, non_blocking=True))
            if scales is not None:
                self.cache_scales.index_copy_(0, device_slots, scales.pin_memory().to(self.device, non_blocking=True))
            if evicted.numel():
                self.slot_of_token.index_fill_(0, evicted.to(self.device, non_blocking=True), -1)
            self.slot_of_token.index_copy_(0, tokens.to(self.device, non_blocking=True),
                                           slots.to(self.device, torch.int32, non_blocking=True))
        compute.wait_stream(self.copy_stream)
        self.host_slot_of_token[evicted] = -1
        self.host_slot_of_token[tokens] = slots
        self.token_in_slot[slots] = tokens

    def _host_readout(self, ids: torch.Tensor) -> TokenLookupReadout:
        """Every row of `ids` read on the host (no GPU)."""
        rows, scales = self._host_rows(ids.cpu())
        return TokenLookupReadout(self, torch.arange(ids.numel(), device=rows.device), rows, scales, gathered=True)


class HostTokenLookupTable(_CachedTokenLookupTable):
    """placement "cpu": the table in (pinned) host memory, the whole device cache static (see `TokenLookupTable`)."""

    placement = "cpu"
    static_fraction = 1.0

    def _place_rows(self, mapped: dict[str, torch.Tensor]) -> None:
        on_gpu = self.device.type == "cuda"
        rows, scales = self._copy_rows(mapped, torch.device("cpu"), pin=on_gpu)
        self._host_tables = (rows, scales)  # the host copies (they keep the device aliases below valid)
        if on_gpu:
            rows = _host_mapped_alias(rows, self.device)
            scales = _host_mapped_alias(scales, self.device) if scales is not None else None
            self._synchronize_when_freed()
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("scales", scales, persistent=False)

    def _synchronize_when_freed(self) -> None:
        # Pinned memory goes back to PyTorch's host allocator as soon as it is freed, for the next pinned allocation
        # to take (and write), and the allocator does not know of the kernels that read it through the aliases: a
        # table dropped (`unload_tols`, a table loaded in its place) while a forward reading it is still queued would
        # have it read other data. The device finishes its queued work before this table's host tables go.
        finalizer = weakref.finalize(self, torch.cuda.synchronize, self.device)
        finalizer.atexit = False  # (at exit, CUDA may be gone before the finalizer runs)

    def _host_buffers(self) -> tuple[str, ...]:
        return ("rows", "scales")

    def __getstate__(self):
        # On a GPU, `rows` and `scales` are aliases of the pinned host tables that own nothing: copied as tensors,
        # `copy.deepcopy` and `torch.save` would put the whole table in device memory, and torch.multiprocessing cannot
        # send them (they are no device allocation). The copy gets the host tables and makes its own aliases; a
        # clone of them, because torch.multiprocessing moves a CPU tensor it sends into shared memory, which would
        # free the pinned memory under this table's aliases.
        state = dict(super().__getstate__())
        if self.device.type == "cuda":
            state["_buffers"] = {name: None if name in self._host_buffers() else buffer
                                 for name, buffer in state["_buffers"].items()}
            state["_host_tables"] = tuple(None if table is None else table.clone() for table in self._host_tables)
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        if self.device.type == "cuda":
            rows, scales = (None if table is None else table.pin_memory() for table in self._host_tables)
            self._host_tables = (rows, scales)
            self.rows = _host_mapped_alias(rows, self.device)
            self.scales = _host_mapped_alias(scales, self.device) if scales is not None else None
            self._mark_static()
            self._synchronize_when_freed()

    def _host_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        host_rows, host_scales = self._host_tables
        return host_rows.index_select(0, tokens), (host_scales.index_select(0, tokens) if host_scales is not None else None)

    def _readout(self, ids: torch.Tensor) -> TokenLookupReadout:
        if self.device.type != "cuda":
            return self._host_readout(ids)
        # rows straight from the pinned table over PCIe, cached rows (if any) from the device cache
        rows, scales = self._gather(ids, self.slot_of_token if self.use_cache else None)
        return TokenLookupReadout(self, torch.arange(ids.numel(), device=self.device), rows, scales, gathered=True)

    def _gather(self, ids, slot_of_token):
        """Rows [T, W] (+ scales) of `ids` on the device: cache hits from the cache, misses from the mapped host table."""
        host_rows, host_scales = self.rows, self.scales
        cache_rows = self.cache_rows if slot_of_token is not None else None
        cache_scales = self.cache_scales if slot_of_token is not None else None
        if self.kernel == "triton":
            rows = gather_rows_triton(ids, slot_of_token, cache_rows, host_rows)
            scales = gather_rows_triton(ids, slot_of_token, cache_scales, host_scales) if host_scales is not None else None
            return rows, scales
        rows = host_rows.index_select(0, ids)
        scales = host_scales.index_select(0, ids) if host_scales is not None else None
        if slot_of_token is not None:
            slots = slot_of_token.index_select(0, ids).long()
            hit = (slots >= 0).unsqueeze(1)
            rows = torch.where(hit, cache_rows.index_select(0, slots.clamp_min(0)), rows)
            if scales is not None:
                scales = torch.where(hit, cache_scales.index_select(0, slots.clamp_min(0)), scales)
        return rows, scales


DISK_PLACEMENT_UNDER_COMPILE = (
    "placement='disk' reads its rows from the memory-mapped shards on the host at every forward, which no "
    "torch.compile graph holds: torch.compile(..., fullgraph=True) cannot trace a model reading such a table. "
    "Compile without fullgraph (the read runs between two graphs), or load the table with placement='gpu' "
    "(CUDA) or placement='cpu'")
DISK_PLACEMENT_UNDER_EXPORT = (
    "placement='disk' reads its rows from the memory-mapped shards on the host at every forward, which no "
    "torch.export program holds: torch.export cannot trace a model reading such a table. Load the table with "
    "placement='cpu' (its rows become the program's weights) or placement='gpu' (CUDA)")

DISK_PLACEMENT_UNDER_CUDA_GRAPHS = (
    "placement='disk' reads each forward's token ids on the host, which a CUDA graph being captured cannot do "
    "(continuous batching's use_cuda_graph, transformers' default with flash attention): turn the graphs off "
    "(ContinuousBatchingConfig(use_cuda_graph=False); --no-cb-use-cuda-graph for hf-memffn serve), or load the table "
    "with placement='gpu' or placement='cpu', which read no token ids on the host")


class DiskTokenLookupTable(_CachedTokenLookupTable):
    """placement "disk": the table memory-mapped from its shards, half the device cache static and half
    least-recently-used (see `TokenLookupTable`)."""

    placement = "disk"
    static_fraction = 0.5

    def _place_rows(self, mapped: dict[str, torch.Tensor]) -> None:
        quantized = self.fmt.group_size is not None
        self._blocks = [(start, mapped[block_keys(start)[0]], mapped[block_keys(start)[1]] if quantized else None)
                        for start in self.index.block_starts]

    def __getstate__(self):
        # The mapped blocks are views of the shard files: pickled (torch.save, a torch.multiprocessing spawn) they fail
        # (the file's storage is viewed under several dtypes; it has no file descriptor to share), and copied
        # (`copy.deepcopy`) they would read the whole table into memory. A copy maps the same files again instead.
        state = dict(super().__getstate__())
        del state["_blocks"]
        return state

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        check_table_files(self.index, remedy="load the table again (load_tols) in the process that reads it")
        self._place_rows(self.index.open_tensors())

    def _host_rows(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = torch.empty(tokens.numel(), self.index.row_width, dtype=self.fmt.storage_dtype)
        scales = torch.empty(tokens.numel(), self.index.scale_width, dtype=SCALE_DTYPE) if self.fmt.group_size else None
        block_of = tokens // self.index.rows_per_block
        for block in torch.unique(block_of).tolist():
            where = (block_of == block).nonzero().squeeze(1)
            start, block_rows, block_scales = self._blocks[block]
            local = tokens.index_select(0, where) - start
            rows[where] = block_rows.index_select(0, local)
            if scales is not None:
                scales[where] = block_scales.index_select(0, local)
        return rows, scales

    def _readout(self, ids: torch.Tensor) -> TokenLookupReadout:
        row_ids, rows, scales = self._disk_rows(ids)
        return TokenLookupReadout(self, row_ids, rows, scales,
                                  gathered=not self.use_cache or rows is not self.cache_rows)

    @torch.compiler.disable(reason=DISK_PLACEMENT_UNDER_COMPILE)
    def _disk_rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(row ids, rows, scales) of this forward's tokens on the device (a host sync on the ids).

        Without a device cache (none on the CPU, or `cache_rows=0`), every row read from the mapped shards (on a
        GPU, copied into a device buffer). With one, new tokens go into the least-recently-used half of the cache
        when they fit there; a forward with more new tokens than that (a long prompt) reads all its rows from the
        mapped shards at once into a device buffer.
        A forward's layers read its slots after this returns, and so may a recompute under activation checkpointing
        in the backward, or the layers of a forward run from another thread: the slots stay out of the refill while
        the forward's row ids are alive (`slot_readers`, released by a finalizer on the row ids). The bookkeeping
        runs under a lock, so forwards from several threads through one table each read their own tokens' rows.
        Under torch.compile this runs outside the graph, as a graph break; with `fullgraph=True` the error that
        refuses the break carries `DISK_PLACEMENT_UNDER_COMPILE`. Non-strict torch.export, which the disable does not
        keep out, would run it on its symbolic ids and fail in a data-dependent guard: refused, naming the placement.
        While a CUDA graph is captured the ids cannot be read back: a TokenLookupError says so before any copy (the
        copy would fail inside CUDA, its capture error naming neither the table nor the way out).
        """
        if torch.compiler.is_exporting():
            raise ValueError(DISK_PLACEMENT_UNDER_EXPORT)
        if ids.is_cuda and torch.cuda.is_current_stream_capturing():
            raise TokenLookupError(DISK_PLACEMENT_UNDER_CUDA_GRAPHS)
        tokens = ids.cpu()
        if not self.use_cache:
            return self._rows_on_device(tokens)
        unique = torch.unique(tokens)
        compute = torch.cuda.current_stream(self.device)
        with self._cache_lock:
            self._release_finished_readers()
            self._clock += 1
            slots = self.host_slot_of_token[unique]
            missing = unique[slots < 0]
            self.slot_last_used[slots[slots >= 0]] = self._clock
            self.cache_lookups += unique.numel()
            self.cache_hits += unique.numel() - missing.numel()
            dynamic = torch.arange(self.static_slots, self.token_in_slot.numel())
            free_order = dynamic[torch.argsort(self.slot_last_used[dynamic], stable=True)]
            usable = free_order[(self.slot_last_used[free_order] < self._clock) & (self.slot_readers[free_order] == 0)]
            if missing.numel() > usable.numel():
                return self._rows_on_device(tokens)
            chosen = usable[:missing.numel()]
            self.slot_last_used[chosen] = self._clock
            self._fill_slots(chosen, missing)
            # (a hit may be a slot that another thread's forward filled: its copy may still run on the side stream)
            compute.wait_stream(self.copy_stream)
            row_ids = self.slot_of_token.index_select(0, ids).long()
            read = self.host_slot_of_token[unique]
            read = read[read >= self.static_slots]
            self.slot_readers[read] += 1
        weakref.finalize(row_ids, self._finished_readers.append, (read, compute)).atexit = False
        return row_ids, self.cache_rows, self.cache_scales

    def _release_finished_readers(self) -> None:
        """Slots of forwards whose row ids were freed become refillable again, once their kernels have run: the side
        stream, which refills, waits for the stream they were issued on (under the lock of `_disk_rows`)."""
        while self._finished_readers:
            slots, stream = self._finished_readers.popleft()
            self.slot_readers[slots] -= 1
            self.copy_stream.wait_stream(stream)

    def _rows_on_device(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(row ids, rows, scales) of `tokens` (CPU long tensor) read from the mapped shards at once, in a buffer on
        the table's device (on the host off CUDA)."""
        rows, scales = self._host_rows(tokens)
        if self.device.type != "cuda":
            return torch.arange(tokens.numel()), rows, scales
        compute = torch.cuda.current_stream(self.device)
        copy_stream = self.copy_stream if self.use_cache else compute  # (the side stream comes with the cache)
        with torch.cuda.stream(copy_stream):
            rows = rows.pin_memory().to(self.device, non_blocking=True)
            scales = scales.pin_memory().to(self.device, non_blocking=True) if scales is not None else None
        compute.wait_stream(copy_stream)
        rows.record_stream(compute)
        if scales is not None:
            scales.record_stream(compute)
        return torch.arange(tokens.numel(), device=self.device), rows, scales


PLACEMENT_CLASSES: dict[str, type[TokenLookupTable]] = {
    table_class.placement: table_class
    for table_class in (DeviceTokenLookupTable, HostTokenLookupTable, DiskTokenLookupTable)
}


def open_table(index: TableIndex, placement: str, *, device=None, cache_rows: int = 1024, frequent_tokens=None,
               kernel: str = "auto") -> TokenLookupTable:
    """The runtime of an already read and verified table, in the class of `placement`."""
    check_choice("placement", placement, PLACEMENTS)
    return PLACEMENT_CLASSES[placement](index, device=device, kernel=kernel, cache_rows=cache_rows,
                                        frequent_tokens=frequent_tokens)


def load_table(path: str, placement: str = "gpu", *, device=None, cache_rows: int = 1024, frequent_tokens=None,
               kernel: str = "auto", verify: str = "full") -> TokenLookupTable:
    """Read, verify and place a table (no model check: `TokenLookupMixin.load_tols` does that)."""
    check_choice("placement", placement, PLACEMENTS)
    check_choice("verify", verify, VERIFY_MODES)
    index = TableIndex.read(path)
    index.verify(verify)
    return open_table(index, placement, device=device, cache_rows=cache_rows, frequent_tokens=frequent_tokens,
                      kernel=kernel)


def table_file_names(directory: str | os.PathLike, shards: Sequence[str]) -> list[str]:
    """The files of the table in `directory` whose index lists `shards`: the shards, the export report where there is
    one, and last the index (the order to copy them in, so that a table copied half-way never loads)."""
    report = [REPORT_NAME] if os.path.isfile(os.path.join(directory, REPORT_NAME)) else []
    return [*shards, *report, INDEX_NAME]


def check_table_files(index: TableIndex, remedy: str | None = None) -> None:
    """Refuse (a TokenLookupError) when the files in `index.directory` are no longer the table read from there: a
    table exported into the folder again after `load_tols` (other shards, another format) or files removed since.
    `remedy`: what the error tells to do (default: what to do before saving the table with a checkpoint)."""
    if remedy is None:
        remedy = (f"load it again (model.load_tols({index.directory!r})) before saving, or pass "
                  "include_token_lookup=False")
    try:
        on_disk = TableIndex.read(index.directory)
        if on_disk.metadata != index.metadata or on_disk.weight_map != index.weight_map:
            raise TokenLookupError(f"a table was exported there again after load_tols (now format "
                                   f"{on_disk.fmt.name!r} in {len(on_disk.shards)} shard(s); the model reads format "
                                   f"{index.fmt.name!r} from {len(index.shards)})")
        on_disk.verify("size")
    except TokenLookupError as error:
        raise TokenLookupError(f"the token lookup table the model reads is no longer the one in {index.directory}: "
                               f"{error}; {remedy}") from None


def check_table_to_save(index: TableIndex, model: nn.Module) -> None:
    """Refuse (a TokenLookupError), before a checkpoint of `model` is written with the table read from `index`, a
    table that its `load_tols` would not take: files changed since (`check_table_files`), or weights the table's
    fingerprint is not of (`check_table_matches`). A table kept through `merge_weight_lora` holds the merged weights'
    values, but its fingerprint is of the weights and adapters it was exported through."""
    check_table_files(index)
    try:
        check_table_matches(index, model)
    except TokenLookupError as error:
        remedy = "load the new table (load_tols) before saving, or pass include_token_lookup=False"
        raise TokenLookupError(f"the token lookup table the model reads would not load with the saved weights: "
                               f"{error}; {remedy}") from None


def copy_table_files(index: TableIndex, directory: str | os.PathLike) -> None:
    """Copy the files of the table read from `index.directory` into `directory` (see `table_file_names`); callers
    run `check_table_to_save` first, before they write anything."""
    for name in table_file_names(index.directory, index.shards):
        shutil.copy2(os.path.join(index.directory, name), os.path.join(directory, name))


def embedding_adapters(embedding: nn.Module) -> list[str]:
    """Names of the token embedding's parameters that its `weight` does not hold (an adapter, e.g. PEFT's LoRA
    embedding with its `lora_embedding_A`), whose change to X0 a table of the weight's FFNs does not have."""
    own = ("weight", "base_layer.weight")
    return [name for name, _ in embedding.named_parameters()
            if name not in own and not name.startswith("parametrizations.weight.")]


def refuse_embedding_adapters(embedding: nn.Module, loaded: bool = False) -> None:
    """A TokenLookupError while the token embedding has parameters that its weight does not hold (see
    `embedding_adapters`); `loaded`: the table is loaded already (the adapter came after `load_tols`)."""
    adapters = embedding_adapters(embedding)
    if adapters:
        unload = " or call unload_tols() to compute the FFNs on X0 again," if loaded else ""
        raise TokenLookupError(f"the token embedding has parameters that its weight does not hold ({adapters[0]}: an "
                               "adapter such as PEFT's LoRA), which change X0 but not a table computed from the "
                               "weight; merge the adapter into the weight (merge_and_unload) and export the table from "
                               f"the merged model,{unload} or leave the embedding out of the adapter's target modules")


# The parameters of `TokenMemory` (the FFNs on X0) under their attribute names
MEMORY_OWN_PARAMETERS = ("rmsnorm_weight", "gate_proj", "up_proj", "down_proj")


def memory_parameter_names(memory: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in memory.named_parameters())


def pruned_weight_names(module: nn.Module) -> list[str]:
    """The weights of `module` (not of its children) that `torch.nn.utils.prune` holds as `<name>_orig` and a mask
    until `prune.remove`: its forward pre-hook writes `<name>` as a plain tensor before each forward."""
    return [hook._tensor_name for hook in module._forward_pre_hooks.values()
            if isinstance(hook, prune.BasePruningMethod)]


def refuse_pruned_memory(memory: nn.Module | None, remedy: str) -> None:
    """A TokenLookupError while the FFNs on X0 carry a pruning mask, whose `<name>_orig` would otherwise be taken for
    an adapter's parameter."""
    pruned = pruned_weight_names(memory) if memory is not None else []
    if pruned:
        raise TokenLookupError(f"the FFNs on X0 (memory) are pruned by torch.nn.utils.prune ({pruned}) and still "
                               f"carry its mask; {remedy}")


def memory_adapters(memory: nn.Module) -> list[str]:
    """Names of the parameters of the FFNs on X0 that are not their own weights: a PEFT adapter's (the wrapper of
    `target_parameters` LoRA around the module, a `modules_to_save` copy beside it). PEFT switches these off or swaps
    them (`disable_adapter`, `set_adapter`) without a table knowing, and the wrapper hides the module's methods. The
    parametrizations of `hf_memffn.adapters` (`parametrizations.<weight>.*`) are the weights the module reads and the
    fingerprint hashes: a table exported through them holds them."""
    return [name for name in memory_parameter_names(memory)
            if name not in MEMORY_OWN_PARAMETERS and not name.startswith("parametrizations.")]


def refuse_memory_adapters(memory: nn.Module | None) -> None:
    """A TokenLookupError while the FFNs on X0 carry a PEFT adapter (see `memory_adapters`)."""
    refuse_pruned_memory(memory, "make the pruning permanent first with prune.remove(model.model.memory, name) for "
                                 "each of them")
    adapters = memory_adapters(memory) if memory is not None else []
    if adapters:
        raise TokenLookupError(f"the FFNs on X0 (memory) carry parameters that are not their weights ({adapters[0]}: a "
                               "PEFT adapter such as target_parameters LoRA or modules_to_save), which PEFT can switch "
                               "off or swap while a table holds the FFNs' values; merge the adapter into the weights "
                               "(merge_and_unload) and export the table from the merged model, or leave the FFNs on X0 "
                               "out of the adapter's targets")


def refuse_embedding_of_another_size(base: nn.Module, prefix: str = "") -> None:
    """A TokenLookupError while the token embedding of `base` has another number of rows than `config.vocab_size`
    (an embedding set with `set_input_embeddings`, which leaves the config as it was): a table has a row for each id
    below `config.vocab_size`, and the model takes the ids below the embedding's rows, so either a table would lack
    rows for ids the model takes or hold rows of ids the embedding does not have."""
    rows, vocab_size = embedding_rows(base.embed_tokens), base.config.vocab_size
    if rows is not None and rows != vocab_size:
        raise TokenLookupError(
            f"{prefix}the token embedding has {rows} rows but config.vocab_size={vocab_size}, the number of rows of a "
            f"token lookup table (set_input_embeddings leaves config.vocab_size as it was): resize with "
            f"model.resize_token_embeddings({rows}), which sets config.vocab_size and the output layer to the "
            "embedding's size, then export the table")


def refuse_table_input_adapters(model: nn.Module) -> None:
    """A TokenLookupError while an adapter changes what a table holds the values of: the token embedding (see
    `embedding_adapters`) or the FFNs on X0 (see `memory_adapters`)."""
    base = _memory_base(model)
    refuse_embedding_adapters(base.embed_tokens)
    refuse_memory_adapters(getattr(base, "memory", None))


def check_table_matches(index: TableIndex, model: nn.Module) -> None:
    """Refuse a table computed from other weights (or another shape) than `model`'s."""
    base = _memory_base(model)
    refuse_embedding_of_another_size(base)
    config = base.config
    expected = {"vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
                "num_hidden_layers": config.num_hidden_layers}
    for key, value in expected.items():
        if getattr(index, key) != value:
            raise TokenLookupError(f"token lookup table in {index.directory} has {key}={getattr(index, key)} but the "
                                   f"model has {key}={value}")
    refuse_table_input_adapters(base)
    fingerprint = weights_fingerprint(base)
    if table_takes(index.metadata, fingerprint, lambda: weights_fingerprint(base, through=torch.float16)):
        return
    if index.metadata.get("fingerprint_fp16") is None and base.embed_tokens.weight.dtype == torch.float16:
        # (earlier versions recorded the bf16 fingerprint alone, which weights rounded to fp16 first never give)
        raise TokenLookupError(
            f"token lookup table in {index.directory} was exported by an earlier version of hf-memffn, whose index "
            "records no fingerprint of the weights in fp16: this model's weights in fp16 cannot be checked against "
            "it. Load the model in fp32 or bf16, which take a table exported from the fp32 weights, or export the "
            "table again from this model with this version")
    raise TokenLookupError(f"token lookup table in {index.directory} was computed from other weights than this "
                           f"model's embedding / memory FFN (fingerprint {index.fingerprint[:12]}... vs model "
                           f"{fingerprint[:12]}...); export the table again from this model (a table exported from "
                           "the weights in fp32 is taken by the checkpoint loaded in fp32, bf16 or fp16; one exported "
                           "from them in bf16 or fp16 only by the checkpoint in that dtype or in fp32)")


def refuse_changing_table_inputs(base: nn.Module, state_dict, prefix: str, head: nn.Module | None = None) -> None:
    """A TokenLookupError where `state_dict`, being loaded into `base` (keys under `prefix`) while it reads a token
    lookup table, holds other values for the token embedding or the memory FFN than `base` has: the table holds the
    FFNs on X0 of the current ones, and would be read as if it held the new ones. Shapes that differ are left to
    `load_state_dict`'s own error.

    With `head` (the model around `base`, keys under `prefix`), only the head's own tensors that are the embedding's
    are checked: a tied `lm_head.weight` is loaded into the embedding too."""
    current = [(f"embed_tokens.{name}", tensor)
               for name, tensor in base.embed_tokens.state_dict(keep_vars=True).items()]
    if getattr(base, "memory", None) is not None:
        current += [(f"memory.{name}", tensor) for name, tensor in base.memory.state_dict(keep_vars=True).items()]
    checkpoint_name = {"memory.rmsnorm_weight": "memory.norm_weight"}  # (also taken by `TokenMemory`'s loading)
    if head is None:
        keys = {name: {prefix + name, prefix + checkpoint_name.get(name, name)} for name, _ in current}
    else:  # (the keys under `model.` are checked when loading reaches `base`)
        inside = {id(tensor): name for name, tensor in current}
        keys = {name: set() for name, _ in current}
        for head_name, tensor in head.state_dict(keep_vars=True).items():
            if id(tensor) in inside and not head_name.startswith("model."):
                keys[inside[id(tensor)]].add(prefix + head_name)
    changed = []
    for name, tensor in current:
        for key in keys[name]:
            incoming = state_dict.get(key)
            # (a meta tensor: loading copies nothing from it)
            if not isinstance(incoming, torch.Tensor) or incoming.is_meta or incoming.shape != tensor.shape:
                continue
            held = stored_tensor(base, name, tensor.detach())  # (offloaded by a device map: the stored copy)
            if not torch.equal(incoming.detach().to(held.device, held.dtype), held):
                changed.append(key)
    if changed:
        raise TokenLookupError(
            f"load_state_dict: a token lookup table is loaded, computed from the model's token embedding and memory "
            f"FFN, and the state dict holds other values for {', '.join(sorted(changed)[:3])}"
            f"{', ...' if len(changed) > 3 else ''}: the model would read the table of the old weights. Call "
            "unload_tols() first, load the weights, then export and load a table of them")


def keep_tables_through(merge, model: nn.Module):
    """Run `merge` (a function folding adapters into the weights of `model`) and keep the token lookup tables that
    `model`'s decoders read if they held the FFNs on X0 of the adapted weights: merging folds those values into the
    weights, which then have their own names again where the table recorded the adapters' (`check_sources` refused
    the next forward as if an adapter had been put on them after `load_tols`). A table that did not hold them (an
    adapter added or changed since `load_tols`) stays refused. Returns what `merge` returns."""
    holding = []
    for base in model.modules():
        table = getattr(base, "token_lookup", None)
        if isinstance(table, TokenLookupTable) and getattr(base, "memory", None) is not None:
            try:
                check_table_matches(table.index, base)  # (the fingerprint hashes the adapters' tensors too)
            except TokenLookupError:
                continue
            holding.append((base, table))
    result = merge()
    for base, table in holding:
        table.memory_parameters_at_load = memory_parameter_names(base.memory)
        table.record_sources(base)  # (the merged weights are new tensors, holding the values the table holds)
    return result


def refuse_device_change(table: TokenLookupTable, fn) -> None:
    """A clear error if `fn` (what `Module._apply` applies to every tensor) moves tensors off the table's device."""
    probe = torch.empty(0, device=table.device)
    target = fn(probe).device
    if target != probe.device:
        raise ValueError(f"the token lookup table was placed for {table.device} by load_tols, and the model is being "
                         f"moved to {target}: call unload_tols() (or load the model again, once its memory FFN is "
                         f"dropped), move the model, then load_tols again")


# values `refuse_discarding_values` passes through a conversion (exact in every floating dtype down to float8; a cast is
# compared with the probe cast directly anyway)
_VALUE_PROBE = (0.75, -3.5, 6.0, -0.375)


def refuse_discarding_values(table: TokenLookupTable, fn) -> None:
    """A clear error if `fn` (what `Module._apply` applies to every tensor) does not keep the tensors' values, as
    `to_empty` does (new, uninitialised tensors, on the table's device too, which `refuse_device_change` lets
    through): the token embedding and the memory FFN would lose the values the table holds the FFNs on X0 of. Casts
    (`.to(torch.bfloat16)`, `.half()`) and `share_memory()` keep them."""
    probe = torch.tensor(_VALUE_PROBE, device=table.device)
    result = fn(probe)
    kept = result.shape == probe.shape and torch.equal(result, probe.to(result.dtype))
    # (zeroed before they are freed: an uninitialised tensor allocated later cannot come back holding the probe)
    probe.zero_()
    result.zero_()
    if not kept:
        raise ValueError("the token lookup table loaded by load_tols holds the FFNs on X0 of the model's token "
                         "embedding and memory FFN, and the model's tensors are being replaced by tensors of other "
                         "values (to_empty leaves them uninitialised): call unload_tols() (or load the model again, "
                         "once its memory FFN is dropped), change the model, load its weights, then load_tols again")


# Where a model sits under the wrappers that hand attribute lookups down to it (so `DistributedDataParallel`, given
# the wrapper, reads the model's `_ddp_params_and_buffers_to_ignore`): PEFT's PeftModel (`base_model.model` for LoRA
# and the other adapters that change layers, `base_model` for prompt learning) and torch.compile's OptimizedModule
# (`_orig_mod`), alone or compiled over PEFT.
_PEFT_PREFIXES = ("base_model.model.", "base_model.")
WRAPPER_PREFIXES = (*_PEFT_PREFIXES, "_orig_mod.", *(f"_orig_mod.{prefix}" for prefix in _PEFT_PREFIXES))


class TokenLookupMixin:
    """Adds token lookup tables to MemoryLLM / FlexMemoryLLM models (base models, causal LMs and task heads)."""

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> list[str]:
        """The names `DistributedDataParallel` leaves out of its broadcasts (it reads them once, when it wraps this
        model): those set through `DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`, and every
        buffer of the token lookup tables loaded. Each rank loads its own table; without this, DDP copies rank 0's
        whole table (and a device cache's rows and slot map) over every rank's, when it wraps the model and again at
        each forward (`broadcast_buffers=True`, its default). DDP given a wrapper that hands attribute lookups down
        to this model reads this list too, and matches the names under the wrapper: each buffer is named under every
        `WRAPPER_PREFIXES` as well (a name no module has is never matched)."""
        table_buffers = [f"{path}.{name}" for path, module in self.named_modules()
                         if isinstance(module, TokenLookupTable) for name, _ in module.named_buffers()]
        wrapped = [f"{prefix}{name}" for prefix in WRAPPER_PREFIXES for name in table_buffers]
        return [*self.__dict__.get("_ddp_names_to_ignore", ()), *table_buffers, *wrapped]

    @_ddp_params_and_buffers_to_ignore.setter
    def _ddp_params_and_buffers_to_ignore(self, names) -> None:
        self.__dict__["_ddp_names_to_ignore"] = list(names)

    def _apply(self, fn, *args, **kwargs):
        # refuse a move of a model reading a table before any parameter moves (nothing is left half-moved)
        base = self.__dict__.get("_modules", {}).get("model", self)  # (no lookup that can fail mid-construction)
        table = getattr(base, "token_lookup", None)
        if table is None:
            return super()._apply(fn, *args, **kwargs)
        refuse_device_change(table, fn)
        refuse_discarding_values(table, fn)
        unchanged = table.changed_source(base) is None
        result = super()._apply(fn, *args, **kwargs)
        if unchanged:  # a cast keeps the values (swapping tensors, under torch.__future__'s setting, renews counters)
            table.record_sources(base)
        return result

    def load_state_dict(self, *args, **kwargs):
        # other values for the table's inputs are refused (`_load_from_state_dict`), so the weights loaded into them
        # are their own values again: the counters that the copy bumped are recorded, not taken for a change
        base = self.__dict__.get("_modules", {}).get("model", self)  # (as `_load_from_state_dict` finds it)
        table = getattr(base, "token_lookup", None)
        unchanged = table is not None and table.changed_source(base) is None
        result = super().load_state_dict(*args, **kwargs)
        if unchanged:
            table.record_sources(base)
        return result

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # `load_state_dict` reaches the decoder before its embedding and memory FFN: other values for them are
        # refused while a table is loaded, before any weight changes (see `refuse_changing_table_inputs`); it reaches
        # the model around the decoder first, whose tied `lm_head.weight` is the embedding's weight under another name
        base = self.__dict__.get("_modules", {}).get("model", self)
        if getattr(base, "token_lookup", None) is not None:
            refuse_changing_table_inputs(base, state_dict, prefix, head=None if base is self else self)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def load_tols(self, path: str | os.PathLike, placement: str = "gpu", *, device=None, cache_rows: int = 1024,
                  frequent_tokens=None, kernel: str = "auto", verify: str = "full",
                  drop_memory_ffn: bool = False) -> TokenLookupTable:
        """Switch the memory FFN (FFN on X0) to a lookup in the table exported to `path`.

        placement: "gpu" | "cpu" | "disk" (see `TokenLookupTable`); device defaults to the embedding's device (the
            one it computes on, if a device map offloaded it).
        cache_rows: device cache size in token rows for cpu/disk placements on a GPU (0: no cache, on every device).
        frequent_tokens: token ids, most frequent first, that fill the cache (default: the lowest ids; empty: none).
        kernel: "auto" (Triton on CUDA, PyTorch on CPU, for float64 hidden states and for layers a device map puts
            on another device than the table's; under torch.compile the add is left to inductor) | "triton" (under
            torch.compile too; refused for a lowrank table but with placement "cpu", and at the forward for float64
            hidden states or hidden states on another device; the Triton add also runs in a forward recording
            gradients of the hidden states, passing their gradient through) | "torch".
            `table.kernel` and `table.compiled_kernel` say which path runs.
        verify: "full" (sha256 of every shard) | "size" (sizes and headers only).
        drop_memory_ffn: free the memory FFN weights afterwards (see `drop_memory_ffn`).
        Raises TokenLookupError if the table is incomplete, damaged, or from other weights.
        """
        base = _memory_base(self)
        check_choice("placement", placement, PLACEMENTS)
        check_choice("verify", verify, VERIFY_MODES)
        if getattr(self, "_pp_stage", None) is not None or not isinstance(
                getattr(base.embed_tokens, "weight", None), torch.Tensor):
            raise ValueError("load_tols: token lookup tables do not work under pipeline parallelism: the stages after "
                             "the first have neither the token embeddings nor the token ids that index the table")
        index = TableIndex.read(os.fspath(path))
        check_table_matches(index, base)
        index.verify(verify)
        if device is None:
            device = execution_device(base.embed_tokens)
        table = open_table(index, placement, device=device, cache_rows=cache_rows, frequent_tokens=frequent_tokens,
                           kernel=kernel)
        memory = getattr(base, "memory", None)
        table.memory_parameters_at_load = memory_parameter_names(memory) if memory is not None else None
        table.record_sources(base)  # (the weights the fingerprint was just checked of)
        base.token_lookup = table
        if drop_memory_ffn:
            self.drop_memory_ffn()
        return table

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`save_pretrained`; inside `push_to_hub` of a model loaded with `trust_remote_code` alone (transformers'
        upload: it saves the model into a temporary folder and uploads that folder), also the files of the table the
        model reads, as `hf_memffn.hub.push_checkpoint` stages them (unless `include_token_lookup=False`)."""
        table = None
        if self.__dict__.get("_push_token_lookup") and kwargs.get("is_main_process", True):
            table = getattr(_memory_base(self), "token_lookup", None)
            if table is not None:
                check_table_to_save(table.index, self)  # (before the weights are written)
        result = super().save_pretrained(save_directory, *args, **kwargs)
        if table is not None:
            copy_table_files(table.index, save_directory)
        return result

    def _before_vocabulary_change(self) -> None:
        """`resize_token_embeddings` to another number of token ids is refused while a token lookup table is loaded:
        the table holds rows for the vocabulary it was exported from, and a new token would have none."""
        if getattr(_memory_base(self), "token_lookup", None) is not None:
            raise ValueError("resize_token_embeddings: a token lookup table is loaded, with rows for the current "
                             "vocabulary only; unload_tols() first, resize, train, then export a new table")

    def set_input_embeddings(self, value):
        """`set_input_embeddings`, refused while a token lookup table is loaded: the table holds the FFNs on X0 of the
        embedding it was exported from, and reading it would leave the new embedding out of them. (The embedding the
        model has is taken: `resize_token_embeddings` to the same size sets it again.)"""
        if getattr(_memory_base(self), "token_lookup", None) is not None and value is not self.get_input_embeddings():
            raise ValueError("set_input_embeddings: a token lookup table is loaded, computed from the current token "
                             "embedding; unload_tols() first, set the embedding, then export a new table")
        return super().set_input_embeddings(value)

    def unload_tols(self) -> None:
        """Back to computing the memory FFN (needs its weights)."""
        base = _memory_base(self)
        if getattr(base, "memory", None) is None:
            raise ValueError("the memory FFN weights were dropped; load the model again to compute the memory")
        base.token_lookup = None

    def drop_memory_ffn(self) -> int:
        """Free the memory FFN weights (lookup mode only needs the table); returns the number of parameters freed."""
        base = _memory_base(self)
        table = getattr(base, "token_lookup", None)
        if table is None:
            raise ValueError("load a token lookup table (load_tols) before dropping the memory FFN weights")
        memory = getattr(base, "memory", None)
        if memory is None:
            return 0
        table.check_sources(base)  # (an adapter put on the FFNs since the table was loaded would go with them unseen)
        # both fingerprints `check_table_matches` compares, so every table this model takes is still taken
        base._token_lookup_fingerprints = {through: weights_fingerprint(base, through=through)
                                           for through in (None, torch.float16)}
        freed = sum(p.numel() for p in memory.parameters())
        on_cuda = any(p.is_cuda for p in memory.parameters())
        # the model's size as trained, which `parameter_counts()["total"]` goes on counting
        counts = base.parameter_counts()
        base._dropped_memory_parameters = counts["total"] - counts["active"]
        base.memory = None
        del memory
        table.record_sources(base)  # (unchanged: checked above; the table lets go of the FFNs' tensors)
        if on_cuda:
            torch.cuda.empty_cache()
        return freed
