"""Export a MemoryLLM / FlexMemoryLLM's memory FFN as a token lookup table (`hf-memffn export-tols MODEL_DIR OUT_DIR`).

For every token id the table row holds the memory FFN output of every kept layer on X0 (the token's embedding),
computed in batches of `batch_size` tokens; each batch becomes one row block (`rows.<start>`, plus `scales.<start>`
for int8/int4) and blocks are grouped into safetensors shards (`token_lookup-0000i-of-0000n.safetensors`, planned
with huggingface_hub's sharding helper) with an index `token_lookup.safetensors.index.json` holding the format, the
shapes, the weights' fingerprint, every shard's size and sha256, and the table's error. A block (or a low-rank
basis) is never split across shards: a `max_shard_size` that one of them exceeds is refused.

Memory: one batch plus the shard being filled (low-rank adds the per-layer Gram matrices, layers x hidden^2).

Crash safety: a shard is written under `<name>.tmp` and renamed when complete, the index last. A shard records the
export plan it belongs to (format, fingerprint, block size, the model's dtype and device type, the low-rank bases'
sha256, shard layout), so a re-run keeps the shards of the same plan (resume) and rewrites everything else; a shard
an index of the same plan records is kept only with the recorded size and sha256, so a re-run repairs a damaged
shard. Every value to be written is checked (finite, within the format's range) before anything in the directory is
removed or rewritten (one more pass over the tokens to be written, where there is something to replace), so a refused
export leaves the directory's files as they were; an old index is removed before any shard is rewritten, so a
directory never holds an index over shards of another export; a refused export into a directory with nothing to
replace removes the shards it wrote. Only files named `token_lookup*` are ever touched. Files are not fsync'ed: the
index records every shard's size and sha256, so a shard damaged by a power cut is caught at load (and written again by
the same export).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import dataclass

import torch
from huggingface_hub import split_state_dict_into_shards_factory
from safetensors import safe_open
from safetensors.torch import save_file

from hf_memffn.architectures import auto_class_of
from hf_memffn.atomic_write import atomic_output, write_atomic
from hf_memffn.configuration_memffn import check_choice
from hf_memffn.hub import check_repo_id, hub_errors_in_one_line, weights_file_names, weights_variant
from hf_memffn.export_command import add_arguments, shard_size_bytes  # noqa: F401
from hf_memffn.triton_launch import autocast_off
from hf_memffn.model_card import refresh_lookup_section
from hf_memffn.run_records import run_record_json
from hf_memffn.cli_args import (PEFT_ADAPTER_CONFIG, TOKENIZER_FILES, UsageError, decode_utf8, has_tokenizer,
                                 load_causal_lm)
from hf_memffn.token_lookup import (FLOAT_DTYPES, INDEX_NAME, REPORT_NAME, SCALE_DTYPE, SHARD_PATTERN,
                                    TABLE_FORMAT_VERSION, TokenLookupError, TokenLookupFormat, _integer, _memory_base,
                                    basis_key, block_keys, dequantize_rows, embedding_adapters, execution_device,
                                    fingerprints, quantize_rows, read_safetensors_header,
                                    refuse_embedding_of_another_size, refuse_memory_adapters, row_relative_errors,
                                    shard_sha256, table_file_names, table_takes, weights_fingerprint)

OWN_FILE_PREFIX = "token_lookup"
SHARD_RECORD_KEY = "token_lookup_export"  # the shard's metadata entry (see `_shard_record`)


@dataclass
class _ErrorStats:
    """Running max / sum / count of per-(token, layer) relative errors."""

    total: float = 0.0
    count: int = 0
    max: float = 0.0

    def add(self, errors: torch.Tensor) -> None:
        if errors.numel():
            self.total += float(errors.double().sum())
            self.count += errors.numel()
            self.max = max(self.max, float(errors.max()))

    def merge(self, other: "_ErrorStats") -> None:
        self.total += other.total
        self.count += other.count
        self.max = max(self.max, other.max)

    def to_json(self) -> str:
        return json.dumps([self.total, self.count, self.max])

    @classmethod
    def from_json(cls, text: str) -> "_ErrorStats":
        total, count, maximum = json.loads(text)
        return cls(total, count, maximum)


def _memory_outputs(base, token_ids: torch.Tensor, layers: list[int]) -> torch.Tensor:
    """fp32 [T, K, d]: the memory FFN output of `layers` for each token (exactly what compute mode adds)."""
    x0 = base.embed_tokens(token_ids.unsqueeze(0))
    memory = base.memory
    if len(layers) == base.config.num_hidden_layers:
        out = memory(x0)
    elif any(param.device.type == "meta" for param in memory.parameters()):
        # offloaded by a device map: its hooks load the weights for `forward` only, which computes every layer
        out = memory(x0)[:, :, layers]
    else:
        out = memory.forward_layers(x0, layers)
    return out[0].float()


def _refuse_non_finite(values: torch.Tensor, ids: torch.Tensor) -> None:
    if not torch.isfinite(values).all():
        raise ValueError(f"export-tols: the model's FFNs on X0 give values that are not finite for tokens "
                         f"{ids[0].item()}..{ids[-1].item()}: the weights are damaged or the training diverged")


def _bases_sha256(bases: dict[int, torch.Tensor], layers: list[int]) -> str:
    """sha256 of the low-rank bases' bytes, layer by layer."""
    digest = hashlib.sha256()
    for layer in layers:
        digest.update(bases[layer].cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _rank_from_energy(eigenvalues_desc: torch.Tensor, energy: float) -> int:
    total = float(eigenvalues_desc.clamp_min(0).sum())
    if total == 0.0:
        return 1
    cumulative = torch.cumsum(eigenvalues_desc.clamp_min(0), 0) / total
    return int(torch.searchsorted(cumulative, torch.tensor(energy, dtype=cumulative.dtype) - 1e-12).item()) + 1


def _device_key(device: torch.device) -> tuple[str, int | None]:
    """`device` with the index a bare name stands for ("cuda": the current device; "mps": 0), for comparing devices."""
    if device.index is not None or device.type == "cpu":
        return device.type, device.index
    if device.type == "cuda" and torch.cuda.is_available():
        return device.type, torch.cuda.current_device()
    return device.type, 0


class _Exporter:
    def __init__(self, model, out_dir: str, fmt: TokenLookupFormat, batch_size: int, max_shard_size, device,
                 progress: bool):
        batch_size = _integer("batch_size", batch_size)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.base = _memory_base(model)
        if getattr(self.base, "memory", None) is None:
            if getattr(self.base.config, "token_memory_size", None) is None:
                raise ValueError(f"{type(model).__name__} has no FFNs on the token embeddings: token lookup tables are "
                                 "exported from MemoryLLM / FlexMemoryLLM models")
            raise ValueError("the model's memory FFN weights were dropped (model.model.memory is None): export needs "
                             "them; load the checkpoint again")
        # An adapter on the embedding: the table's values would hold its X0 and the fingerprint the weight alone, so
        # the model without the adapter would take the table.
        adapters = embedding_adapters(self.base.embed_tokens)
        if adapters:
            raise ValueError(f"export-tols: the token embedding has parameters that its weight does not hold "
                             f"({adapters[0]}: an adapter such as PEFT's LoRA); merge the adapter into the weight "
                             "(merge_and_unload) and export the table from the merged model")
        refuse_memory_adapters(self.base.memory)  # (the table would hold the values of whichever adapter is active)
        refuse_embedding_of_another_size(self.base, prefix="export-tols: ")
        max_shard_size = shard_size_bytes(max_shard_size)
        config = self.base.config
        self.vocab = config.vocab_size
        self.num_layers = config.num_hidden_layers
        self.hidden = config.hidden_size
        fmt.check_model(self.num_layers, self.hidden)
        self.fmt = fmt
        self.layers = fmt.kept_layers(self.num_layers)
        self.out_dir = out_dir
        self.batch_size = batch_size
        self.max_shard_size = max_shard_size
        self.device = execution_device(self.base.embed_tokens)
        if device is not None and _device_key(torch.device(device)) != _device_key(self.device):
            # (a model object is used where it is: moving it would change the caller's model behind its back)
            raise ValueError(f"device={str(device)!r} is not where the model computes ({self.device}): a loaded "
                             f"{type(model).__name__} is used where it is; pass device=None (or {str(self.device)!r}),"
                             f" move the model first (model.to({str(device)!r})), or pass its checkpoint directory")
        self.progress = progress
        self.fingerprint = weights_fingerprint(self.base)
        self.fingerprint_fp16 = weights_fingerprint(self.base, through=torch.float16)
        # the dtypes the values are computed in (bf16-loaded weights give other values than fp32 ones)
        parameters = [self.base.embed_tokens.weight, *self.base.memory.parameters()]
        self.model_dtypes = sorted({str(p.dtype).replace("torch.", "") for p in parameters})
        self.ranks: list[int] | None = None
        self.bases: dict[int, torch.Tensor] = {}
        self.bases_sha256: str | None = None  # of the low-rank bases' bytes: coefficients only fit these bases

    # -- plan ----------------------------------------------------------------------------------------------------------

    def _block_nbytes(self, rows: int) -> int:
        width = len(self.layers) * self.hidden
        if self.fmt.name == "lowrank":
            return rows * sum(self.ranks) * self.fmt.storage_dtype.itemsize
        if self.fmt.name == "int4":
            return rows * width // 2 + rows * (width // self.fmt.group_size) * SCALE_DTYPE.itemsize
        if self.fmt.name == "int8":
            return rows * width + rows * (width // self.fmt.group_size) * SCALE_DTYPE.itemsize
        return rows * width * self.fmt.storage_dtype.itemsize

    def plan(self) -> tuple[dict[str, list[str]], str]:
        """shard file -> tensor names (row blocks never split across shards), and the plan id."""
        units: dict[str, int] = {}
        if self.fmt.name == "lowrank":
            for layer, rank in zip(self.layers, self.ranks):
                units[basis_key(layer)] = rank * self.hidden * self.fmt.storage_dtype.itemsize
        starts = list(range(0, self.vocab, self.batch_size))
        for start in starts:
            units[block_keys(start)[0]] = self._block_nbytes(min(self.batch_size, self.vocab - start))
        self._check_shard_size(units)
        split = split_state_dict_into_shards_factory(units, get_storage_size=lambda nbytes: nbytes,
                                                     filename_pattern=SHARD_PATTERN, max_shard_size=self.max_shard_size)
        quantized = self.fmt.group_size is not None
        files: dict[str, list[str]] = {}
        for filename, keys in split.filename_to_tensors.items():
            files[filename] = [k for key in keys for k in ((key, key.replace("rows.", "scales.")) if quantized and key.startswith("rows.") else (key,))]
        plan_id = hashlib.sha256(json.dumps({
            "version": TABLE_FORMAT_VERSION, "inputs": self._plan_inputs(), "files": files, "ranks": self.ranks,
            "bases_sha256": self.bases_sha256,
        }, sort_keys=True).encode()).hexdigest()
        return files, plan_id

    def _check_shard_size(self, units: dict[str, int]) -> None:
        """Refuse a max_shard_size that one row block or low-rank basis exceeds (neither is split across shards, so
        its shard would be larger than the limit)."""
        key = max(units, key=units.get)
        nbytes = units[key]
        if nbytes <= self.max_shard_size:
            return
        if key.startswith("basis."):
            raise ValueError(f"max_shard_size={self.max_shard_size} bytes cannot hold the low-rank basis of layer "
                             f"{int(key.split('.')[1])} ({nbytes} bytes, never split across shards); allowed: "
                             f"max_shard_size >= {nbytes}, or a lower rank or energy")
        row_nbytes = self._block_nbytes(1)
        rows = self.max_shard_size // row_nbytes
        smaller = (f", or batch_size <= {rows} (tokens per block)" if rows
                   else f" (one token's row is {row_nbytes} bytes)")
        raise ValueError(f"max_shard_size={self.max_shard_size} bytes cannot hold one row block of batch_size="
                         f"{self.batch_size} tokens ({nbytes} bytes, never split across shards); allowed: "
                         f"max_shard_size >= {nbytes}{smaller}")

    # -- low-rank bases ------------------------------------------------------------------------------------------------

    def _fit_lowrank(self, bar) -> None:
        """Per kept layer: eigenvectors of the streamed Gram matrix T_l^T T_l = right singular vectors of T_l."""
        grams = torch.zeros(len(self.layers), self.hidden, self.hidden, dtype=torch.float64, device=self.device)
        for start in range(0, self.vocab, self.batch_size):
            ids = torch.arange(start, min(start + self.batch_size, self.vocab), device=self.device)
            values = _memory_outputs(self.base, ids, self.layers).double()  # [T, K, d]
            _refuse_non_finite(values, ids)
            grams += torch.einsum("tki,tkj->kij", values, values)
            bar(ids.numel(), "fitting low-rank bases")
        self.ranks, self.bases = [], {}
        for k, layer in enumerate(self.layers):
            eigenvalues, eigenvectors = torch.linalg.eigh(grams[k])
            eigenvalues, eigenvectors = eigenvalues.flip(0), eigenvectors.flip(1)
            rank = self.fmt.rank if self.fmt.rank is not None else _rank_from_energy(eigenvalues.cpu(), self.fmt.energy)
            self.ranks.append(int(rank))
            self.bases[layer] = eigenvectors[:, :rank].T.contiguous().to(self.fmt.storage_dtype)  # [r, d]
        self.bases_sha256 = _bases_sha256(self.bases, self.layers)

    def _load_lowrank(self, first_shard: str) -> bool:
        """Resume: reuse the bases stored in an existing first shard (coefficients already written depend on them)."""
        path = os.path.join(self.out_dir, first_shard)
        if not os.path.isfile(path):
            return False
        try:
            with safe_open(path, "pt") as handle:
                record = _shard_record(handle)
                if record.get("plan_inputs") != self._plan_inputs():
                    return False
                bases = {layer: handle.get_tensor(basis_key(layer)) for layer in self.layers}
        except Exception:  # unreadable: restart
            return False
        if _bases_sha256(bases, self.layers) != record.get("bases_sha256"):  # damaged since it was written: fit again
            return False
        self.bases = {layer: basis.to(self.device) for layer, basis in bases.items()}
        self.bases_sha256 = record["bases_sha256"]
        self.ranks = [self.bases[layer].shape[0] for layer in self.layers]
        return True

    def _plan_inputs(self) -> dict:
        """What the values depend on besides the low-rank bases and the shard layout."""
        return {"format": self.fmt.to_dict(), "fingerprint": self.fingerprint, "batch_size": self.batch_size,
                "model_dtypes": self.model_dtypes, "device_type": self.device.type}

    # -- blocks --------------------------------------------------------------------------------------------------------

    def _block(self, start: int) -> tuple[dict[str, torch.Tensor], _ErrorStats]:
        ids = torch.arange(start, min(start + self.batch_size, self.vocab), device=self.device)
        exact = _memory_outputs(self.base, ids, self.layers)  # [T, K, d] fp32
        flat = exact.reshape(ids.numel(), -1)
        rows_key, scales_key = block_keys(start)
        if self.fmt.name == "lowrank":
            coefficients = [exact[:, k] @ self.bases[layer].float().T for k, layer in enumerate(self.layers)]
            stored = torch.cat(coefficients, dim=1).to(self.fmt.storage_dtype)
            offsets = [0]
            for rank in self.ranks:
                offsets.append(offsets[-1] + rank)
            approx = torch.stack([stored[:, offsets[k]:offsets[k + 1]].float() @ self.bases[layer].float()
                                  for k, layer in enumerate(self.layers)], dim=1)
            tensors = {rows_key: stored}
        else:
            encoded = quantize_rows(flat, self.fmt)
            approx = dequantize_rows(encoded["rows"], encoded.get("scales"), self.fmt)
            tensors = {rows_key: encoded["rows"]}
            if "scales" in encoded:
                tensors[scales_key] = encoded["scales"]
        _refuse_non_finite(flat, ids)
        if not torch.isfinite(approx).all():  # (a value past the storage dtype's range, e.g. above 65504 in fp16)
            raise ValueError(f"export-tols: format {self.fmt.name!r} cannot hold the FFNs' outputs of tokens "
                             f"{ids[0].item()}..{ids[-1].item()} (largest magnitude {flat.abs().max().item():.4g}): "
                             f"export in 'bf16' or 'fp32'")
        stats = _ErrorStats()
        stats.add(row_relative_errors(flat, approx, self.hidden))
        return {k: v.cpu().contiguous() for k, v in tensors.items()}, stats

    # -- run -----------------------------------------------------------------------------------------------------------

    def run(self) -> dict:
        started = time.perf_counter()
        _refuse_another_checkpoint(self.out_dir, self.fingerprint, self.fingerprint_fp16)  # (before any work)
        total_work = self.vocab * (2 if self.fmt.name == "lowrank" else 1)
        bar = _progress(total_work, self.progress)
        resumed = False
        # (autocast off: the table's values depend on the weights and the export's settings alone, also when the
        # export is called inside a caller's `torch.autocast`: computed in the weights' dtype, projected in float32)
        with torch.no_grad(), autocast_off(self.device.type):
            if self.fmt.name == "lowrank":
                # the first shard (which holds the bases) decides: resume with its bases, or fit them again
                first = SHARD_PATTERN.format(suffix="")
                names = os.listdir(self.out_dir) if os.path.isdir(self.out_dir) else []
                candidates = [first] + sorted(n for n in names
                                              if n.startswith(OWN_FILE_PREFIX + "-00001-of-") and n.endswith(".safetensors"))
                if not any(self._load_lowrank(name) for name in candidates):
                    self._fit_lowrank(bar)
                else:
                    bar(self.vocab, "low-rank bases reused")
            files, plan_id = self.plan()  # (refuses a max_shard_size too small, before anything is written)
            os.makedirs(self.out_dir, exist_ok=True)
            index_path = os.path.join(self.out_dir, INDEX_NAME)
            old = index_metadata(index_path)
            recorded = old.get("shards", {}) if old.get("plan_id") == plan_id else {}
            kept: dict[str, _ErrorStats] = {}
            for filename in files:
                stats = self._existing_shard(os.path.join(self.out_dir, filename), plan_id, recorded.get(filename))
                if stats is not None:
                    kept[filename] = stats
            if recorded and len(kept) == len(files):
                bar.close()
                return self._report(old, time.perf_counter() - started, reused=True)
            to_write = {filename: keys for filename, keys in files.items() if filename not in kept}
            stale = self._stale_shards(set(files))
            if os.path.isfile(index_path) or stale or any(os.path.isfile(os.path.join(self.out_dir, name))
                                                          for name in to_write):
                # a refused export leaves the folder as it was: every value is checked before anything is replaced
                self._check_blocks(to_write, bar)
                if os.path.isfile(index_path):
                    os.remove(index_path)  # never leave an index over shards being replaced
                for name in stale:
                    os.remove(os.path.join(self.out_dir, name))
            shards: dict[str, dict] = {}
            table_stats = _ErrorStats()
            written: list[str] = []
            for filename, keys in files.items():
                path = os.path.join(self.out_dir, filename)
                if filename in kept:
                    resumed = True
                    table_stats.merge(kept[filename])
                    bar(sum(self._block_rows(k) for k in keys), f"kept {filename}")
                else:
                    try:
                        table_stats.merge(self._write_shard(path, keys, plan_id, bar))
                    except ValueError:  # refused (nothing was replaced): the shards written so far go too
                        for name in written:
                            os.remove(name)
                        raise
                    written.append(path)
                # (a kept shard that the index records was hashed by `_existing_shard` already)
                checked = filename in kept and filename in recorded
                shards[filename] = {"sha256": recorded[filename]["sha256"] if checked else shard_sha256(path),
                                    "size": os.path.getsize(path)}
            self._remove_temporaries()
            bar.close()
            dropped = len(self.fmt.drop_layers) * self.vocab  # a dropped layer's vector is entirely missing
            mean = (table_stats.total + dropped) / max(table_stats.count + dropped, 1)
            meta = {
                "format_version": TABLE_FORMAT_VERSION, "plan_id": plan_id, "format": self.fmt.to_dict(),
                "dtype": str(self.fmt.storage_dtype).replace("torch.", ""),
                "vocab_size": self.vocab, "num_hidden_layers": self.num_layers, "hidden_size": self.hidden,
                "layers": self.layers, "ranks": self.ranks, "rows_per_block": self.batch_size,
                "fingerprint": self.fingerprint, "fingerprint_fp16": self.fingerprint_fp16, "shards": shards,
                "error": {"max_relative": 1.0 if dropped else table_stats.max, "mean_relative": mean,
                          "max_relative_kept_layers": table_stats.max},
                "exporter": {"model_class": type(self.base).__name__, "torch": torch.__version__},
            }
            weight_map = {key: filename for filename, keys in files.items() for key in keys}
            # total_size: the tensors' bytes, as transformers and huggingface_hub count it (the files' sizes, headers
            # included, are in `token_lookup.shards`)
            index = {"metadata": {"total_size": _tensor_bytes(self.out_dir, files), "token_lookup": meta},
                     "weight_map": weight_map}
            # the report of the table this index replaces goes first (`export_tols` writes this export's own after
            # the held-out loss): an export stopped in between leaves no report of other settings beside the table
            report_path = os.path.join(self.out_dir, REPORT_NAME)
            if os.path.isfile(report_path):
                os.remove(report_path)
            _write_json_atomic(index_path, index)
        return self._report(meta, time.perf_counter() - started, reused=False, resumed=resumed)

    def _write_shard(self, path: str, keys: list[str], plan_id: str, bar) -> _ErrorStats:
        """Compute the blocks of one shard and write it; returns their error stats."""
        shard: dict[str, torch.Tensor] = {}
        stats = _ErrorStats()
        pending: dict[str, torch.Tensor] = {}
        for key in keys:
            if key.startswith("basis."):
                shard[key] = self.bases[int(key.split(".")[1])].cpu().contiguous()
                continue
            if key not in pending:
                pending, block_stats = self._block(int(key.split(".")[1]))
                stats.merge(block_stats)
                bar(self._block_rows(key), os.path.basename(path))
            shard[key] = pending.pop(key)
        # One metadata entry: safetensors writes a header's entries in an order that changes from one process to the
        # next, and a resumed export must give the same bytes as an uninterrupted one.
        record = {"plan": plan_id, "errors": stats.to_json(), "plan_inputs": self._plan_inputs()}
        if self.bases_sha256 is not None:
            record["bases_sha256"] = self.bases_sha256
        metadata = {SHARD_RECORD_KEY: json.dumps(record, sort_keys=True)}
        with atomic_output(path) as temporary:  # full disk, interrupt: no half-written file stays
            try:
                save_file(shard, str(temporary), metadata=metadata)
            except Exception as error:
                if type(error).__name__ == "SafetensorError":  # safetensors reports I/O errors this way
                    raise OSError(f"cannot write {path}: {error}") from error
                raise
        return stats

    def _check_blocks(self, files: dict[str, list[str]], bar) -> None:
        """Compute the blocks of `files` without writing them: raises where `_block` refuses a value."""
        rows = [self._block_rows(key) for keys in files.values() for key in keys]
        bar.extend(sum(rows))
        for keys in files.values():
            for key in keys:
                if key.startswith("rows."):
                    self._block(int(key.split(".")[1]))
                    bar(self._block_rows(key), "checking values")

    def _block_rows(self, key: str) -> int:
        if not key.startswith("rows."):
            return 0
        start = int(key.split(".")[1])
        return min(self.batch_size, self.vocab - start)

    def _existing_shard(self, path: str, plan_id: str, recorded: dict | None) -> _ErrorStats | None:
        """The error stats of a complete shard of this plan already on disk (resume), else None. A shard that an index
        of this plan records (`recorded`) is kept only with the size and sha256 recorded there (else it was damaged
        after the export, and is written again)."""
        if not os.path.isfile(path):
            return None
        if recorded is not None and (os.path.getsize(path) != recorded.get("size")
                                     or shard_sha256(path) != recorded.get("sha256")):
            return None
        try:
            read_safetensors_header(path)  # a shard cut short (its header needs more bytes than the file holds)
        except TokenLookupError:
            return None
        try:
            with safe_open(path, "pt") as handle:
                record = _shard_record(handle)
            if record.get("plan") != plan_id:
                return None
            return _ErrorStats.from_json(record["errors"])
        except Exception:  # damaged: rewrite it
            return None

    def _stale_shards(self, planned: set[str]) -> list[str]:
        """The shards in the folder that are not in the plan (of another export)."""
        return [name for name in os.listdir(self.out_dir)
                if name.startswith(OWN_FILE_PREFIX) and name.endswith(".safetensors") and name not in planned]

    def _remove_temporaries(self) -> None:
        """The temporary files a killed export left (`.token_lookup*.tmp`)."""
        for name in os.listdir(self.out_dir):
            if name.startswith("." + OWN_FILE_PREFIX) and name.endswith(".tmp"):
                os.remove(os.path.join(self.out_dir, name))

    def _report(self, meta: dict, seconds: float, reused: bool, resumed: bool = False) -> dict:
        return {"out_dir": self.out_dir, "format": meta["format"], "size_bytes": sum(s["size"] for s in meta["shards"].values()),
                "num_shards": len(meta["shards"]), "max_relative_error": meta["error"]["max_relative"],
                "mean_relative_error": meta["error"]["mean_relative"],
                "max_relative_error_kept_layers": meta["error"]["max_relative_kept_layers"],
                "ranks": meta.get("ranks"), "layers": meta["layers"], "seconds": seconds,
                "already_complete": reused, "resumed": resumed}


def index_metadata(path: str) -> dict:
    """The `token_lookup` metadata of the index at `path`; {} when there is none or it is not an index."""
    if not os.path.isfile(path):
        return {}
    with open(path) as handle:
        try:
            meta = json.load(handle)["metadata"]["token_lookup"]
        except (ValueError, KeyError, TypeError):
            return {}
    return meta if isinstance(meta, dict) else {}


def _saved_weight_map(folder: str) -> dict[str, str] | None:
    """Weight name -> the file of `folder` that holds it, from its safetensors weights (one file or an index, under
    the variant they were saved with, as `load_causal_lm` loads them); None where it has neither. Raises where they
    cannot be read (OSError, ValueError, KeyError, a SafetensorError)."""
    weights, weights_index = (os.path.join(folder, name) for name in weights_file_names(weights_variant(folder)))
    if os.path.isfile(weights_index):
        with open(weights_index, encoding="utf-8") as handle:
            return {key: os.path.join(folder, name) for key, name in json.load(handle)["weight_map"].items()}
    if os.path.isfile(weights):
        with safe_open(weights, "pt") as handle:
            return dict.fromkeys(handle.keys(), weights)
    return None


def _refuse_a_folder_without_plain_weights(out_dir: str) -> None:
    """A ValueError when `out_dir` is a checkpoint folder whose weights a model does not load as plain weights: FFN
    weights saved with adapters or int8 attached (`hf_memffn.adapters`, stored under `parametrizations.` names, which
    `from_pretrained` refuses), or a PEFT adapter (transformers loads its base model from elsewhere and adds it). A
    table exported there was written beside weights that no model loaded from the folder reads as they are:
    `checkpoint_fingerprints` reads neither as the weights they stand for, so nothing compared them with the model's."""
    if os.path.isfile(os.path.join(out_dir, PEFT_ADAPTER_CONFIG)):
        raise ValueError(f"export-tols: out_dir={out_dir!r} holds a PEFT adapter ({PEFT_ADAPTER_CONFIG}): a model "
                         "loaded from it is its base model with the adapter, whose weights the folder does not hold; "
                         "export into another directory, or merge the adapter (merge_and_unload) and save the merged "
                         "model there first (save_pretrained)")
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        return
    from safetensors import SafetensorError

    try:
        weight_map = _saved_weight_map(out_dir) or {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError):
        return  # (unreadable weights: `_refuse_another_checkpoint` takes the folder as it takes any such one)
    parametrized = sorted(key for key in weight_map if ".parametrizations." in key)
    if parametrized:
        raise ValueError(f"export-tols: out_dir={out_dir!r} is a checkpoint folder whose weights were saved with "
                         f"adapters or int8 attached (hf_memffn.adapters; {parametrized[0]}, {len(parametrized)} "
                         "tensors in all), which from_pretrained does not load as plain weights; export into another "
                         "directory, or merge them (adapters.merge_weight_lora) and save the model there first "
                         "(save_pretrained)")


def checkpoint_fingerprints(folder: str | os.PathLike) -> tuple[str, str] | None:
    """(`weights_fingerprint`, the same through fp16) of the MemoryLLM / FlexMemoryLLM weights saved in the checkpoint
    folder `folder`, read from its config.json and safetensors weights (the token embedding and the memory FFN only,
    read once); None where the folder holds no such checkpoint or its files cannot be read (no config.json, another
    architecture's weights, weights in another format)."""
    from safetensors import SafetensorError
    from transformers import AutoConfig

    folder = os.fspath(folder)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return None
    try:
        weight_map = _saved_weight_map(folder)
        if weight_map is None:
            return None
        # (saved from a causal LM or a task head: under "model."; from the base model: at the top)
        embeddings = [key for key in weight_map if key.endswith("embed_tokens.weight")]
        if len(embeddings) != 1:
            return None
        prefix = embeddings[0][:-len("embed_tokens.weight")]
        names = [key[len(prefix):] for key in weight_map if key.startswith(prefix + "memory.")]
        if not names:
            return None
        config = AutoConfig.from_pretrained(folder)

        def read(name: str) -> torch.Tensor:
            with safe_open(weight_map[prefix + name], "pt") as handle:
                return handle.get_tensor(prefix + name)

        named = [(name, lambda name=name: read(name)) for name in sorted(["embed_tokens.weight", *names])]
        fingerprint, fingerprint_fp16 = fingerprints(config, named, (None, torch.float16))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, SafetensorError):
        return None
    return fingerprint, fingerprint_fp16


def _refuse_another_checkpoint(out_dir: str, fingerprint: str, fingerprint_fp16: str) -> None:
    """A ValueError when `out_dir` is the checkpoint folder of other MemoryLLM / FlexMemoryLLM weights than those of
    `fingerprint` (`checkpoint_fingerprints`; a folder whose weights cannot be read is taken): a table exported there
    would replace the one the folder holds for its own weights, and its model would refuse the new one."""
    saved = checkpoint_fingerprints(out_dir)
    exported = {"fingerprint": fingerprint, "fingerprint_fp16": fingerprint_fp16}
    if saved is not None and not table_takes(exported, *saved):
        raise ValueError(f"export-tols: out_dir={out_dir!r} is the checkpoint folder of other weights than the "
                         "model's (the token embedding and memory FFN saved there differ from the model's): a table "
                         "exported there would replace any table the folder holds for its own weights, and a model "
                         "loaded from the folder would refuse it; export into another directory, or save the model "
                         "there first (save_pretrained)")


def _shard_record(handle) -> dict:
    """The export record a shard carries in its metadata: its plan id, error stats and plan inputs."""
    return json.loads((handle.metadata() or {}).get(SHARD_RECORD_KEY, "{}"))


def _tensor_bytes(directory: str, files) -> int:
    """The bytes of every tensor in the shards `files` of `directory` (from their headers)."""
    total = 0
    for name in files:
        _, header = read_safetensors_header(os.path.join(directory, name))
        total += sum(end - begin for key, info in header.items() if key != "__metadata__"
                     for begin, end in [info["data_offsets"]])
    return total


def _write_json_atomic(path: str, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True))


