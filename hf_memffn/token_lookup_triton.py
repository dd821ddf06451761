"""Triton kernels of the token lookup runtime (`token_lookup.py`).

* `lookup_add_triton`: for each token, gather its stored row slice for one layer, dequantize it (float / int8 / int4
  with group-wise scales) and add it into the hidden state, in one pass: hidden is read once, the row slice once,
  the result written once.
* `gather_rows_triton`: gather whole rows (all layers) of many tokens into a device buffer, each row from the device
  cache when the token is cached, otherwise from the host table (pinned, mapped into the device address space).

Both are also registered as custom operators (`torch.ops.memffn_v2.token_lookup_add` / `token_lookup_gather_rows`)
so that `torch.compile` (any backend) sees them as single opaque ops; eager code launches the kernels directly, which
skips the dispatcher's overhead.

Triton is optional: without it `HAS_TRITON` is False and the runtime uses PyTorch (and says so in `kernel`).
"""

from __future__ import annotations

from typing import Optional

import torch

from .triton_launch import KERNEL_DTYPES, cdiv, launch, next_power_of_2, refuse_kernel_dtype, registered_operator

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only installs
    HAS_TRITON = False

FORMAT_CODES = {"fp32": 0, "fp16": 0, "bf16": 0, "int8": 1, "int4": 2}
# what the kernel reads as a quantized format's stored values (int4: two values per byte); float rows of any dtype
QUANTIZED_ROW_DTYPES = {"int8": torch.int8, "int4": torch.uint8}
ID_DTYPES = (torch.int32, torch.int64)

