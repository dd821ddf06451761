"""Triton kernels for the decoder around the FFN: RMSNorm and rotary position embeddings, forward and backward.

Written as PyTorch operations (`rms_norm.py`, `apply_rotary_pos_emb` in `modeling_memffn.py`), each of these is
several kernels over the whole activation in eager mode: the norm converts to float32, squares, averages, multiplies
and converts back (and the backward as many again); the rotation multiplies, negates, concatenates and adds. In a
training step of the 370M preset those element-wise kernels take more GPU time than all the matrix products. Here each
is one pass over its input:

* ``_rms_norm_forward_kernel``: ``y = w * round(x / rms(x))`` per row (float32 maths, the normalised row rounded to
  the input dtype before the weight multiplies it, as the PyTorch module does), and ``1 / rms(x)`` per row for the
  backward;
* ``_rms_norm_backward_kernel``: ``dx`` and per-program partial sums of ``dw`` (added up by the launcher, so the
  result is deterministic);
* ``_rotary_kernel``: ``y = x * cos + rotate_half(x) * sin`` for one head and a block of positions, and the transposed
  map for the backward; it reads ``x`` in the projection's ``[B, L, H, D]`` layout and writes ``[B, H, L, D]`` for the
  attention (and the reverse in the backward), so no transpose is copied.

All maths is float32; outputs are rounded once, to the dtype the PyTorch operations give (the input's; float32 for
16-bit heads rotated by the float32 tables of autocast, as for a 16-bit row scaled by a float32 norm weight), where the
PyTorch operations round after every step.
``decoder_kernels_unavailable`` says when they cannot run; the callers choose the path and report it.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from .configuration_memffn import DECODER_KERNELS
from .triton_launch import (INTERPRET_REQUESTED, KERNEL_DTYPES, any_size, cdiv, launch, next_power_of_2,
                            refuse_kernel_dtype)

try:
    import triton
    import triton.language as tl

    TRITON_AVAILABLE, TRITON_IMPORT_ERROR = True, None
except ImportError as exc:  # the package must import on machines without triton
    triton = tl = None
    TRITON_AVAILABLE, TRITON_IMPORT_ERROR = False, repr(exc)

_INTERPRET = TRITON_AVAILABLE and INTERPRET_REQUESTED

if TRITON_AVAILABLE:

    @triton.jit
    def _rms_norm_forward_kernel(X, W, Y, RSTD, num_rows, num_cols, stride_x, stride_y, eps,
                                 BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, STORE_RSTD: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        row_mask = rows < num_rows
        mask = row_mask[:, None] & (cols < num_cols)[None, :]
        x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / num_cols + eps)
        normalized = (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        weight = tl.load(W + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
        y = weight[None, :] * normalized
        tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
        if STORE_RSTD:
            tl.store(RSTD + rows, rstd, mask=row_mask)

    @triton.jit
    def _rms_norm_backward_kernel(DY, X, W, RSTD, DX, DW_PARTS, num_rows, num_cols, stride_dy, stride_x, stride_dx,
                                  rows_per_program, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """DW_PARTS [programs, num_cols] float32: this program's share of the weight gradient."""
        part = tl.program_id(0)
        cols = tl.arange(0, BLOCK_C)
        col_mask = cols < num_cols
        weight = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        grad_weight = tl.zeros([BLOCK_C], dtype=tl.float32)
        first = part * rows_per_program
        last = tl.minimum(first + rows_per_program, num_rows)
        for start in range(first, last, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            row_mask = rows < last
            mask = row_mask[:, None] & col_mask[None, :]
            rows64 = rows.to(tl.int64)[:, None]
            x = tl.load(X + rows64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            grad_y = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            x_hat = x * rstd[:, None]
            grad_weight += tl.sum(grad_y * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
            grad_x_hat = grad_y * weight[None, :]
            grad_x = rstd[:, None] * (grad_x_hat - x_hat * (tl.sum(grad_x_hat * x_hat, axis=1) / num_cols)[:, None])
            tl.store(DX + rows64 * stride_dx + cols[None, :], grad_x.to(DX.dtype.element_ty), mask=mask)
        tl.store(DW_PARTS + part * num_cols + cols, grad_weight, mask=col_mask)

    @triton.jit
    def _rotary_kernel(X, Y, X2, Y2, COS, SIN, seq_len, heads_first,
                       stride_xb, stride_xl, stride_xh, stride_yb, stride_yl, stride_yh,
                       stride_x2b, stride_x2l, stride_x2h, stride_y2b, stride_y2l, stride_y2h, stride_cb, stride_cl,
                       HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_L: tl.constexpr, TRANSPOSED: tl.constexpr):
        """One head, BLOCK_L positions: y = x * cos + rotate_half(x) * sin, or with TRANSPOSED the adjoint map (the
        backward: dx = dy * cos - rotate_half(dy * sin)); x and y are addressed by (batch, position, head) strides.
        The heads from ``heads_first`` on are those of a second tensor, X2 into Y2 (the keys beside the queries:
        one launch for both)."""
        positions = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
        head = tl.program_id(1).to(tl.int64)  # head x head stride reaches 2**31 in [B, H, L, D] tensors of 2**31+
        batch = tl.program_id(2).to(tl.int64)
        dims = tl.arange(0, HALF_P2)
        mask = (positions < seq_len)[:, None] & (dims < HALF)[None, :]
        rows = positions.to(tl.int64)[:, None]
        if head < heads_first:
            x_at = X + batch * stride_xb + head * stride_xh + rows * stride_xl + dims[None, :]
            y_at = Y + batch * stride_yb + head * stride_yh + rows * stride_yl + dims[None, :]
        else:
            x_at = X2 + batch * stride_x2b + (head - heads_first) * stride_x2h + rows * stride_x2l + dims[None, :]
            y_at = Y2 + batch * stride_y2b + (head - heads_first) * stride_y2h + rows * stride_y2l + dims[None, :]
        c_at = COS + batch * stride_cb + rows * stride_cl + dims[None, :]
        s_at = SIN + batch * stride_cb + rows * stride_cl + dims[None, :]
        x1 = tl.load(x_at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + HALF, mask=mask, other=0.0).to(tl.float32)
        cos1 = tl.load(c_at, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(c_at + HALF, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(s_at, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(s_at + HALF, mask=mask, other=0.0).to(tl.float32)
        if TRANSPOSED:
            y1 = x1 * cos1 + x2 * sin2
            y2 = x2 * cos2 - x1 * sin1
        else:
            y1 = x1 * cos1 - x2 * sin1
            y2 = x2 * cos2 + x1 * sin2
        tl.store(y_at, y1.to(Y.dtype.element_ty), mask=mask)
        tl.store(y_at + HALF, y2.to(Y.dtype.element_ty), mask=mask)

    # the builds that inference launches, compiled once whatever the number of tokens (`triton_launch.any_size`)
    _rms_norm_forward_any_size = any_size(_rms_norm_forward_kernel, "num_rows")
    _rotary_any_size = any_size(_rotary_kernel, "seq_len")


def decoder_kernels_unavailable(x: torch.Tensor, kernels: str) -> str | None:
    """Why the decoder's norm and rotation run as PyTorch operations for ``x`` under ``kernels`` (one of
    ``DECODER_KERNELS``), or None when the Triton kernels run. "auto" runs them on CUDA outside ``torch.compile``
    (a compiled graph fuses the PyTorch operations itself) for the dtypes of ``KERNEL_DTYPES``; "triton" insists and
    raises where they cannot run."""
    if kernels not in DECODER_KERNELS:
        raise ValueError(f"decoder_kernels={kernels!r} is not one of {DECODER_KERNELS}")
    if kernels == "torch":
        return "decoder_kernels='torch'"
    if x.dtype not in KERNEL_DTYPES:
        reason = (f"dtype {x.dtype} is not supported by the kernels, which compute in float32; allowed: float16, "
                  "bfloat16, float32")
    elif torch.compiler.is_compiling():
        reason = "torch.compile fuses the PyTorch operations itself"
    elif not TRITON_AVAILABLE:
        reason = f"triton is not importable ({TRITON_IMPORT_ERROR})"
    elif x.device.type != "cuda" and not _INTERPRET:
        reason = f"tensors are on {x.device.type}; the Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    else:
        return None
    if kernels == "triton":
        raise RuntimeError(f"decoder_kernels='triton' cannot run here: {reason}; use 'auto' or 'torch'")
    return reason


def decoder_kernels_path(x: torch.Tensor, kernels: str) -> str:
    """What the decoder's RMSNorm and rotary embedding run for ``x``, as one line."""
    reason = decoder_kernels_unavailable(x, kernels)
    return "Triton RMSNorm and rotary kernels" if reason is None else f"PyTorch RMSNorm and rotary ({reason})"


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------
NORM_TILE = 4096  # elements per row block of the norm kernels (rows per block = NORM_TILE // padded row width)


def _norm_blocks(num_cols: int) -> tuple[int, int]:
    block_c = next_power_of_2(num_cols)
    return max(1, NORM_TILE // block_c), block_c


def _norm_warps(block_c: int) -> int:
    return 4 if block_c <= 2048 else 8


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, keep_rstd: bool = True
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, 1 / rms per row float32) for ``x`` [..., N]; y has the dtype ``weight * x`` has in PyTorch. Without
    ``keep_rstd`` (inference) the second is None and is not written."""
    rows = x.reshape(-1, x.shape[-1])
    num_rows, num_cols = rows.shape
    y = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    rstd = torch.empty(num_rows, device=x.device, dtype=torch.float32) if keep_rstd else None
    if num_rows:
        block_r, block_c = _norm_blocks(num_cols)
        launch(  # without keep_rstd (inference): the build for any number of rows
            _rms_norm_forward_kernel if keep_rstd else _rms_norm_forward_any_size, (cdiv(num_rows, block_r),),
            rows, weight, y, rstd if keep_rstd else y, num_rows, num_cols, rows.stride(0), y.stride(0), eps,
            BLOCK_R=block_r, BLOCK_C=block_c, STORE_RSTD=keep_rstd, num_warps=_norm_warps(block_c),
        )
    return y.view(*x.shape[:-1], num_cols), rstd


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def rms_norm_backward(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx like x, dw like weight)."""
    rows = x.reshape(-1, x.shape[-1])
    grad_rows = grad_y.reshape(rows.shape)
    num_rows, num_cols = rows.shape
    grad_x = torch.empty_like(rows)
    if not num_rows:
        return grad_x.view(x.shape), torch.zeros_like(weight)
    block_r, block_c = _norm_blocks(num_cols)
    # about two programs per multiprocessor, each over a whole number of row blocks
    row_blocks = cdiv(num_rows, block_r)
    rows_per_program = block_r * cdiv(row_blocks, min(row_blocks, 2 * _num_sms(x.device)))
    programs = cdiv(num_rows, rows_per_program)
    parts = torch.empty(programs, num_cols, device=x.device, dtype=torch.float32)
    launch(
        _rms_norm_backward_kernel, (programs,),
        grad_rows, rows, weight, rstd, grad_x, parts, num_rows, num_cols, grad_rows.stride(0), rows.stride(0),
        grad_x.stride(0), rows_per_program, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=_norm_warps(block_c),
    )
    return grad_x.view(x.shape), parts.sum(0).to(weight.dtype)


class _RMSNormFunction(torch.autograd.Function):
    """The kernels' autograd; their backward is not differentiable again: a second derivative through it (a gradient
    of a gradient, `create_graph=True`) raises instead of leaving this function's share out."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = rms_norm_backward(grad_y.contiguous(), x, weight, rstd)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dimension by the Triton kernels (``x`` of a dtype of
    ``KERNEL_DTYPES``)."""
    if x.dim() == 0:
        raise ValueError("x of shape () has no rows to normalize: rms_norm takes x of one dimension or more")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight of shape {tuple(weight.shape)} does not match rows of width {x.shape[-1]}: it "
                         f"must be [{x.shape[-1]}]")
    if x.dtype not in KERNEL_DTYPES:
        refuse_kernel_dtype("rms_norm", "x", x.dtype)
    if weight.device != x.device:  # (the kernel reads both through x's device)
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}: the kernel reads both on one device")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFunction.apply(x, weight, eps)
    return rms_norm_forward(x, weight, eps, keep_rstd=False)[0]  # inference: no autograd node, one launch


ROTARY_BLOCK_L = 32


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, transposed: bool,
           second: tuple[torch.Tensor, torch.Tensor] | None = None, inference: bool = False) -> None:
    """Writes the rotation of ``x`` into ``out``, and with ``second = (x2, out2)`` that of ``x2`` into ``out2`` in the
    same launch; all are [B, L, H, D]-indexed views (any strides, dense last dimension; ``x2`` may have another
    number of heads), ``cos`` and ``sin`` [B or 1, L, D]. ``inference``: the kernel's build for any number of
    tokens."""
    batch, length, heads, dim = x.shape
    x2, out2 = second if second is not None else (x, out)
    heads_total = heads + x2.shape[2] if second is not None else heads
    if not length or not batch:
        return
    half = dim // 2
    cos_batch_stride = cos.stride(0) if cos.shape[0] > 1 else 0
    launch(
        _rotary_any_size if inference else _rotary_kernel, (cdiv(length, ROTARY_BLOCK_L), heads_total, batch),
        x, out, x2, out2, cos, sin, length, heads,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2),
        x2.stride(0), x2.stride(1), x2.stride(2), out2.stride(0), out2.stride(1), out2.stride(2),
        cos_batch_stride, cos.stride(1),
        HALF=half, HALF_P2=next_power_of_2(half), BLOCK_L=ROTARY_BLOCK_L, TRANSPOSED=transposed, num_warps=4,
    )


def _heads_first(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new [B, H, L, D] tensor of ``dtype``, returned as its [B, L, H, D] view."""
    batch, length, heads, dim = x.shape
    return torch.empty(batch, heads, length, dim, device=x.device, dtype=dtype).transpose(1, 2)


def _rotated_dtype(x: torch.Tensor, cos: torch.Tensor) -> torch.dtype:
    """The dtype of the rotation of ``x`` by tables ``cos``, as PyTorch's ``x * cos + rotate_half(x) * sin`` (Llama's)
    gives it: float32 for 16-bit heads and the float32 tables of autocast, so that the keys a cache takes have one
    dtype whichever path rotated them."""
    return torch.promote_types(x.dtype, cos.dtype)


class _RotaryFunction(torch.autograd.Function):
    """The kernel's autograd; once differentiable, as `_RMSNormFunction`."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        out = _heads_first(x, _rotated_dtype(x, cos))
        rotary(x, cos, sin, out, transposed=False)
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return out.transpose(1, 2)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        grad = grad_out.transpose(1, 2)  # [B, L, H, D] view
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        grad_x = torch.empty(grad.shape, device=grad.device, dtype=ctx.x_dtype)
        rotary(grad, cos, sin, grad_x, transposed=True)
        return grad_x, None, None


def _table_strides(table: torch.Tensor) -> tuple[int, int]:
    """The (batch, position) strides by which the kernel reads a [B or 1, L, D] table (0 for a batch of one)."""
    return table.stride(0) if table.shape[0] > 1 else 0, table.stride(1)


def _rotary_inputs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(x, cos, sin) with dense last dimensions and tables laid out alike (the kernel reads both by cos's strides),
    after checking that the tables fit ``x`` [B, L, H, D]."""
    if (x.dim() != 4 or x.shape[-1] % 2 or cos.dim() != 3 or sin.shape != cos.shape
            or cos.shape[0] not in (1, x.shape[0]) or tuple(cos.shape[1:]) != (x.shape[1], x.shape[-1])):
        raise ValueError(f"rotary tables of shape {tuple(cos.shape)} / {tuple(sin.shape)} do not match heads of shape "
                         f"{tuple(x.shape)} ([B, L, H, D], D even): they must be [B or 1, L, D]")
    if not x.device == cos.device == sin.device:  # (the kernel reads all three through x's device)
        raise ValueError(f"rotary tables on {cos.device} / {sin.device} but heads on {x.device}: the kernel reads "
                         "them on one device")
    x, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, cos, sin))
    if _table_strides(sin) != _table_strides(cos):
        cos, sin = cos.contiguous(), sin.contiguous()
    return x, cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, L, H, D] (the projection's layout) with ``cos``/``sin`` [B or 1, L, D]:
    returns a contiguous [B, H, L, D] tensor (the attention's layout) in the dtype of ``x * cos`` (float32 for 16-bit
    heads and float32 tables); ``x`` of a dtype of ``KERNEL_DTYPES``."""
    x, cos, sin = _rotary_inputs(x, cos, sin)
    if x.dtype not in KERNEL_DTYPES:
        refuse_kernel_dtype("rotate", "x", x.dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotaryFunction.apply(x, cos, sin)
    out = _heads_first(x, _rotated_dtype(x, cos))
    rotary(x, cos, sin, out, transposed=False, inference=True)
    return out.transpose(1, 2)


def rotate_pair(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotate` of the queries and of the keys ([B, L, H, D] and [B, L, H_kv, D]); without gradients to
    record (inference, decoding), one launch rotates both."""
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        return rotate(query, cos, sin), rotate(key, cos, sin)
    if key.dim() != 4 or key.shape[:2] != query.shape[:2] or key.shape[-1] != query.shape[-1]:
        raise ValueError(f"keys of shape {tuple(key.shape)} do not match queries of shape {tuple(query.shape)} "
                         "([B, L, H, D] and [B, L, H_kv, D])")
    if key.device != query.device:
        raise ValueError(f"keys on {key.device} but queries on {query.device}: one launch rotates both on one device")
    query, cos, sin = _rotary_inputs(query, cos, sin)
    for name, tensor in (("query", query), ("key", key)):
        if tensor.dtype not in KERNEL_DTYPES:
            refuse_kernel_dtype("rotate_pair", name, tensor.dtype)
    key = key if key.stride(-1) == 1 else key.contiguous()
    query_out, key_out = _heads_first(query, _rotated_dtype(query, cos)), _heads_first(key, _rotated_dtype(key, cos))
    rotary(query, cos, sin, query_out, transposed=False, second=(key, key_out), inference=True)
    return query_out.transpose(1, 2), key_out.transpose(1, 2)


__all__ = ["KERNEL_DTYPES", "decoder_kernels_unavailable", "decoder_kernels_path", "rms_norm", "rotate",
           "rotate_pair"]