class _progress:
    """A tqdm bar when available and wanted, otherwise nothing."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="tok", desc="export-tols")
            except ImportError:  # pragma: no cover
                pass

    def extend(self, n: int) -> None:
        """`n` more units of work than planned."""
        if self.bar is not None and n:
            self.bar.total += n
            self.bar.refresh()

    def __call__(self, n: int, what: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------------------------------------------------
# Held-out loss


def heldout_loss(model, input_ids: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy of `model` on `input_ids` [B, L] (whatever mode the model is in)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            ids = input_ids[start:start + batch_size].to(device)
            logits = model(input_ids=ids).logits[:, :-1].float()
            targets = ids[:, 1:]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     reduction="sum")
            total += float(loss)
            count += targets.numel()
    return total / max(count, 1)


EVAL_ROW_TOKENS = 256  # tokens per row of an eval text (fewer where the model has fewer positions)


def text_to_input_ids(tokenizer, text: str, seq_len: int = EVAL_ROW_TOKENS) -> torch.Tensor:
    """Tokenize `text` and cut it into rows of `seq_len` tokens (the last partial row kept if it is the only one)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    if ids.numel() < 2:
        raise ValueError(f"eval text gives {ids.numel()} tokens; the held-out loss needs at least 2")
    rows = ids.numel() // seq_len
    if rows == 0:
        return ids.unsqueeze(0)
    return ids[:rows * seq_len].view(rows, seq_len)


