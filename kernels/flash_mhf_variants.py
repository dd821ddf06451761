"""Candidate variants of the FlashMHF weight-gradient kernel, timed against the production kernel by
``kernels/tune_flash_mhf.py`` (results and conclusions: ``kernels/flash_mhf_notes.md``). Each computes all or part of
what ``_backward_weights_kernel`` in ``hf_memffn/flash_mhf_triton.py`` computes:

* ``weights_short_lived``: the same kernel with each activation tile consumed as soon as it is complete;
* ``weights_ku_transposed`` / ``weights_ku_only`` + ``weights_v_only``: dK, dU and dV split over two kernels (two
  recomputed products more, fewer accumulators each), the first in the production orientation, the others with each
  program's warp groups owning their columns, the activations computed transposed and fed to the products from
  registers;
* ``weights_v_seq`` / ``weights_v_seq_rt`` / ``weights_seq_rt``: row blocks counted per sequence (as production now
  does), and r read transposed to [B, H, E, L] with the gates loaded one iteration ahead.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_memffn.flash_mhf_triton import _dot, _dot_acc, _row_coordinates, _sequence_block, _sigmoid


@triton.jit
def weights_short_lived(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """The dK/dU/dV kernel with each activation tile consumed as soon as it is complete: gate pre-activation,
    then dA (-> dU), then the up projection (-> dK, dV), so that at most three [BLOCK_L, BLOCK_N] tiles are live."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    split = tl.program_id(2)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    v = tl.load(V + w_offsets)
    num_row_blocks = tl.cdiv(total_rows, BLOCK_L)
    blocks_per_split = tl.cdiv(num_row_blocks, num_splits)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_row_blocks)
    grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_v = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    for row_block in range(first, last):
        rows = row_block * BLOCK_L + tl.arange(0, BLOCK_L)
        row_mask = rows < total_rows
        batch, head, position, gate_row = _row_coordinates(rows, group, seq_len, group_size, num_heads)
        q_tile = (batch * stride_qb + head * stride_qh + position * stride_ql)[:, None] + dims[None, :]
        do_tile = (batch * stride_gb + head * stride_gh + position * stride_gl)[:, None] + dims[None, :]
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
        q_t = tl.trans(q)
        gate_pre = _dot(q, tl.trans(k), PRECISION)
        sig = _sigmoid(gate_pre, FAST_SIGMOID)
        silu = gate_pre * sig
        dsilu = (sig + silu * (1.0 - sig)) * gate[:, None]
        grad_hidden = _dot(grad_out, tl.trans(v), PRECISION)
        grad_u = _dot_acc(q_t, (grad_hidden * silu * gate[:, None]).to(q.dtype), grad_u, PRECISION)
        grad_hidden = grad_hidden * dsilu
        up = _dot(q, tl.trans(u), PRECISION)
        grad_k = _dot_acc(q_t, (grad_hidden * up).to(q.dtype), grad_k, PRECISION)
        grad_v = _dot_acc(tl.trans(grad_out), (silu * up * gate[:, None]).to(q.dtype), grad_v, PRECISION)
    w_offsets_t = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[None, :] * D_H + dims[:, None]
    if ACCUMULATE:
        tl.atomic_add(DK + w_offsets_t, grad_k)
        tl.atomic_add(DU + w_offsets_t, grad_u)
        tl.atomic_add(DV + w_offsets_t, grad_v)
    else:
        tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
        tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))
        tl.store(DV + w_offsets_t, grad_v.to(DV.dtype.element_ty))


@triton.jit
def _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads, stride_b, stride_h, stride_l,
                       D_H: tl.constexpr, BLOCK_L: tl.constexpr):
    rows = row_block * BLOCK_L + tl.arange(0, BLOCK_L)
    row_mask = rows < total_rows
    batch, head, position, gate_row = _row_coordinates(rows, group, seq_len, group_size, num_heads)
    tile = (batch * stride_b + head * stride_h + position * stride_l)[:, None] + tl.arange(0, D_H)[None, :]
    return tile, row_mask, gate_row


