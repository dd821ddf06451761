"""ONNX export of models whose FFN runs the custom operator `memffn_v2::flash_mhf` (FlashMHFLlama).

The operator has no ONNX counterpart, so `torch.onnx.export(..., dynamo=True)` needs a translation of it:
`onnx_translation_table()` gives one, the operator's PyTorch reference decomposition written with ONNX ops (two
einsums over the sub-network weights, SiLU, the gate weights, one einsum back; in float32, cast back to the input's
dtype). Unlike the fused kernel it materialises the [B, H, L, E, d_e] activations. Pass it to torch's exporter:

    torch.onnx.export(model, (input_ids,), dynamo=True, custom_translation_table=onnx_translation_table())

or call `export_onnx(model, input_ids, path)`, which exports the logits of `model(input_ids)` (give an example batch
of at least 2 sequences of at least 2 tokens: torch.export fixes a dynamic size seen as 1), and with
`with_attention_mask=True` takes an attention mask too, for left-padded batches. The other architectures export
without a table from torch's first, non-strict capture; a graph captured by Dynamo (strict `torch.export`) holds the
rotary tables' operator `memffn_v2::rotary_tables`, which the table translates too. Needs `pip install onnx
onnxscript`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from transformers import __version__ as transformers_version

from .atomic_write import temporary_name
from .flash_mhf_op import OP_NAMESPACE
from .modeling_memffn import ROTARY_TABLES_OP


def _flash_mhf_onnx(q, k, u, v, r, impl: str = "auto"):
    """`flash_mhf(q, k, u, v, r)` in ONNX ops: q [B, H, L, D], k/u/v [H_kv, E, d_e, D], r [B, H, L, E]."""
    from onnxscript import opset18 as op

    dims = [op.Shape(q, start=i, end=i + 1) for i in range(4)]  # B, H, L, D
    kv_heads = op.Shape(k, start=0, end=1)
    group = op.Div(dims[1], kv_heads)  # query heads per weight group
    grouped = op.Concat(dims[0], kv_heads, group, dims[2], op.Constant(value_ints=[-1]), axis=0)
    rows = op.Reshape(op.Cast(q, to=1), grouped)  # [B, H_kv, G, L, D] in float32
    gates = op.Reshape(op.Cast(r, to=1), grouped)  # [B, H_kv, G, L, E]
    key, up_w, value = (op.Cast(w, to=1) for w in (k, u, v))
    pre = op.Einsum(rows, key, equation="bhgld,hefd->bhglef")
    up = op.Einsum(rows, up_w, equation="bhgld,hefd->bhglef")
    hidden = op.Mul(op.Mul(op.Mul(pre, op.Sigmoid(pre)), up), op.Unsqueeze(gates, op.Constant(value_ints=[-1])))
    out = op.Einsum(hidden, value, equation="bhglef,hefd->bhgld")
    return op.CastLike(op.Reshape(out, op.Shape(q)), q)


def _rotary_tables_onnx(position_ids, inv_freq, scaling: float, dtype):
    """`rotary_tables(position_ids, inv_freq, scaling, dtype)` in ONNX ops: (cos, sin) [*position_ids.shape,
    2 * len(inv_freq)] of the float32 angles `position_ids * inv_freq`, scaled, in `dtype` (an ONNX data type)."""
    from onnxscript import opset18 as op

    angles = op.Mul(op.Unsqueeze(op.Cast(position_ids, to=1), op.Constant(value_ints=[-1])), op.Cast(inv_freq, to=1))
    both = op.Concat(angles, angles, axis=-1)
    scale = op.Constant(value_float=scaling)
    return op.Cast(op.Mul(op.Cos(both), scale), to=dtype), op.Cast(op.Mul(op.Sin(both), scale), to=dtype)


def onnx_translation_table() -> dict:
    """{operator of this package: its ONNX translation}, for `torch.onnx.export(..., custom_translation_table=...)`:
    FlashMHF's fused operator, and the rotary tables' operator that a graph captured by Dynamo holds (strict
    `torch.export`, which torch's ONNX exporter falls back to where the non-strict capture fails)."""
    namespace, rotary_tables = ROTARY_TABLES_OP.split("::")
    return {getattr(torch.ops, OP_NAMESPACE).flash_mhf.default: _flash_mhf_onnx,
            getattr(getattr(torch.ops, namespace), rotary_tables).default: _rotary_tables_onnx}


class _Logits(torch.nn.Module):
    """`input_ids -> logits`, or `(input_ids, attention_mask) -> logits` with each row's positions counted from its
    first unmasked token (as `generate()` counts them), so a left-padded row gets the logits of its sequence alone."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            return self.model(input_ids=input_ids, use_cache=False).logits
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits


def export_onnx(model, input_ids: torch.Tensor, path: str | os.PathLike, dynamic: bool = True,
                with_attention_mask: bool = False, **export_kwargs):
    """Export `input_ids -> logits` of a causal LM of this package (or of a sequence or token classification head)
    to an ONNX file at `path` (written to a temporary name, then renamed); batch and sequence length stay dynamic
    unless `dynamic=False`. With `with_attention_mask` the graph takes a second input, `attention_mask` ([batch,
    length], 1 for a token, 0 for left padding), and gives every row the logits of its unpadded sequence. Returns the
    ONNX program."""
    try:
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ImportError("export_onnx needs onnx and onnxscript, which are not installed: pip install "
                          "'hf-memffn[onnx]' (or pip install onnx onnxscript)") from exc
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"export_onnx: input_ids must be a tensor of token ids, got {type(input_ids).__name__}; "
                         "allowed: a torch.long or torch.int32 tensor [batch, length]")
    if input_ids.dim() != 2:
        raise ValueError(f"export_onnx: input_ids must be [batch, length], got shape {list(input_ids.shape)}")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise ValueError(f"export_onnx: input_ids must be token ids, got dtype {input_ids.dtype}; allowed: torch.long, "
                         "torch.int32")
    if input_ids.numel() == 0:  # (else torch.export fails on the empty sequence, strict and non-strict alike)
        raise ValueError(f"export_onnx: input_ids has no tokens (shape {list(input_ids.shape)}); allowed: at least one "
                         "sequence of one token (two sequences of two tokens with dynamic shapes)")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"export_onnx: path {str(path)!r} is a directory; allowed: a file path, e.g. model.onnx")
    if not path.parent.is_dir():
        raise ValueError(f"export_onnx: path {str(path)!r}: its folder {str(path.parent)!r} does not exist; allowed: "
                         "a file in an existing folder")
    _check_opset(export_kwargs.get("opset_version"))
    if getattr(model, "base_model", None) is model:
        raise ValueError(f"export_onnx: {type(model).__name__} is a base model (AutoModel), whose outputs have no "
                         "logits; allowed: a model with a head, e.g. AutoModelForCausalLM.from_pretrained(path)")
    unwrapped = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model  # (PEFT)
    if hasattr(unwrapped, "qa_outputs"):
        raise ValueError(f"export_onnx: {type(unwrapped).__name__} gives start and end logits, not `logits`; "
                         "allowed: a model whose outputs have logits (a causal LM, or a sequence or token "
                         "classification head)")
    offloaded = [name for name, tensor in (*model.named_parameters(), *model.named_buffers())
                 if tensor.device.type == "meta"]
    if offloaded:
        raise ValueError(f"export_onnx: {len(offloaded)} weights of the model are not in memory "
                         f"({', '.join(offloaded[:3])}{', ...' if len(offloaded) > 3 else ''} on the meta device: "
                         "offloaded to the CPU or disk by `device_map`, or never loaded), and a graph holds its "
                         "weights; load the model with every weight on one device, e.g. from_pretrained(path, "
                         "device_map='cpu')")
    rotary_types = {module.rope_type for module in model.modules()
                    if isinstance(getattr(module, "rope_type", None), str)}
    if any("dynamic" in rope_type for rope_type in rotary_types):
        raise ValueError("export_onnx: rope_type='dynamic' (config.rope_parameters) recomputes the rotary frequencies "
                         "on the host from the largest position id, which torch.export cannot trace; allowed rope "
                         "types: 'default', 'linear', 'yarn', 'longrope', 'llama3'")
    table = getattr(getattr(unwrapped, "model", unwrapped), "token_lookup", None)
    if table is not None and table.placement == "disk":
        raise ValueError("export_onnx: the model reads its token lookup table from the disk (placement='disk'), whose "
                         "rows an ONNX graph cannot hold; load the table with placement='cpu' (its rows become the "
                         "graph's weights), or export the computed memory FFN (unload_tols(), if its weights were "
                         "kept)")
    if table is not None and table.placement != "gpu" and table.device.type == "cuda":
        raise ValueError(f"export_onnx: the model reads its token lookup table from host memory on {table.device} "
                         f"(placement={table.placement!r}: a device cache and a Triton gather of host rows, which an "
                         "ONNX graph cannot hold); load the table with placement='gpu', or export the model on the "
                         "CPU with placement='cpu'")
    if dynamic and min(input_ids.shape) < 2:
        raise ValueError(f"export_onnx: with dynamic shapes input_ids needs batch and length of at least 2 "
                         f"(torch.export fixes a size seen as 1), got shape {list(input_ids.shape)}; or pass "
                         "dynamic=False")
    classifier = getattr(unwrapped, "auto_class_name", None) == "AutoModelForSequenceClassification"
    if (classifier and getattr(unwrapped.config, "pad_token_id", None) is None and not with_attention_mask
            and (dynamic or input_ids.shape[0] > 1)):
        # (else torch.export stops on the classifier's own refusal, inside a report that asks for a PyTorch issue)
        raise ValueError(f"export_onnx: {type(unwrapped).__name__} reads each sequence at its last token, found from "
                         "`attention_mask` or `config.pad_token_id`, and config.pad_token_id is None, so a graph of "
                         "input_ids alone cannot find it in a batch of several sequences; allowed: "
                         "with_attention_mask=True, or config.pad_token_id set (the tokenizer's pad token id)")
    inputs, names = (input_ids,), ["input_ids"]
    if with_attention_mask:
        # (a padded example row, so that tracing keeps the masking that an all-ones mask would let it drop)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, 0] = 0
        inputs, names = (input_ids, attention_mask), ["input_ids", "attention_mask"]
    if dynamic:
        batch, length = torch.export.Dim("batch"), torch.export.Dim("sequence")
        export_kwargs.setdefault("dynamic_shapes", tuple({0: batch, 1: length} for _ in inputs))
    _compute_long_context_frequencies(model)
    modes = [(module, module.training) for module in model.modules()]  # (put back after the export)
    # FlashMHF settings the graph must not hold, put back after the export: the fused layer (its Triton path, on CUDA)
    # is operators without an ONNX translation, so the layer's reference runs instead, its query norm and gates as
    # PyTorch operations around the translated op; the recomputation in token chunks (a training setting, on while
    # gradients are) would be traced with the chunks of the example's tokens, wrong at any other number of tokens
    settings = [(module, name, getattr(module, name)) for module in model.modules()
                for name in ("fused_layer", "recompute_chunk_tokens") if hasattr(module, name)]
    try:
        for module, name, _value in settings:
            setattr(module, name, False if name == "fused_layer" else 0)
        program = torch.onnx.export(_Logits(model).eval(), inputs, dynamo=True, input_names=names,
                                    output_names=["logits"], custom_translation_table=onnx_translation_table(),
                                    **export_kwargs)
    finally:
        for module, training in modes:
            module.training = training
        for module, name, value in settings:
            setattr(module, name, value)
    _save_atomic(program, path)
    return program


def _compute_long_context_frequencies(model) -> None:
    """LongRoPE's rotary embedding computes its long-context frequencies at its first forward past the original
    length and keeps them as an attribute (transformers' `dynamic_rope_update`). Computed during the export, that
    attribute is a tensor of the tracer's: the graph's constant folding fails on it, and the model keeps it, so its own
    logits past the original length are wrong afterwards. One eager forward of a position past that length computes
    them first; the frequency buffer gets its values back (the next forward picks them from the length anyway).
    A transformers whose LongRoPE swaps the buffer for the other set on the host (5.17 does; 5.25 picks the set in the
    graph, `torch.where`) cannot be traced past that choice: refused, with the model left as it was."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if getattr(module, "rope_type", None) != "longrope" or not isinstance(inv_freq, torch.Tensor):
            continue
        parameters = module.config.rope_parameters
        original_length = parameters.get("original_max_position_embeddings", module.config.max_position_embeddings)
        values = inv_freq.clone()
        with torch.no_grad():
            module(inv_freq.new_zeros(1, 1, 1), torch.tensor([[original_length]], device=inv_freq.device))
        if module.inv_freq is inv_freq:
            inv_freq.copy_(values)
            continue
        module.register_buffer("inv_freq", inv_freq, persistent=False)
        raise ValueError(f"export_onnx: rope_type='longrope' (config.rope_parameters): transformers "
                         f"{transformers_version} picks the rotary frequencies on the host from the largest position "
                         "id, which torch.export cannot trace (transformers 5.25 picks them in the graph); allowed "
                         "rope types here: 'default', 'linear', 'yarn', 'llama3'")


def _check_opset(opset_version) -> None:
    """A ValueError for an `opset_version` torch's exporter would not write: below 18 (the opset of its translations)
    it writes opset 18 anyway, above the version converter's newest it writes a graph whose ops are newer than the
    opset the file declares."""
    if opset_version is None:
        return
    try:
        from onnxscript.version_converter._version_converter import SUPPORTED_MAX_ONNX_OPSET as newest
        from onnxscript.version_converter._version_converter import SUPPORTED_MIN_ONNX_OPSET as oldest
    except ImportError:  # (onnxscript versions that keep them elsewhere)
        oldest, newest = 18, 23
    if type(opset_version) is not int or not oldest <= opset_version <= newest:
        raise ValueError(f"export_onnx: opset_version={opset_version!r} is not supported; allowed: an integer "
                         f"{oldest}..{newest}")


def _save_atomic(program, path: Path) -> None:
    """`program.save(path)` through a temporary folder next to `path`, so that the weights of a model saved with
    external data (over 1.5 GB) land in `<name>.data`, the file the graph names, and a failed save leaves nothing."""
    staging = temporary_name(path)
    staging.mkdir()
    try:
        program.save(staging / path.name)
        data = staging / f"{path.name}.data"
        if data.exists():  # (first: the graph is put in place once its weights are)
            os.replace(data, path.with_name(data.name))
        os.replace(staging / path.name, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