def _checked_eval_input_ids(input_ids, model, what: str) -> torch.Tensor:
    """`input_ids` as int64 if it is an integer tensor [batch, length >= 2] of ids the model's table covers, else a
    ValueError naming `what` and what is allowed. Any integer dtype is taken (int32, the uint16 of token shards):
    the embedding and the loss take int64 ids, and a narrower dtype cannot hold `vocab_size` to compare with."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"{what} takes a tensor of token ids [batch, length]; got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise ValueError(f"{what} has dtype {input_ids.dtype}; allowed: integer token ids (torch.long)")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1 or input_ids.shape[1] < 2:
        raise ValueError(f"{what} has shape {tuple(input_ids.shape)}; allowed: [batch, length] with batch >= 1 and "
                         "length >= 2 (the held-out loss predicts each next token)")
    input_ids = input_ids.long()
    vocab_size = _memory_base(model).config.vocab_size
    outside = input_ids[(input_ids < 0) | (input_ids >= vocab_size)]
    if outside.numel():
        raise ValueError(f"{what} contains token id {outside[0].item()}: allowed ids are 0..{vocab_size - 1} (the "
                         "model's vocabulary; is the tokenizer the model's own?)")
    return input_ids


def lookup_loss_delta(model, table_dir: str, input_ids: torch.Tensor, placement: str | None = None) -> dict:
    """Held-out loss in compute mode and with the table at `table_dir`; the model is left reading the table it read
    before (computing its FFNs on X0 if none). Compute mode needs the memory FFN's weights: a model that dropped them
    (`drop_memory_ffn`) is refused before anything changes."""
    base = _memory_base(model)
    if getattr(base, "memory", None) is None:
        raise ValueError("lookup_loss_delta: the model's memory FFN weights were dropped (`drop_memory_ffn`), and the "
                         "loss in compute mode needs them; load the checkpoint again")
    previous = getattr(base, "token_lookup", None)
    device = base.embed_tokens.weight.device
    if placement is None:
        placement = "gpu" if device.type == "cuda" else "cpu"
    base.token_lookup = None
    try:
        compute = heldout_loss(model, input_ids)
        model.load_tols(table_dir, placement=placement, verify="size")
        lookup = heldout_loss(model, input_ids)
    finally:
        base.token_lookup = previous
    return {"loss_compute": compute, "loss_lookup": lookup, "loss_delta": lookup - compute,
            "eval_tokens": int(input_ids.numel())}


# ----------------------------------------------------------------------------------------------------------------------
# Public entry points


def _saved_auto_class(model_dir: str) -> str:
    """The Auto class that builds the class `model_dir` was saved from (its config's `architectures`) where that is a
    base model or a task head of this package whose causal LM would need a new LM head: the table needs the
    embedding and the memory FFNs only, and a causal LM built from such a folder draws a random head (reported as
    "lm_head.weight MISSING"). "AutoModelForCausalLM" otherwise (also for a folder whose config does not load here,
    such as a PEFT adapter's: `from_pretrained` names what is wrong with it)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
    except (OSError, ValueError):
        return "AutoModelForCausalLM"
    saved = auto_class_of((getattr(config, "architectures", None) or [None])[0])
    if saved is None or getattr(config, "tie_word_embeddings", False):  # (tied: the causal LM's head is saved)
        return "AutoModelForCausalLM"
    return saved


def refuse_without_lm_head(model, what: str, needs: str) -> None:
    """A ValueError naming `what` (an option or a function), what `needs` the LM head and the model's class where the
    model has none (a base model or a task head)."""
    unwrapped = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # (PEFT)
    if getattr(unwrapped, "get_output_embeddings", lambda: None)() is None:
        raise ValueError(f"{what}: {needs} needs a causal LM's next-token logits, and the model is a "
                         f"{type(unwrapped).__name__} (no LM head: a base model or a task head); allowed: a causal "
                         "LM (*ForCausalLM, or the folder of one)")


def _load_model(model_dir: str, device, dtype: str | None):
    """The model saved in `model_dir` (a base model or a task head loads as its own class: `_saved_auto_class`)."""
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = FLOAT_DTYPES[dtype]
    model = load_causal_lm(model_dir, auto_class=_saved_auto_class(model_dir), **kwargs)
    if device is not None:
        model.to(device)
    return model.eval()


def export_tols(model, out_dir: str | os.PathLike, *, format: str = "bf16", group_size: int | None = None,
                rank: int | None = None, energy: float | None = None, factor_dtype: str | None = None,
                drop_layers=(), batch_size: int = 1024, max_shard_size: int | str = "2GB", device=None,
                eval_input_ids: torch.Tensor | None = None, eval_text: str | None = None, tokenizer=None,
                progress: bool = True, push_to_hub: str | None = None, model_dtype: str | None = None) -> dict:
    """Compute and write the token lookup table of `model` (a model or a checkpoint directory) into `out_dir`.

    Returns a report (also written to `token_lookup_report.json`, strict JSON: a number that is not finite null and
    named under `not_finite`, see `hf_memffn.run_records`): size on disk, max / mean relative error of the table per
    (token, layer) vector, and, given eval text or ids, the held-out loss in compute and lookup mode.
    Exported into a checkpoint folder, the "Token lookup tables" section of the folder's model card is rewritten to
    say the folder holds the table (`model_card.refresh_lookup_section`; the report's `model_card` names the card).
    `device` is where a checkpoint directory is loaded; a loaded model is used where it is (another device is refused).
    """
    fmt = TokenLookupFormat(name=format, group_size=group_size, rank=rank, energy=energy,
                            factor_dtype="bf16" if factor_dtype is None else factor_dtype, drop_layers=drop_layers)
    if factor_dtype is not None and fmt.name != "lowrank":
        raise ValueError(f"factor_dtype={factor_dtype!r} applies only to format 'lowrank', not {fmt.name!r} (whose "
                         "stored dtype is the format itself)")
    max_shard_size = shard_size_bytes(max_shard_size)  # (before a model is loaded)
    if push_to_hub is not None:
        check_repo_id(push_to_hub, "push_to_hub")
    if not os.fspath(out_dir):
        raise ValueError("out_dir='' is an empty path; allowed: a directory (created if missing)")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"out_dir={os.fspath(out_dir)!r} is a file; allowed: a directory (created if missing)")
    _refuse_a_folder_without_plain_weights(os.fspath(out_dir))  # (before a model is loaded)
    if model_dtype is not None:
        check_choice("model_dtype", model_dtype, tuple(FLOAT_DTYPES))
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model_dtype={model_dtype!r} is the dtype a checkpoint directory is loaded in, and "
                             f"model is a loaded {type(model).__name__}: cast it (model.to(torch.bfloat16)) or pass "
                             "its directory")
    if eval_text is not None and eval_input_ids is not None:
        raise ValueError("eval_text and eval_input_ids both give the held-out tokens; pass one of them")
    if isinstance(model, (str, os.PathLike)):
        model_dir = os.fspath(model)
        model = _load_model(model_dir, device, model_dtype)
        if eval_text is not None and tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out_dir = os.fspath(out_dir)
    if eval_text is not None:  # (refused before anything is written)
        if tokenizer is None:
            raise ValueError("eval_text needs a tokenizer (pass tokenizer=, or a model directory that has one)")
        # (rows no longer than the positions the model was trained on: past them its loss is not the model's)
        max_positions = getattr(_memory_base(model).config, "max_position_embeddings", None) or EVAL_ROW_TOKENS
        eval_input_ids = text_to_input_ids(tokenizer, eval_text, seq_len=min(EVAL_ROW_TOKENS, max_positions))
    if eval_input_ids is not None:  # (the held-out loss runs after the export: its ids are checked before)
        refuse_without_lm_head(model, "eval_input_ids" if eval_text is None else "eval_text", "the held-out loss")
        eval_input_ids = _checked_eval_input_ids(eval_input_ids, model, "eval_input_ids" if eval_text is None
                                                 else "eval_text (tokenized)")
    modes = [(module, module.training) for module in model.modules()]  # (a model exported mid-training: put back)
    model.eval()
    try:
        report = _Exporter(model, out_dir, fmt, batch_size, max_shard_size, device, progress).run()
        if eval_input_ids is not None:
            report.update(lookup_loss_delta(model, out_dir, eval_input_ids))
    finally:
        for module, training in modes:
            module.training = training
    # (strict JSON: a held-out loss or error that is not finite is null, named under `not_finite`: `run_records`)
    write_atomic(os.path.join(out_dir, REPORT_NAME), run_record_json(report, indent=2, sort_keys=True))
    # Exported into a checkpoint folder: its model card (written at save time) now says the folder holds the table.
    if refresh_lookup_section(out_dir):
        report["model_card"] = os.path.join(out_dir, "README.md")
    if push_to_hub:
        report["hub_commit"] = push_table_to_hub(out_dir, push_to_hub)
    return report