@triton.jit
def weights_v_only(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dV alone, each program owning BLOCK_N columns: hidden^T [BLOCK_N, BLOCK_L] = (SiLU(K q^T) * U q^T) * r is
    computed transposed so that it feeds dV [BLOCK_N, d_h] += hidden^T dO straight from registers."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    grad_v = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    for row_block in range(0, tl.cdiv(total_rows, BLOCK_L)):
        q_tile, row_mask, gate_row = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                                        stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                           stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
        q_t = tl.trans(q)
        gate_pre = _dot(k, q_t, PRECISION)
        up = _dot(u, q_t, PRECISION)
        hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up * gate[None, :]
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        grad_v = _dot_acc(hidden.to(q.dtype), grad_out, grad_v, PRECISION)
    tl.store(DV + w_offsets, grad_v.to(DV.dtype.element_ty))


@triton.jit
def weights_ku_only(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dK and dU, each program owning BLOCK_N columns, with the activations transposed (as in weights_v_only)."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    v = tl.load(V + w_offsets)
    grad_k = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    grad_u = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    for row_block in range(0, tl.cdiv(total_rows, BLOCK_L)):
        q_tile, row_mask, gate_row = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                                        stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                           stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
        q_t = tl.trans(q)
        gate_pre = _dot(k, q_t, PRECISION)
        sig = _sigmoid(gate_pre, FAST_SIGMOID)
        silu = gate_pre * sig
        grad_hidden = _dot(v, tl.trans(grad_out), PRECISION) * gate[None, :]
        grad_u = _dot_acc((grad_hidden * silu).to(q.dtype), q, grad_u, PRECISION)
        up = _dot(u, q_t, PRECISION)
        grad_k = _dot_acc((grad_hidden * up * (sig + silu * (1.0 - sig))).to(q.dtype), q, grad_k, PRECISION)
    tl.store(DK + w_offsets, grad_k.to(DK.dtype.element_ty))
    tl.store(DU + w_offsets, grad_u.to(DU.dtype.element_ty))


@triton.jit
def weights_ku_transposed(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dK and dU with the production kernel's orientation (gradients accumulated transposed, [d_h, BLOCK_N])."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    v = tl.load(V + w_offsets)
    grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    for row_block in range(0, tl.cdiv(total_rows, BLOCK_L)):
        q_tile, row_mask, gate_row = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                                        stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _column_block_rows(row_block, group, total_rows, seq_len, group_size, num_heads,
                                           stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
        gate_pre = _dot(q, tl.trans(k), PRECISION)
        up = _dot(q, tl.trans(u), PRECISION)
        grad_hidden = _dot(grad_out, tl.trans(v), PRECISION) * gate[:, None]
        sig = _sigmoid(gate_pre, FAST_SIGMOID)
        silu = gate_pre * sig
        q_t = tl.trans(q)
        grad_k = _dot_acc(q_t, (grad_hidden * up * (sig + silu * (1.0 - sig))).to(q.dtype), grad_k, PRECISION)
        grad_u = _dot_acc(q_t, (grad_hidden * silu).to(q.dtype), grad_u, PRECISION)
    w_offsets_t = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[None, :] * D_H + dims[:, None]
    tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
    tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))


@triton.jit
def weights_v_seq(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, GATE: tl.constexpr = True,
):
    """weights_v_only with row blocks counted per sequence (scalar index arithmetic). GATE=False drops the gate
    (wrong result; for timing what the per-row gate costs)."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    grad_v = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    num_blocks = (total_rows // seq_len) * tl.cdiv(seq_len, BLOCK_L)
    for row_block in range(0, num_blocks):
        q_tile, row_mask, gate_row = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                                     stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                        stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        q_t = tl.trans(q)
        gate_pre = _dot(k, q_t, PRECISION)
        up = _dot(u, q_t, PRECISION)
        hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up
        if GATE:
            gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
            hidden = hidden * gate[None, :]
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        grad_v = _dot_acc(hidden.to(q.dtype), grad_out, grad_v, PRECISION)
    tl.store(DV + w_offsets, grad_v.to(DV.dtype.element_ty))


@triton.jit
def _sequence_gate_offsets(row_block, group, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
                           BLOCK_L: tl.constexpr):
    """Offsets into r transposed to [B, H, E, L] (contiguous along positions) of row block ``row_block``'s gates."""
    blocks_per_sequence = tl.cdiv(seq_len, BLOCK_L)
    sequence = row_block // blocks_per_sequence
    position0 = (row_block - sequence * blocks_per_sequence) * BLOCK_L
    batch = sequence // group_size
    head = group * group_size + (sequence - batch * group_size)
    positions = position0 + tl.arange(0, BLOCK_L)
    base = ((batch.to(tl.int64) * num_heads + head) * num_subnetworks + subnetwork) * seq_len
    return base + positions, positions < seq_len


@triton.jit
def weights_v_seq_rt(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """weights_v_seq reading r transposed to [B, H, E, L], each block's gates loaded one iteration ahead."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    grad_v = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    num_blocks = (total_rows // seq_len) * tl.cdiv(seq_len, BLOCK_L)
    gate_offsets, gate_mask = _sequence_gate_offsets(0, group, seq_len, group_size, num_heads, num_subnetworks,
                                                     subnetwork, BLOCK_L)
    next_gate = tl.load(R + gate_offsets, mask=gate_mask, other=0.0)
    for row_block in range(0, num_blocks):
        gate = next_gate.to(tl.float32)
        gate_offsets, gate_mask = _sequence_gate_offsets(tl.minimum(row_block + 1, num_blocks - 1), group, seq_len,
                                                         group_size, num_heads, num_subnetworks, subnetwork, BLOCK_L)
        next_gate = tl.load(R + gate_offsets, mask=gate_mask, other=0.0)
        q_tile, row_mask, _ = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                              stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                        stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        q_t = tl.trans(q)
        gate_pre = _dot(k, q_t, PRECISION)
        up = _dot(u, q_t, PRECISION)
        hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up * gate[None, :]
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        grad_v = _dot_acc(hidden.to(q.dtype), grad_out, grad_v, PRECISION)
    tl.store(DV + w_offsets, grad_v.to(DV.dtype.element_ty))


@triton.jit
def weights_seq_rt(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """weights_seq reading r transposed to [B, H, E, L], each block's gates loaded one iteration ahead."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    v = tl.load(V + w_offsets)
    grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_v = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    num_blocks = (total_rows // seq_len) * tl.cdiv(seq_len, BLOCK_L)
    gate_offsets, gate_mask = _sequence_gate_offsets(0, group, seq_len, group_size, num_heads, num_subnetworks,
                                                     subnetwork, BLOCK_L)
    next_gate = tl.load(R + gate_offsets, mask=gate_mask, other=0.0)
    for row_block in range(0, num_blocks):
        gate = next_gate.to(tl.float32)
        gate_offsets, gate_mask = _sequence_gate_offsets(tl.minimum(row_block + 1, num_blocks - 1), group, seq_len,
                                                         group_size, num_heads, num_subnetworks, subnetwork, BLOCK_L)
        next_gate = tl.load(R + gate_offsets, mask=gate_mask, other=0.0)
        q_tile, row_mask, _ = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                              stride_qb, stride_qh, stride_ql, D_H, BLOCK_L)
        do_tile, _, _ = _sequence_block(row_block, group, seq_len, group_size, num_heads,
                                        stride_gb, stride_gh, stride_gl, D_H, BLOCK_L)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        gate_pre = _dot(q, tl.trans(k), PRECISION)
        up = _dot(q, tl.trans(u), PRECISION)
        grad_hidden = _dot(grad_out, tl.trans(v), PRECISION) * gate[:, None]
        sig = _sigmoid(gate_pre, FAST_SIGMOID)
        silu = gate_pre * sig
        hidden = silu * up * gate[:, None]
        grad_v = _dot_acc(tl.trans(grad_out), hidden.to(q.dtype), grad_v, PRECISION)
        grad_up = grad_hidden * silu
        grad_gate_pre = grad_hidden * up * (sig + silu * (1.0 - sig))
        q_t = tl.trans(q)
        grad_k = _dot_acc(q_t, grad_gate_pre.to(q.dtype), grad_k, PRECISION)
        grad_u = _dot_acc(q_t, grad_up.to(q.dtype), grad_u, PRECISION)
    w_offsets_t = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[None, :] * D_H + dims[:, None]
    tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
    tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))
    tl.store(DV + w_offsets_t, grad_v.to(DV.dtype.element_ty))
