"""Candidate variants of the FlashMHF backward kernels, timed against the production kernels by
``kernels/tune_flash_mhf.py`` (results and conclusions: ``kernels/flash_mhf_notes.md``). Two kernels computing all
or part of what ``_backward_weights_kernel`` in ``hf_memffn/flash_mhf_triton.py`` computes, and one computing the
whole backward, with compile-time switches for what was tried:

* ``weights_transposed``: the production orientation (each program owns ``BLOCK_N`` columns, the gradients accumulate
  transposed, ``[d_h, BLOCK_N]``). ``SHORT_LIVED`` consumes each activation tile as soon as it is complete; ``WITH_V``
  False leaves dV out (the dK/dU half of a two-kernel split).
* ``weights_columns``: each warp group owns its columns: the activations are computed transposed,
  ``[BLOCK_N, BLOCK_L] = K q^T``, and feed the gradient products ``[BLOCK_N, d_h] += act^T q`` from registers.
  ``GRADS`` is "ku" (dK, dU) or "v" (dV).
* ``backward_fused``: the weight-gradient kernel's programs also add their share of dq and dr to float32 buffers
  (``DQ_REDUCE`` "atomic" or "descriptor", ``DQ_HALVES``), so the activations are computed once for all gradients.

The first two take ``SEQUENCE_BLOCKS`` (row blocks counted per sequence, as production does, instead of over all
rows of the group) and ``GATE``: "rows" reads r [B, H, L, E] in each iteration; "transposed" reads r transposed to
[B, H, E, L] (contiguous along positions), each block's gates loaded one iteration ahead; "none" leaves the gate out (a
different function: only to time what the gate costs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from hf_memffn.flash_mhf_triton import (
    _column_block_tiles, _dot, _dot_acc, _row_block_gates, _row_block_tiles, _row_coordinates,
    _sequence_block_coordinates, _sigmoid,
)


@triton.jit
def _block_coordinates(row_block, group, total_rows, seq_len, group_size, num_heads, BLOCK_L: tl.constexpr,
                       SEQUENCE_BLOCKS: tl.constexpr):
    """(batch, head, position, row mask, rows of r [B, H, L, E]) of a row block, counted either way."""
    if SEQUENCE_BLOCKS:
        batch, head, _, position, row_mask, gate_row = _sequence_block_coordinates(
            row_block, group, seq_len, group_size, num_heads, BLOCK_L)
        batch, head = batch.to(tl.int64), head.to(tl.int64)
    else:
        rows = row_block * BLOCK_L + tl.arange(0, BLOCK_L)
        row_mask = rows < total_rows
        batch, head, position, gate_row = _row_coordinates(rows, group, seq_len, group_size, num_heads)
    return batch, head, position, row_mask, gate_row


@triton.jit
def _num_row_blocks(total_rows, seq_len, BLOCK_L: tl.constexpr, SEQUENCE_BLOCKS: tl.constexpr):
    """Row blocks of BLOCK_L rows: counted per sequence (SEQUENCE_BLOCKS) or over the flattened rows."""
    if SEQUENCE_BLOCKS:
        return (total_rows // seq_len) * tl.cdiv(seq_len, BLOCK_L)
    return tl.cdiv(total_rows, BLOCK_L)


@triton.jit
def _load_gate(R, row_block, group, total_rows, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
               BLOCK_L: tl.constexpr, SEQUENCE_BLOCKS: tl.constexpr, GATE: tl.constexpr):
    batch, head, position, row_mask, gate_row = _block_coordinates(
        row_block, group, total_rows, seq_len, group_size, num_heads, BLOCK_L, SEQUENCE_BLOCKS)
    if GATE == "transposed":
        offsets = ((batch * num_heads + head) * num_subnetworks + subnetwork) * seq_len + position
    else:
        offsets = gate_row * num_subnetworks + subnetwork
    return tl.load(R + offsets, mask=row_mask, other=0.0).to(tl.float32)


@triton.jit
def _block_tiles_and_gate(R, row_block, num_blocks, next_gate, group, total_rows, seq_len, group_size, num_heads,
                          num_subnetworks, subnetwork, stride_qb, stride_qh, stride_ql, stride_gb, stride_gh,
                          stride_gl, D_H: tl.constexpr, BLOCK_L: tl.constexpr, SEQUENCE_BLOCKS: tl.constexpr,
                          GATE: tl.constexpr):
    """q and dO tile offsets, row mask, this block's gates and (GATE "transposed") the next block's gates."""
    batch, head, position, row_mask, _ = _block_coordinates(
        row_block, group, total_rows, seq_len, group_size, num_heads, BLOCK_L, SEQUENCE_BLOCKS)
    dims = tl.arange(0, D_H)
    q_tile = (batch * stride_qb + head * stride_qh + position * stride_ql)[:, None] + dims[None, :]
    do_tile = (batch * stride_gb + head * stride_gh + position * stride_gl)[:, None] + dims[None, :]
    if GATE == "transposed":  # this block's gates were loaded in the previous iteration
        gate = next_gate
        next_gate = _load_gate(R, tl.minimum(row_block + 1, num_blocks - 1), group, total_rows, seq_len,
                               group_size, num_heads, num_subnetworks, subnetwork, BLOCK_L, SEQUENCE_BLOCKS, GATE)
    elif GATE == "rows":
        gate = _load_gate(R, row_block, group, total_rows, seq_len, group_size, num_heads, num_subnetworks,
                          subnetwork, BLOCK_L, SEQUENCE_BLOCKS, GATE)
    else:
        gate = next_gate  # unused
    return q_tile, do_tile, row_mask, gate, next_gate


@triton.jit
def weights_transposed(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    SEQUENCE_BLOCKS: tl.constexpr = False, GATE: tl.constexpr = "rows", SHORT_LIVED: tl.constexpr = False,
    WITH_V: tl.constexpr = True,
):
    group = tl.program_id(1)
    col0, subnetwork, weight_base, cols, dims, k_t, u_t, v_t = _column_block_tiles(
        K, U, V, group, num_subnetworks, D_E, D_H, BLOCK_N)
    num_blocks = _num_row_blocks(total_rows, seq_len, BLOCK_L, SEQUENCE_BLOCKS)
    grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_v = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    next_gate = _load_gate(R, 0, group, total_rows, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
                           BLOCK_L, SEQUENCE_BLOCKS, GATE)
    for row_block in range(0, num_blocks):
        q_tile, do_tile, row_mask, gate, next_gate = _block_tiles_and_gate(
            R, row_block, num_blocks, next_gate, group, total_rows, seq_len, group_size, num_heads, num_subnetworks,
            subnetwork, stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, D_H, BLOCK_L,
            SEQUENCE_BLOCKS, GATE)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        q_t = tl.trans(q)
        if SHORT_LIVED:
            # gate pre-activation, then dA (-> dU), then the up projection (-> dK, dV): at most three tiles live
            gate_pre = _dot(q, k_t, PRECISION)
            sig = _sigmoid(gate_pre, FAST_SIGMOID)
            silu = gate_pre * sig
            dsilu = (sig + silu * (1.0 - sig)) * gate[:, None]
            grad_hidden = _dot(grad_out, v_t, PRECISION)
            grad_u = _dot_acc(q_t, (grad_hidden * silu * gate[:, None]).to(q.dtype), grad_u, PRECISION)
            grad_hidden = grad_hidden * dsilu
            up = _dot(q, u_t, PRECISION)
            grad_k = _dot_acc(q_t, (grad_hidden * up).to(q.dtype), grad_k, PRECISION)
            if WITH_V:
                grad_v = _dot_acc(tl.trans(grad_out), (silu * up * gate[:, None]).to(q.dtype), grad_v, PRECISION)
        else:
            gate_pre = _dot(q, k_t, PRECISION)
            up = _dot(q, u_t, PRECISION)
            grad_hidden = _dot(grad_out, v_t, PRECISION) * gate[:, None]
            sig = _sigmoid(gate_pre, FAST_SIGMOID)
            silu = gate_pre * sig
            if WITH_V:
                grad_v = _dot_acc(tl.trans(grad_out), (silu * up * gate[:, None]).to(q.dtype), grad_v, PRECISION)
            grad_up = grad_hidden * silu
            grad_gate_pre = grad_hidden * up * (sig + silu * (1.0 - sig))
            grad_k = _dot_acc(q_t, grad_gate_pre.to(q.dtype), grad_k, PRECISION)
            grad_u = _dot_acc(q_t, grad_up.to(q.dtype), grad_u, PRECISION)
    w_offsets_t = weight_base + (col0 + cols)[None, :] * D_H + dims[:, None]
    tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
    tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))
    if WITH_V:
        tl.store(DV + w_offsets_t, grad_v.to(DV.dtype.element_ty))


@triton.jit
def weights_columns(
    Q, K, U, V, R, DO, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
    SEQUENCE_BLOCKS: tl.constexpr = False, GATE: tl.constexpr = "rows", GRADS: tl.constexpr = "v",
):
    block = tl.program_id(0)
    group = tl.program_id(1)
    col0 = block * BLOCK_N
    subnetwork = col0 // D_E
    dims = tl.arange(0, D_H)
    cols = tl.arange(0, BLOCK_N)
    w_offsets = group.to(tl.int64) * num_subnetworks * D_E * D_H + (col0 + cols)[:, None] * D_H + dims[None, :]
    k = tl.load(K + w_offsets)
    u = tl.load(U + w_offsets)
    num_blocks = _num_row_blocks(total_rows, seq_len, BLOCK_L, SEQUENCE_BLOCKS)
    if GRADS == "ku":
        v = tl.load(V + w_offsets)
        grad_k = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
        grad_u = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    else:
        grad_v = tl.zeros([BLOCK_N, D_H], dtype=tl.float32)
    next_gate = _load_gate(R, 0, group, total_rows, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
                           BLOCK_L, SEQUENCE_BLOCKS, GATE)
    for row_block in range(0, num_blocks):
        q_tile, do_tile, row_mask, gate, next_gate = _block_tiles_and_gate(
            R, row_block, num_blocks, next_gate, group, total_rows, seq_len, group_size, num_heads, num_subnetworks,
            subnetwork, stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, D_H, BLOCK_L,
            SEQUENCE_BLOCKS, GATE)
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        q_t = tl.trans(q)
        gate_pre = _dot(k, q_t, PRECISION)
        if GRADS == "ku":
            grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
            sig = _sigmoid(gate_pre, FAST_SIGMOID)
            silu = gate_pre * sig
            grad_hidden = _dot(v, tl.trans(grad_out), PRECISION) * gate[None, :]
            grad_u = _dot_acc((grad_hidden * silu).to(q.dtype), q, grad_u, PRECISION)
            up = _dot(u, q_t, PRECISION)
            grad_k = _dot_acc((grad_hidden * up * (sig + silu * (1.0 - sig))).to(q.dtype), q, grad_k, PRECISION)
        else:
            up = _dot(u, q_t, PRECISION)
            hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up
            if GATE != "none":
                hidden = hidden * gate[None, :]
            grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
            grad_v = _dot_acc(hidden.to(q.dtype), grad_out, grad_v, PRECISION)
    if GRADS == "ku":
        tl.store(DK + w_offsets, grad_k.to(DK.dtype.element_ty))
        tl.store(DU + w_offsets, grad_u.to(DU.dtype.element_ty))
    else:
        tl.store(DV + w_offsets, grad_v.to(DV.dtype.element_ty))


@triton.jit
def _add_grad_q(DQ, grad_q, sequence, first_position, position, row_mask, seq_len, dim0, d_h,
                WIDTH: tl.constexpr, BLOCK_L: tl.constexpr, DQ_REDUCE: tl.constexpr):
    """Adds grad_q [BLOCK_L, WIDTH] to columns dim0 .. dim0 + WIDTH of the rows of one sequence block of DQ."""
    if DQ_REDUCE == "descriptor":
        DQ.atomic_add([sequence.to(tl.int32), first_position, dim0], tl.reshape(grad_q, [1, BLOCK_L, WIDTH]))
    else:
        dims = dim0 + tl.arange(0, WIDTH)
        offsets = (sequence * seq_len + position)[:, None] * d_h + dims[None, :]
        tl.atomic_add(DQ + offsets, grad_q, mask=row_mask[:, None], sem="relaxed")


@triton.jit
def backward_fused(
    Q, K, U, V, R, DO, DQ, DR, DK, DU, DV,
    stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
    total_rows, seq_len, group_size, num_heads, num_subnetworks,
    D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
    FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, DQ_REDUCE: tl.constexpr = "atomic",
    DQ_HALVES: tl.constexpr = False,
):
    """The whole backward in one kernel: the weight-gradient kernel's programs (one per column block, streaming the
    row blocks per sequence) also add their share of dq = dM K_w + dN U_w and of dr[:, e] to float32 buffers
    (DQ contiguous [B, H, L, d_h], DR [B, H, L, E], both zeroed): 8 products per tile instead of 11 in the two
    kernels. DQ_REDUCE "atomic" adds dq with one atomic per element; "descriptor" with one bulk tensor reduction
    per tile (DQ is then a tensor descriptor over [B * H, L, d_h] with block [1, BLOCK_L, d_h], or d_h / 2 with
    DQ_HALVES). DQ_HALVES computes and adds dq in two halves of d_h, to hold half the registers."""
    group = tl.program_id(1)
    col0, subnetwork, weight_base, cols, dims, k_t, u_t, v_t = _column_block_tiles(
        K, U, V, group, num_subnetworks, D_E, D_H, BLOCK_N)
    k, u = tl.trans(k_t), tl.trans(u_t)
    if DQ_HALVES:
        half = tl.arange(0, D_H // 2)
        half_offsets = weight_base + (col0 + cols)[:, None] * D_H + half[None, :]
        k_lo, u_lo = tl.load(K + half_offsets), tl.load(U + half_offsets)
        k_hi, u_hi = tl.load(K + half_offsets + D_H // 2), tl.load(U + half_offsets + D_H // 2)
    blocks_per_sequence = tl.cdiv(seq_len, BLOCK_L)
    num_row_blocks = (total_rows // seq_len) * blocks_per_sequence

    grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    grad_v = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
    for row_block in range(0, num_row_blocks):
        q, grad_out, batch, head, position, row_mask = _row_block_tiles(
            Q, DO, row_block, group, seq_len, group_size, num_heads,
            stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, D_H, BLOCK_L, False)
        gate = _row_block_gates(R, row_block, group, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
                                BLOCK_L)
        gate_row = (batch * num_heads + head) * seq_len + position  # rows of r [B, H, L, E]

        gate_pre = _dot(q, k_t, PRECISION)
        up = _dot(q, u_t, PRECISION)
        grad_hidden = _dot(grad_out, v_t, PRECISION)
        sig = _sigmoid(gate_pre, FAST_SIGMOID)
        silu = gate_pre * sig
        hidden = silu * up
        tl.atomic_add(DR + gate_row * num_subnetworks + subnetwork, tl.sum(grad_hidden * hidden, axis=1),
                      mask=row_mask, sem="relaxed")
        grad_hidden = grad_hidden * gate[:, None]
        grad_v = _dot_acc(tl.trans(grad_out), (hidden * gate[:, None]).to(q.dtype), grad_v, PRECISION)
        grad_up = (grad_hidden * silu).to(q.dtype)
        grad_gate_pre = (grad_hidden * up * (sig + silu * (1.0 - sig))).to(q.dtype)
        q_t = tl.trans(q)
        grad_k = _dot_acc(q_t, grad_gate_pre, grad_k, PRECISION)
        grad_u = _dot_acc(q_t, grad_up, grad_u, PRECISION)
        sequence = batch * num_heads + head
        first_position = (row_block % blocks_per_sequence) * BLOCK_L
        if DQ_HALVES:
            grad_q = _dot_acc(grad_up, u_lo, _dot(grad_gate_pre, k_lo, PRECISION), PRECISION)
            _add_grad_q(DQ, grad_q, sequence, first_position, position, row_mask, seq_len, 0, D_H, D_H // 2,
                        BLOCK_L, DQ_REDUCE)
            grad_q = _dot_acc(grad_up, u_hi, _dot(grad_gate_pre, k_hi, PRECISION), PRECISION)
            _add_grad_q(DQ, grad_q, sequence, first_position, position, row_mask, seq_len, D_H // 2, D_H, D_H // 2,
                        BLOCK_L, DQ_REDUCE)
        else:
            grad_q = _dot_acc(grad_up, u, _dot(grad_gate_pre, k, PRECISION), PRECISION)
            _add_grad_q(DQ, grad_q, sequence, first_position, position, row_mask, seq_len, 0, D_H, D_H,
                        BLOCK_L, DQ_REDUCE)

    w_offsets_t = weight_base + (col0 + cols)[None, :] * D_H + dims[:, None]
    tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
    tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))
    tl.store(DV + w_offsets_t, grad_v.to(DV.dtype.element_ty))