# The files of a table at the top of a Hub repository (any export's shards, index and report), which a pushed table
# replaces; none of them matches a file in a subfolder (the demo's `token_lookup/fp32/`, a `token_lookup-int8/`):
# the Hub's patterns are fnmatch's, whose `*` also matches "/", so the shard numbers are digits (5 each, as
# huggingface_hub's sharding writes them).
SHARD_NUMBER = "[0-9]" * 5
HUB_TABLE_FILE_PATTERNS = [SHARD_PATTERN.format(suffix=""),
                           SHARD_PATTERN.format(suffix=f"-{SHARD_NUMBER}-of-{SHARD_NUMBER}"), INDEX_NAME, REPORT_NAME]


def table_files(out_dir: str) -> list[str]:
    """The files of the table exported into `out_dir`: its index, the shards the index lists, the report (a
    TokenLookupError where a shard the index lists is missing)."""
    shards = index_metadata(os.path.join(out_dir, INDEX_NAME)).get("shards")
    if not shards:
        raise TokenLookupError(f"no token lookup table in {out_dir}: {INDEX_NAME} is missing or not a table's index")
    missing = sorted(name for name in shards if not os.path.isfile(os.path.join(out_dir, name)))
    if missing:
        raise TokenLookupError(f"the token lookup table in {out_dir} is incomplete: {INDEX_NAME} names {missing}, "
                               "which are missing; run the export again")
    return sorted(table_file_names(out_dir, shards))