if HAS_TRITON:

    @triton.jit
    def _lookup_add_kernel(hidden_ptr, out_ptr, row_ids_ptr, rows_ptr, scales_ptr, row_stride, scale_stride,
                           column_offset, scale_offset, hidden_size,
                           GROUP: tl.constexpr, FORMAT: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < hidden_size
        row = tl.load(row_ids_ptr + token).to(tl.int64)
        hidden = tl.load(hidden_ptr + token.to(tl.int64) * hidden_size + offs, mask=mask).to(tl.float32)
        if FORMAT == 0:  # float row
            value = tl.load(rows_ptr + row * row_stride + column_offset + offs, mask=mask).to(tl.float32)
        elif FORMAT == 1:  # int8 with a scale per GROUP values
            q = tl.load(rows_ptr + row * row_stride + column_offset + offs, mask=mask).to(tl.float32)
            scale = tl.load(scales_ptr + row * scale_stride + scale_offset + offs // GROUP, mask=mask).to(tl.float32)
            value = q * scale
        else:  # int4: two values per byte, element 2i in the low nibble; stored as value + 8
            packed = tl.load(rows_ptr + row * row_stride + column_offset + offs // 2, mask=mask).to(tl.int32)
            q = ((packed >> ((offs % 2) * 4)) & 15) - 8
            scale = tl.load(scales_ptr + row * scale_stride + scale_offset + offs // GROUP, mask=mask).to(tl.float32)
            value = q.to(tl.float32) * scale
        tl.store(out_ptr + token.to(tl.int64) * hidden_size + offs, (hidden + value).to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _gather_rows_kernel(token_ids_ptr, slot_of_token_ptr, cache_ptr, table_ptr, out_ptr, width,
                            HAS_CACHE: tl.constexpr, BLOCK: tl.constexpr):
        index = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < width
        token = tl.load(token_ids_ptr + index).to(tl.int64)
        if HAS_CACHE:
            slot = tl.load(slot_of_token_ptr + token).to(tl.int64)
            if slot >= 0:
                values = tl.load(cache_ptr + slot * width + offs, mask=mask)
            else:
                values = tl.load(table_ptr + token * width + offs, mask=mask)
        else:
            values = tl.load(table_ptr + token * width + offs, mask=mask)
        tl.store(out_ptr + index.to(tl.int64) * width + offs, values, mask=mask)


OP_NAMESPACE = "memffn_v2"  # shared with flash_mhf_op.py; the op names differ


def _block(n: int) -> int:
    return min(1024, next_power_of_2(n))


def _require_dense(**tensors: torch.Tensor | None) -> None:
    """The gather kernel indexes rows as ``row * width``: refuse any other layout rather than read the wrong values."""
    for name, tensor in tensors.items():
        if tensor is not None and not (tensor.dim() == 2 and tensor.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous 2-D tensor; got shape {tuple(tensor.shape)}, strides "
                             f"{tensor.stride()}")


def lookup_add_triton(hidden: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor | None,
                      layer_position: int, hidden_size: int, format_name: str, group_size: int, *,
                      check_layout: bool = True) -> torch.Tensor:
    """hidden [..., d] + dequantized rows[row_ids[t], layer slice] for each token t (every position of hidden's leading
    dimensions, in order) -> a new tensor of hidden's shape and dtype (one of `KERNEL_DTYPES`), not a view of one.
    Differentiable in `hidden` (the rows are fixed values, which get no gradient).
    `check_layout=False` skips the checks of the arguments' shapes, dtypes and layer against each other (a few µs of
    host time): for a caller whose table was checked when it loaded, once per layer and step.

    `row_ids` [T] (T tokens: hidden's leading dimensions multiplied; int32 or int64, on hidden's device) must lie in
    0..rows.shape[0] - 1: the kernel reads the row at each id unchecked. The range is checked on the host where that
    costs no device synchronisation (ids in host memory), and for ids on a GPU only under Triton's debug mode
    (TRITON_DEBUG=1), where the check synchronises."""
    if not HAS_TRITON:
        raise RuntimeError("lookup_add_triton needs triton")
    if hidden.dtype not in KERNEL_DTYPES:
        refuse_kernel_dtype("lookup_add_triton", "hidden", hidden.dtype)
    # (once per layer and step, so each check is one call rather than `_require_dense`: the kernel reads the hidden
    # state as dense rows, and steps between a table's rows by their stride but reads each row's columns one after
    # another)
    if not hidden.is_contiguous():
        raise ValueError(f"hidden must be contiguous [..., hidden_size]; got strides {hidden.stride()}")
    for name, table in (("rows", rows), ("scales", scales)):
        if table is not None and (table.dim() != 2 or table.stride(1) != 1):
            raise ValueError(f"{name} must be a 2-D tensor whose columns are adjacent in memory (stride 1); got shape "
                             f"{tuple(table.shape)}, strides {table.stride()}")
    if hidden.device != rows.device:  # (the kernel would read the table's memory through the hidden state's device)
        raise ValueError(f"hidden is on {hidden.device} but the table's rows are on {rows.device}: a model whose "
                         "layers are spread over several devices (device_map) cannot add from one table")
    if check_layout:
        _check_lookup_add_layout(hidden, row_ids, rows, scales, layer_position, hidden_size, format_name, group_size)
    arguments = (hidden, row_ids, rows, scales, layer_position, hidden_size, FORMAT_CODES[format_name], group_size)
    if torch.is_grad_enabled() and hidden.requires_grad:  # (training the layers around a loaded table)
        return _LookupAddFunction.apply(*arguments)
    return _lookup_add(*arguments)


def _check_lookup_add_layout(hidden, row_ids, rows, scales, layer_position, hidden_size, format_name, group_size):
    """Refuses, by argument, what would make the add kernel read or write outside its tensors or misread them: it
    indexes the hidden state by `hidden_size`, a table row by the layer's slice and its scales by `group_size`. (Once
    per layer and step: each shape is read once, a tensor's attribute costing host time.)"""
    if format_name not in FORMAT_CODES:
        raise ValueError(f"format_name={format_name!r} is not one of {tuple(FORMAT_CODES)}")
    hidden_shape, rows_shape = hidden.shape, rows.shape
    if len(hidden_shape) < 2 or hidden_shape[-1] != hidden_size:
        raise ValueError(f"hidden must be [..., hidden_size={hidden_size}] with at least one leading dimension; got "
                         f"shape {tuple(hidden_shape)}")
    tokens = hidden.numel() // hidden_size
    if row_ids.shape != (tokens,) or row_ids.dtype not in ID_DTYPES:
        raise ValueError(f"row_ids must be a 1-D tensor of one id per token of hidden ({tokens}) of dtype "
                         f"int32 or int64; got shape {tuple(row_ids.shape)}, dtype {row_ids.dtype}")
    if row_ids.device != hidden.device:
        raise ValueError(f"row_ids are on {row_ids.device} but hidden is on {hidden.device}: the kernel reads both "
                         "on one device")
    quantized_dtype = QUANTIZED_ROW_DTYPES.get(format_name)
    if quantized_dtype is None:
        if not rows.is_floating_point():
            raise ValueError(f"rows of format {format_name!r} must be floating point; got dtype {rows.dtype}")
        if scales is not None:
            raise ValueError(f"scales must be None for format {format_name!r}, whose rows are stored as values; "
                             "scales come with the quantized formats int8 and int4")
        columns = hidden_size
    else:
        if rows.dtype != quantized_dtype:
            raise ValueError(f"rows of format {format_name!r} must have dtype {quantized_dtype}; got {rows.dtype}")
        if scales is None or not scales.is_floating_point():
            raise ValueError(f"format {format_name!r} needs scales, a floating-point [rows, groups] tensor; got "
                             f"{None if scales is None else scales.dtype}")
        if group_size < 1 or hidden_size % group_size or (format_name == "int4" and hidden_size % 2):
            raise ValueError(f"group_size={group_size} must be a positive divisor of hidden_size={hidden_size}"
                             + (", which int4 (two values per byte) needs even" if format_name == "int4" else ""))
        groups, scales_shape = hidden_size // group_size, scales.shape
        if (scales_shape[0] != rows_shape[0] or scales.device != rows.device
                or not 0 <= layer_position < scales_shape[1] // groups):
            raise ValueError(f"scales of shape {tuple(scales_shape)} on {scales.device} do not fit rows of shape "
                             f"{tuple(rows_shape)} on {rows.device}: they need one row per table row, on its device, "
                             f"and {groups} columns for each layer up to layer_position={layer_position}")
        columns = hidden_size // 2 if format_name == "int4" else hidden_size
    layers = rows_shape[1] // columns
    if not 0 <= layer_position < layers:
        raise ValueError(f"layer_position={layer_position} is outside the layers of rows of shape {tuple(rows_shape)} "
                         f"({columns} columns per layer): allowed 0..{layers - 1}")


def _check_id_range(name: str, ids: torch.Tensor, count: int, what: str) -> None:
    """Raises if `ids` (not empty) hold a value outside 0..count - 1. Reads the ids on the host: the callers check ids
    in host memory (no device synchronisation) and ids on a GPU only under Triton's debug mode."""
    low, high = (int(value) for value in torch.aminmax(ids))
    if low < 0 or high >= count:
        raise ValueError(f"{name} contains id {low if low < 0 else high}: allowed ids are 0..{count - 1} ({what})")


def _checks_ids_here(ids: torch.Tensor) -> bool:
    """Whether a launch checks the range of `ids` on the host first: ids in host memory, read without synchronising,
    or any ids under Triton's debug mode (TRITON_DEBUG=1), which accepts the synchronisation."""
    return ids.is_cpu or triton.knobs.runtime.debug


def _lookup_add(hidden, *table_arguments):
    if torch.compiler.is_compiling():
        # the operator takes hidden states [T, d], as every copy of this file registering it does (whichever copy is
        # imported first registers it: its meaning stays that of its namespace); a compiled graph's view is no
        # module output of its own
        hidden_size = table_arguments[4]
        flat = hidden.reshape(-1, hidden_size)
        return getattr(torch.ops, OP_NAMESPACE).token_lookup_add(flat, *table_arguments).view(hidden.shape)
    return _launch_lookup_add(hidden, *table_arguments)


class _LookupAddFunction(torch.autograd.Function):
    """The add's autograd: the output's gradient is the hidden state's, unchanged (the custom operator, which compiled
    graphs call inside this function's forward, has no autograd of its own)."""

    @staticmethod
    def forward(ctx, hidden, *table_arguments):
        return _lookup_add(hidden, *table_arguments)

    @staticmethod
    def backward(ctx, grad_out):
        return (grad_out,) + (None,) * 7  # (the row ids, the table's tensors and settings)


def _launch_lookup_add(hidden, row_ids, rows, scales, layer_position, hidden_size, fmt, group_size):
    out = torch.empty_like(hidden)  # (in hidden's shape: a layer's output, which FSDP2 asks not to be a view)
    tokens = hidden.numel() // hidden_size
    if tokens == 0:
        return out
    if _checks_ids_here(row_ids):
        _check_id_range("row_ids", row_ids, rows.shape[0], "the rows of the table")
    # (the kernel reads token t's row id at index t: a batch's `input_ids[:, -1:]`, flattened, is a strided view)
    row_ids = row_ids.contiguous()
    column_offset = layer_position * (hidden_size // 2 if fmt == 2 else hidden_size)
    scale_offset = layer_position * (hidden_size // group_size) if fmt else 0
    block = _block(hidden_size)
    grid = (tokens, cdiv(hidden_size, block))
    launch(_lookup_add_kernel, grid, hidden, out, row_ids, rows, scales if scales is not None else rows, rows.stride(0),
           scales.stride(0) if scales is not None else 0, column_offset, scale_offset, hidden_size,
           GROUP=group_size, FORMAT=fmt, BLOCK=block)
    return out


def gather_rows_triton(token_ids: torch.Tensor, slot_of_token: torch.Tensor | None, cache: torch.Tensor | None,
                       table: torch.Tensor) -> torch.Tensor:
    """Rows of `token_ids` [T] -> [T, width]: cache[slot_of_token[id]] when >= 0, else table[id]. `slot_of_token`
    [table rows] and `cache` [slots, width] come together or not at all.

    Ids must lie in 0..table.shape[0] - 1 and slots below cache.shape[0]: the kernel reads them unchecked; the ranges
    are checked as `lookup_add_triton` checks its row ids (on the host for ids in host memory, else under
    TRITON_DEBUG=1)."""
    if not HAS_TRITON:
        raise RuntimeError("gather_rows_triton needs triton")
    _require_dense(table=table, cache=cache)
    if token_ids.dim() != 1 or token_ids.dtype not in ID_DTYPES or token_ids.device != table.device:
        raise ValueError(f"token_ids must be a 1-D tensor of dtype int32 or int64 on the table's device "
                         f"({table.device}); got shape {tuple(token_ids.shape)}, dtype {token_ids.dtype} on "
                         f"{token_ids.device}")
    if (slot_of_token is None) != (cache is None):
        raise ValueError("slot_of_token and cache must be given together (a cache and where each token's row is in "
                         "it) or both be None")
    if slot_of_token is not None and (
            slot_of_token.shape != table.shape[:1] or slot_of_token.dtype not in ID_DTYPES
            or cache.shape[1] != table.shape[1] or cache.dtype != table.dtype
            or not slot_of_token.device == cache.device == table.device):
        raise ValueError(f"slot_of_token {tuple(slot_of_token.shape)} {slot_of_token.dtype} on {slot_of_token.device} "
                         f"and cache {tuple(cache.shape)} {cache.dtype} on {cache.device} do not fit table "
                         f"{tuple(table.shape)} {table.dtype} on {table.device}: slot_of_token must be int32 or int64 "
                         "with one slot per table row, cache of the table's width and dtype, all on one device")
    if torch.compiler.is_compiling():
        return getattr(torch.ops, OP_NAMESPACE).token_lookup_gather_rows(token_ids, slot_of_token, cache, table)
    return _launch_gather_rows(token_ids, slot_of_token, cache, table)


def _launch_gather_rows(token_ids, slot_of_token, cache, table):
    width = table.shape[1]
    out = torch.empty(token_ids.shape[0], width, dtype=table.dtype, device=token_ids.device)
    if token_ids.shape[0] == 0:
        return out
    has_cache = slot_of_token is not None
    if _checks_ids_here(token_ids):
        _check_id_range("token_ids", token_ids, table.shape[0], "the rows of the table")
        if has_cache:
            slots = slot_of_token.index_select(0, token_ids)
            if int(slots.max()) >= cache.shape[0]:
                raise ValueError(f"slot_of_token holds slot {int(slots.max())} for a token asked for: allowed slots "
                                 f"are negative (not cached) and 0..{cache.shape[0] - 1} (the rows of the cache)")
    block = _block(width)
    grid = (token_ids.shape[0], cdiv(width, block))
    token_ids = token_ids.contiguous()  # (read at their index, as the lookup-add kernel reads its row ids)
    launch(_gather_rows_kernel, grid, token_ids, slot_of_token if has_cache else token_ids,
           cache if has_cache else table, table, out, width, HAS_CACHE=has_cache, BLOCK=block)
    return out


# ----------------------------------------------------------------------------------------------------------------------
# Custom operators (registered once per process, whichever copy of this file is imported first)


def _register_ops():
    @torch.library.custom_op(f"{OP_NAMESPACE}::token_lookup_add", mutates_args=())
    def lookup_add_op(hidden: torch.Tensor, row_ids: torch.Tensor, rows: torch.Tensor, scales: Optional[torch.Tensor],
                      layer_position: int, hidden_size: int, format_code: int, group_size: int) -> torch.Tensor:
        return _launch_lookup_add(hidden, row_ids, rows, scales, layer_position, hidden_size, format_code, group_size)

    @lookup_add_op.register_fake
    def _(hidden, row_ids, rows, scales, layer_position, hidden_size, format_code, group_size):
        return torch.empty_like(hidden)

    @torch.library.custom_op(f"{OP_NAMESPACE}::token_lookup_gather_rows", mutates_args=())
    def gather_rows_op(token_ids: torch.Tensor, slot_of_token: Optional[torch.Tensor], cache: Optional[torch.Tensor],
                       table: torch.Tensor) -> torch.Tensor:
        return _launch_gather_rows(token_ids, slot_of_token, cache, table)

    @gather_rows_op.register_fake
    def _(token_ids, slot_of_token, cache, table):
        return table.new_empty(token_ids.shape[0], table.shape[1])


if HAS_TRITON and registered_operator(OP_NAMESPACE, "token_lookup_add") is None:
    _register_ops()