def push_table_to_hub(out_dir: str, repo_id: str, private: bool | None = None) -> str:
    """Upload the table of `out_dir` (index, shards, report) to the Hub repo `repo_id` in one commit, which also
    removes the files of a table pushed there before; returns the commit url. Only the table's own files go: not the
    remote code of a checkpoint folder (`token_lookup.py`), nor the tables in its subfolders."""
    from huggingface_hub import HfApi

    check_repo_id(repo_id)
    names = table_files(out_dir)
    api = HfApi()
    # (`create_repo` names the repository in full: "my-tols" becomes "<user>/my-tols")
    repo_id = getattr(api.create_repo(repo_id, exist_ok=True, private=private), "repo_id", repo_id)
    commit = api.upload_folder(folder_path=out_dir, repo_id=repo_id, allow_patterns=names,
                               delete_patterns=HUB_TABLE_FILE_PATTERNS, commit_message="Add token lookup table")
    return str(getattr(commit, "commit_url", commit))


def format_size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return str(nbytes)


# ----------------------------------------------------------------------------------------------------------------------
# CLI


def run(args: argparse.Namespace) -> int:
    drop = args.drop_layers
    device = args.device if args.device not in (None, "auto") else ("cuda" if torch.cuda.is_available() else "cpu")
    eval_text = None
    if args.eval_text:
        if os.path.isdir(args.model_dir) and not has_tokenizer(args.model_dir):
            raise UsageError(f"--eval-text needs a tokenizer, and MODEL_DIR {args.model_dir} has none (none of "
                             f"{', '.join(TOKENIZER_FILES)}): save the tokenizer with the model")
        with open(args.eval_text, "rb") as handle:
            data = handle.read()
        try:
            eval_text = decode_utf8(data, f"--eval-text {args.eval_text}")
        except ValueError as error:
            raise UsageError(str(error)) from None
    report = export_tols(args.model_dir, args.out_dir, format=args.format, group_size=args.group_size, rank=args.rank,
                         energy=args.energy, factor_dtype=args.factor_dtype, drop_layers=drop,
                         batch_size=args.batch_size, max_shard_size=args.max_shard_size, device=device,
                         eval_text=eval_text, progress=not args.no_progress, model_dtype=args.model_dtype)
    print(f"token lookup table ({report['format']['name']}) in {report['out_dir']}: "
          f"{format_size(report['size_bytes'])} in {report['num_shards']} shard(s), {report['seconds']:.1f} s")
    print(f"relative error per (token, layer): max {report['max_relative_error']:.3e}, "
          f"mean {report['mean_relative_error']:.3e}")
    if "model_card" in report:
        print(f"model card {report['model_card']}: says the folder holds the table")
    if "loss_delta" in report:
        print(f"held-out loss: compute {report['loss_compute']:.4f}, lookup {report['loss_lookup']:.4f}, "
              f"delta {report['loss_delta']:+.4f} ({report['eval_tokens']} tokens)")
    if args.push_to_hub:
        with hub_errors_in_one_line(f"push to {args.push_to_hub} failed (the table is in {report['out_dir']})"):
            commit = push_table_to_hub(report["out_dir"], args.push_to_hub)
        print(f"pushed the table to {args.push_to_hub}: {commit}")
    return 0
