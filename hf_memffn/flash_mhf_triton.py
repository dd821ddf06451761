"""Fused Triton kernels for the FlashMHF operator (see ``flash_mhf_op.py`` for the maths and the public API).

Layout. Every weight group ``g`` (``H / H_kv`` heads share it) is one matrix problem: its rows are the tokens of
all its heads and all batches (``B * (H / H_kv) * L`` rows of ``q``), its columns the flattened ``E * d_e``
sub-network units. Column block ``w`` of width ``BLOCK_N`` lies inside sub-network ``e = w * BLOCK_N // d_e``
(``BLOCK_N`` always divides ``d_e``), so one gate column ``r[:, e]`` scales a whole block.

Kernels (all accumulate in float32 and keep the ``[rows, E * d_e]`` activations on chip):

* ``_forward_kernel``: one program per (row block, weight group[, column split]); the ``q`` tile stays in
  registers/shared memory while the program streams ``K, U, V`` column blocks:
  ``M = q K_w^T, N = q U_w^T, O += (SiLU(M) * N * r_e) V_w``.
* ``_backward_rows_kernel`` (``dq``, ``dr``): one program per row block; streams the column blocks,
  recomputes ``M, N`` and ``dA = dO V_w^T`` and accumulates ``dq = dM K_w + dN U_w`` and ``dr[:, e]``.
* ``_backward_weights_kernel`` (``dK``, ``dU``, ``dV``): one program per column block; keeps the
  ``K_w, U_w, V_w`` tiles resident and streams the row blocks of each sequence, recomputing the activations as in
  the forward pass and accumulating the gradients transposed, ``dK_w^T += q^T dM`` (and likewise ``dU_w``, ``dV_w``),
  so that every product has ``d_h`` or ``BLOCK_L`` rows.

On Hopper, for 16-bit inputs at d_h = 128, all three kernels are replaced by the explicitly scheduled Gluon
kernels of ``flash_mhf_gluon.py`` where the problem is large enough (``forward_kernel``, ``row_gradient_kernel`` and
``weight_gradient_kernel`` decide, and ``flash_mhf_path`` reports it).

On Hopper and newer GPUs (and in the interpreter) the forward and weight-gradient kernels read the tiles they stream
(``K, U, V`` in the forward, ``q`` and ``dO`` in the weight gradients) through tensor descriptors, i.e. bulk tensor
copies: no per-thread addresses, which in the weight-gradient kernel frees the registers its three accumulators need.
Older GPUs read them through pointers (``_use_tensor_descriptors`` decides; the tests run both).

The backward is split in two kernels (recomputing ``M``, ``N``, ``dA`` in each) rather than one kernel with atomic
``dq`` adds: both accumulate in registers, write every output exactly once and are deterministic, and the one-kernel
version (``kernels/flash_mhf_variants.py``) is slower on an H100 (23 ms against 17 at the paper shape): its float32
``dq`` reductions cost more than the recomputation they save. When a problem has too few row (or column) blocks to
fill the GPU, the forward (or weight-gradient) kernel additionally splits its loop across programs that add float32
partial sums atomically, except while ``torch.use_deterministic_algorithms`` is on (``_auto_splits``): those sums
arrive in an order that changes from run to run, so the loop then runs unsplit and every output is written once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import types

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    TRITON_AVAILABLE, TRITON_IMPORT_ERROR, TRITON_VERSION = True, None, triton.__version__
except ImportError as exc:  # the package must import on machines without triton
    triton = tl = TensorDescriptor = None
    TRITON_AVAILABLE, TRITON_IMPORT_ERROR, TRITON_VERSION = False, repr(exc), None

from .flash_mhf_gluon import BLOCK_N as GLUON_BLOCK_N
from .flash_mhf_gluon import FORWARD_BLOCK_L as GLUON_FORWARD_BLOCK_L
from .flash_mhf_gluon import (
    descriptor_ready,
    gluon_forward,
    gluon_reason_for,
    gluon_rows_gradients,
    gluon_weight_gradients,
    multiprocessor_count,
    weight_descriptors,
)
from .triton_launch import COMPILE_OPTIONS, INTERPRET_REQUESTED, any_size, cdiv, launch, next_power_of_2

# Triton decides at decoration time whether kernels run in its interpreter, so this module records it once.
_INTERPRET = TRITON_AVAILABLE and INTERPRET_REQUESTED


def triton_interpreting() -> bool:
    """True when these kernels were created under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
    return _INTERPRET


# Autotuning re-runs only when this bucket changes: log2 of (weight groups x rows), clamped, so new sequence
# lengths reuse the tuned configuration of their size class.
_TUNE_BUCKET_MIN, _TUNE_BUCKET_MAX = 1 << 12, 1 << 18


# Smaller problems skip autotuning (its compile and benchmark cost would dominate) and use one fixed configuration.
_TUNE_MIN_WORK_ROWS = 1 << 14


def _tune_bucket(work_rows: int) -> int:
    bucket = 1 << max(work_rows - 1, 1).bit_length()
    return min(max(bucket, _TUNE_BUCKET_MIN), _TUNE_BUCKET_MAX)


def _largest_block_dividing(size: int, limit: int) -> int:
    block = limit
    while size % block:
        block //= 2
    return block


def _shared_memory_bytes(kernel: str, block_l: int, block_n: int, stages: int, head_dim: int, element_size: int) -> int:
    """Shared memory a launch needs (its resident tiles, ``stages`` copies of the tiles it streams, and 1 KB for
    barriers and small buffers; within ~0.5% of what the compiler reports at the paper shape), so that configurations
    that cannot run on this GPU for this dtype are never tried (float32 tiles are twice the size of bf16 ones)."""
    q_tile, weight_tile = block_l * head_dim, block_n * head_dim
    elements = {
        "forward": q_tile + stages * 3 * weight_tile,  # q resident; K, U, V streamed
        "rows": 2 * q_tile + stages * 3 * weight_tile,  # q, dO resident; K, U, V streamed
        "weights": stages * 2 * q_tile + 3 * weight_tile + block_l * block_n,  # q, dO streamed; K, U, V resident
    }[kernel]
    return elements * element_size + 1024


# When no candidate of _CANDIDATES fits (float32 tiles, or a GPU with less shared memory than an H100), the first of
# these that fits: slower, but they run.
_FALLBACK_CONFIGS = [(64, 32, 4, 2), (32, 16, 4, 2), (16, 16, 4, 1)]


def _fitting(kernel: str, shapes, head_dim: int, subnetwork_size: int, element_size: int, shared_memory: int | None):
    """The launch shapes (BLOCK_L, BLOCK_N, warps, stages) among ``shapes`` that divide d_e and fit in shared memory
    (``shared_memory`` None: no limit, the interpreter)."""
    return [
        shape for shape in shapes
        if subnetwork_size % shape[1] == 0
        and (shared_memory is None
             or _shared_memory_bytes(kernel, shape[0], shape[1], shape[3], head_dim, element_size) <= shared_memory)
    ]


if TRITON_AVAILABLE:

    @triton.jit
    def _sigmoid(x, FAST: tl.constexpr):
        if FAST:
            # sigmoid(x) = (1 + tanh(x / 2)) / 2 with the single-instruction hardware tanh (16-bit inputs only)
            t = tl.inline_asm_elementwise(
                "tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=tl.float32, is_pure=True, pack=1
            )
            return 0.5 * t + 0.5
        else:
            return tl.sigmoid(x)

    @triton.jit
    def _dot(a, b, PRECISION: tl.constexpr):
        # PRECISION == "interpret": the interpreter multiplies 16-bit floats wrongly, so it gets exact float32 copies
        if PRECISION == "interpret":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _dot_acc(a, b, acc, PRECISION: tl.constexpr):
        if PRECISION == "interpret":
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=PRECISION)

    @triton.jit
    def _row_coordinates(rows, group, seq_len, group_size, num_heads):
        """(batch, head, position, row of r) of rows ``rows`` of weight group ``group``.

        A group's rows run over (batch, head within the group, position)."""
        rows_per_batch = group_size * seq_len
        batch = (rows // rows_per_batch).to(tl.int64)
        within = rows % rows_per_batch
        head = (group * group_size + within // seq_len).to(tl.int64)
        position = (within % seq_len).to(tl.int64)
        gate_row = (batch * num_heads + head) * seq_len + position  # row of the contiguous r [B, H, L, E]
        return batch, head, position, gate_row

    @triton.jit
    def _sequence_block_coordinates(row_block, group, seq_len, group_size, num_heads, BLOCK_L: tl.constexpr):
        """(batch, head, first position, positions, row mask, rows of r) of row block ``row_block`` of weight group
        ``group`` when the blocks are counted per sequence (batch, head within the group): batch, head and the first
        position are scalars, so the index arithmetic is scalar, and the last block of each sequence is masked."""
        blocks_per_sequence = tl.cdiv(seq_len, BLOCK_L)
        sequence = row_block // blocks_per_sequence
        batch = sequence // group_size
        head = group * group_size + (sequence - batch * group_size)
        first_position = (row_block - sequence * blocks_per_sequence) * BLOCK_L
        position = (first_position + tl.arange(0, BLOCK_L)).to(tl.int64)
        gate_row = (batch.to(tl.int64) * num_heads + head) * seq_len + position  # row of the contiguous r [B, H, L, E]
        return batch, head, first_position, position, position < seq_len, gate_row

    @triton.jit
    def _weight_tiles(K, U, V, weight_base, col0, cols, dims, group, num_subnetworks, D_E: tl.constexpr,
                      D_H: tl.constexpr, TENSOR_DESCRIPTORS: tl.constexpr):
        """Rows col0 .. col0 + BLOCK_N of weight group ``group``'s K, U, V (each [E * d_e, d_h])."""
        if TENSOR_DESCRIPTORS:
            row = group * num_subnetworks * D_E + col0
            return K.load([row, 0]), U.load([row, 0]), V.load([row, 0])
        else:
            w_offsets = weight_base + (col0 + cols)[:, None] * D_H + dims[None, :]
            return tl.load(K + w_offsets), tl.load(U + w_offsets), tl.load(V + w_offsets)

    @triton.jit
    def _column_block_tiles(K, U, V, group, num_subnetworks, D_E: tl.constexpr, D_H: tl.constexpr,
                            BLOCK_N: tl.constexpr):
        """For a program owning column block ``program_id(0)`` of weight group ``group``: (first column, sub-network,
        offset of the group's weights, column and d_h ranges, and its K, U, V tiles transposed, [d_h, BLOCK_N]).
        The tiles are transposed once, before the row loop: a transpose inside the loop would copy them to shared
        memory every iteration (and keep them in registers throughout)."""
        col0 = tl.program_id(0) * BLOCK_N
        cols = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D_H)
        weight_base = group.to(tl.int64) * num_subnetworks * D_E * D_H
        k, u, v = _weight_tiles(K, U, V, weight_base, col0, cols, dims, group, num_subnetworks, D_E, D_H, False)
        return col0, col0 // D_E, weight_base, cols, dims, tl.trans(k), tl.trans(u), tl.trans(v)

    @triton.jit
    def _row_block_tiles(Q, DO, row_block, group, seq_len, group_size, num_heads,
                         stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, D_H: tl.constexpr,
                         BLOCK_L: tl.constexpr, TENSOR_DESCRIPTORS: tl.constexpr):
        """q and dO tiles [BLOCK_L, d_h] of row block ``row_block`` (counted per sequence) of weight group ``group``,
        and its (batch, head, positions, row mask). Q and DO are tensor descriptors with block [1, 1, BLOCK_L, d_h]
        (bulk copies: the copy engine zero-fills the positions past the sequence's end) or pointers with the given
        strides."""
        batch, head, first_position, position, row_mask, gate_row = _sequence_block_coordinates(
            row_block, group, seq_len, group_size, num_heads, BLOCK_L)
        if TENSOR_DESCRIPTORS:
            q = tl.reshape(Q.load([batch, head, first_position, 0]), [BLOCK_L, D_H])
            grad_out = tl.reshape(DO.load([batch, head, first_position, 0]), [BLOCK_L, D_H])
        else:
            batch, head = batch.to(tl.int64), head.to(tl.int64)
            dims = tl.arange(0, D_H)
            q_tile = (batch * stride_qb + head * stride_qh + position * stride_ql)[:, None] + dims[None, :]
            do_tile = (batch * stride_gb + head * stride_gh + position * stride_gl)[:, None] + dims[None, :]
            q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
            grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)
        return q, grad_out, batch, head, position, row_mask

    @triton.jit
    def _row_block_gates(R, row_block, group, seq_len, group_size, num_heads, num_subnetworks, subnetwork,
                         BLOCK_L: tl.constexpr):
        """Sub-network ``subnetwork``'s gates [BLOCK_L] (float32; 0 past the sequence's end) of row block
        ``row_block`` (counted per sequence) of weight group ``group``."""
        _, _, _, _, row_mask, gate_row = _sequence_block_coordinates(
            row_block, group, seq_len, group_size, num_heads, BLOCK_L)
        return tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)

    @triton.jit
    def _forward_kernel(
        Q, K, U, V, R, O,
        stride_qb, stride_qh, stride_ql, stride_ob, stride_oh, stride_ol,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
        D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
        FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
        TENSOR_DESCRIPTORS: tl.constexpr,
    ):
        """With TENSOR_DESCRIPTORS, K, U and V are tensor descriptors over [H_kv * E * d_e, d_h] with block
        [BLOCK_N, d_h] (bulk copies, no per-thread addresses); otherwise contiguous [H_kv, E, d_e, d_h] pointers."""
        pid_rows = tl.program_id(0)
        group = tl.program_id(1)
        split = tl.program_id(2)

        rows = pid_rows * BLOCK_L + tl.arange(0, BLOCK_L)
        row_mask = rows < total_rows
        batch, head, position, gate_row = _row_coordinates(rows, group, seq_len, group_size, num_heads)
        dims = tl.arange(0, D_H)
        q_rows = batch * stride_qb + head * stride_qh + position * stride_ql
        q = tl.load(Q + q_rows[:, None] + dims[None, :], mask=row_mask[:, None], other=0.0)

        weight_base = group.to(tl.int64) * num_subnetworks * D_E * D_H
        cols = tl.arange(0, BLOCK_N)
        num_blocks = num_subnetworks * (D_E // BLOCK_N)
        blocks_per_split = tl.cdiv(num_blocks, num_splits)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, num_blocks)

        acc = tl.zeros([BLOCK_L, D_H], dtype=tl.float32)
        for block in range(first, last):
            col0 = block * BLOCK_N
            subnetwork = col0 // D_E
            k, u, v = _weight_tiles(K, U, V, weight_base, col0, cols, dims, group, num_subnetworks, D_E, D_H,
                                    TENSOR_DESCRIPTORS)
            gate_pre = _dot(q, tl.trans(k), PRECISION)
            up = _dot(q, tl.trans(u), PRECISION)
            gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)
            hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up * gate[:, None]
            acc = _dot_acc(hidden.to(v.dtype), v, acc, PRECISION)

        out_ptrs = O + (batch * stride_ob + head * stride_oh + position * stride_ol)[:, None] + dims[None, :]
        if ACCUMULATE:
            tl.atomic_add(out_ptrs, acc, mask=row_mask[:, None])
        else:
            tl.store(out_ptrs, acc.to(O.dtype.element_ty), mask=row_mask[:, None])

    @triton.jit
    def _backward_rows_kernel(
        Q, K, U, V, R, DO, DQ, DR,
        stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, tune_bucket,
        D_H: tl.constexpr, D_E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
        FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """DQ has q's strides; stride_g* are those of DO."""
        pid_rows = tl.program_id(0)
        group = tl.program_id(1)

        rows = pid_rows * BLOCK_L + tl.arange(0, BLOCK_L)
        row_mask = rows < total_rows
        batch, head, position, gate_row = _row_coordinates(rows, group, seq_len, group_size, num_heads)
        dims = tl.arange(0, D_H)
        q_tile = (batch * stride_qb + head * stride_qh + position * stride_ql)[:, None] + dims[None, :]
        do_tile = (batch * stride_gb + head * stride_gh + position * stride_gl)[:, None] + dims[None, :]
        q = tl.load(Q + q_tile, mask=row_mask[:, None], other=0.0)
        grad_out = tl.load(DO + do_tile, mask=row_mask[:, None], other=0.0)

        weight_base = group.to(tl.int64) * num_subnetworks * D_E * D_H
        cols = tl.arange(0, BLOCK_N)
        subnetwork_ids = tl.arange(0, E_POW2)
        num_blocks = num_subnetworks * (D_E // BLOCK_N)

        grad_q = tl.zeros([BLOCK_L, D_H], dtype=tl.float32)
        grad_r = tl.zeros([BLOCK_L, E_POW2], dtype=tl.float32)
        for block in range(0, num_blocks):
            col0 = block * BLOCK_N
            subnetwork = col0 // D_E
            k, u, v = _weight_tiles(K, U, V, weight_base, col0, cols, dims, group, num_subnetworks, D_E, D_H, False)
            gate_pre = _dot(q, tl.trans(k), PRECISION)
            up = _dot(q, tl.trans(u), PRECISION)
            grad_hidden = _dot(grad_out, tl.trans(v), PRECISION)
            gate = tl.load(R + gate_row * num_subnetworks + subnetwork, mask=row_mask, other=0.0).to(tl.float32)

            sig = _sigmoid(gate_pre, FAST_SIGMOID)
            silu = gate_pre * sig
            grad_r_block = tl.sum(grad_hidden * silu * up, axis=1)
            grad_r += tl.where(subnetwork_ids[None, :] == subnetwork, grad_r_block[:, None], 0.0)
            grad_hidden = grad_hidden * gate[:, None]
            grad_up = grad_hidden * silu
            grad_gate_pre = grad_hidden * up * (sig + silu * (1.0 - sig))
            grad_q = _dot_acc(grad_gate_pre.to(k.dtype), k, grad_q, PRECISION)
            grad_q = _dot_acc(grad_up.to(u.dtype), u, grad_q, PRECISION)

        tl.store(DQ + q_tile, grad_q.to(DQ.dtype.element_ty), mask=row_mask[:, None])
        dr_ptrs = DR + gate_row[:, None] * num_subnetworks + subnetwork_ids[None, :]
        dr_mask = row_mask[:, None] & (subnetwork_ids[None, :] < num_subnetworks)
        tl.store(dr_ptrs, grad_r.to(DR.dtype.element_ty), mask=dr_mask)

    @triton.jit
    def _backward_weights_kernel(
        Q, K, U, V, R, DO, DK, DU, DV,
        stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, num_splits, tune_bucket,
        D_H: tl.constexpr, D_E: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr,
        FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
        TENSOR_DESCRIPTORS: tl.constexpr,
    ):
        """With TENSOR_DESCRIPTORS, Q and DO are tensor descriptors over [B, H, L, d_h] with block
        [1, 1, BLOCK_L, d_h] (bulk copies without per-thread addresses, which at BLOCK_L = 128 would take registers
        that the three accumulators need); otherwise pointers with the given strides."""
        group = tl.program_id(1)
        split = tl.program_id(2)
        col0, subnetwork, weight_base, cols, dims, k_t, u_t, v_t = _column_block_tiles(
            K, U, V, group, num_subnetworks, D_E, D_H, BLOCK_N)

        # row blocks are counted per sequence: (total_rows // seq_len) sequences of cdiv(seq_len, BLOCK_L) blocks
        num_row_blocks = (total_rows // seq_len) * tl.cdiv(seq_len, BLOCK_L)
        blocks_per_split = tl.cdiv(num_row_blocks, num_splits)
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, num_row_blocks)

        grad_k = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
        grad_u = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
        grad_v = tl.zeros([D_H, BLOCK_N], dtype=tl.float32)
        # each iteration loads the next row block's gates into registers as it starts, so the load has a whole
        # iteration to arrive (left to Triton's pipelining, it is issued at the end of an iteration and waited for at
        # the start of the next: 3% of this kernel's time at the paper shape)
        next_gate = _row_block_gates(R, tl.minimum(first, num_row_blocks - 1), group, seq_len, group_size, num_heads,
                                     num_subnetworks, subnetwork, BLOCK_L)
        for row_block in range(first, last):
            gate = next_gate
            next_gate = _row_block_gates(R, tl.minimum(row_block + 1, last - 1), group, seq_len, group_size,
                                         num_heads, num_subnetworks, subnetwork, BLOCK_L)
            q, grad_out, _, _, _, _ = _row_block_tiles(
                Q, DO, row_block, group, seq_len, group_size, num_heads,
                stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, D_H, BLOCK_L, TENSOR_DESCRIPTORS)

            # activations [BLOCK_L, BLOCK_N] as in the forward pass; the gradients accumulate transposed,
            # [D_H, BLOCK_N] = q^T @ [BLOCK_L, BLOCK_N], so every product has D_H or BLOCK_L rows. The order keeps
            # few [BLOCK_L, BLOCK_N] float32 tiles alive at once (the three accumulators need most registers):
            # dV is taken as soon as the hidden activations exist, and the up projection is folded into the
            # SiLU derivative before dO V^T is computed.
            q_t = tl.trans(q)
            gate_pre = _dot(q, k_t, PRECISION)
            sig = _sigmoid(gate_pre, FAST_SIGMOID)
            silu = gate_pre * sig
            silu_derivative = sig + silu * (1.0 - sig)
            up = _dot(q, u_t, PRECISION)
            grad_v = _dot_acc(tl.trans(grad_out), (silu * up * gate[:, None]).to(q.dtype), grad_v, PRECISION)
            up_silu_derivative = up * silu_derivative
            grad_hidden = _dot(grad_out, v_t, PRECISION) * gate[:, None]
            grad_k = _dot_acc(q_t, (grad_hidden * up_silu_derivative).to(q.dtype), grad_k, PRECISION)
            grad_u = _dot_acc(q_t, (grad_hidden * silu).to(q.dtype), grad_u, PRECISION)

        w_offsets_t = weight_base + (col0 + cols)[None, :] * D_H + dims[:, None]
        if ACCUMULATE:
            tl.atomic_add(DK + w_offsets_t, grad_k)
            tl.atomic_add(DU + w_offsets_t, grad_u)
            tl.atomic_add(DV + w_offsets_t, grad_v)
        else:
            tl.store(DK + w_offsets_t, grad_k.to(DK.dtype.element_ty))
            tl.store(DU + w_offsets_t, grad_u.to(DU.dtype.element_ty))
            tl.store(DV + w_offsets_t, grad_v.to(DV.dtype.element_ty))

    # ------------------------------------------------------------------------------------------------------
    # Autotuned variants (GPU only; the interpreter runs the plain kernels with one fixed configuration)
    # ------------------------------------------------------------------------------------------------------
    def _set_descriptor_blocks(nargs):
        """Autotuning pre-hook: the block shape of a tensor descriptor argument follows the configuration's."""
        for name, block in (("Q", [1, 1, nargs["BLOCK_L"]]), ("DO", [1, 1, nargs["BLOCK_L"]]),
                            ("K", [nargs["BLOCK_N"]]), ("U", [nargs["BLOCK_N"]]), ("V", [nargs["BLOCK_N"]])):
            descriptor = nargs.get(name)
            if isinstance(descriptor, TensorDescriptor):
                descriptor.block_shape = block + [descriptor.shape[-1]]

    def _config(block_l, block_n, warps, stages):
        return triton.Config({"BLOCK_L": block_l, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages,
                             pre_hook=_set_descriptor_blocks)

    # Candidate (BLOCK_L, BLOCK_N, num_warps, num_stages) per head_dim, from the sweeps of kernels/tune_flash_mhf.py on
    # an H100 (kernels/flash_mhf_notes.md; d_h 64 and 256: kernels/results/flash_mhf_tune_dh{64,256}.json). At d_h=128
    # every candidate keeps its accumulators in registers except the weight kernel's (128, 64, 8, 2), which spills a
    # few values and is still the fastest there; at d_h=256 the dq/dr kernel's (128, 32, 8, 2) spills too and is
    # still the fastest. Programs of 64 rows ran 2-4x faster with 4 warps than with 8 wherever the 4-warp launch
    # did not spill (with 8, two warp groups split each 64-row product).
    _CANDIDATES = {
        "forward": {
            64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
            128: [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)],
            256: [(128, 32, 8, 2), (128, 16, 8, 3), (64, 64, 8, 2)],
        },
        "rows": {
            64: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 2)],
            128: [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3)],
            256: [(128, 32, 8, 2), (128, 16, 8, 3), (64, 16, 4, 2)],
        },
        "weights": {
            64: [(64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 2)],
            128: [(128, 64, 8, 2), (64, 32, 4, 2)],
            256: [(64, 16, 4, 3), (64, 16, 4, 2)],
        },
    }

    def _configs(kernel: str):
        shapes = {shape for per_dim in _CANDIDATES[kernel].values() for shape in per_dim} | set(_FALLBACK_CONFIGS)
        return [_config(*shape) for shape in sorted(shapes)]

    def _pruner(kernel: str):
        def prune(configs, named_args, **kwargs):
            d_h, d_e = kwargs.get("D_H", named_args.get("D_H")), kwargs.get("D_E", named_args.get("D_E"))
            query = named_args["Q"]
            query = query.base if isinstance(query, TensorDescriptor) else query
            limit = _max_shared_memory(query.device)
            shapes = _fitting(kernel, _CANDIDATES[kernel].get(d_h, ()), d_h, d_e, query.element_size(), limit)
            if not shapes:
                shapes = _fitting(kernel, _FALLBACK_CONFIGS, d_h, d_e, query.element_size(), limit)[:1]
            if not shapes:
                raise ValueError(f"no FlashMHF {kernel} launch fits in {limit} bytes of shared memory "
                                 f"(head_dim={d_h}, subnetwork_size={d_e}, {query.dtype})")
            by_shape = {(c.kwargs["BLOCK_L"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages): c for c in configs}
            return [by_shape[shape] for shape in shapes]

        return prune

    _TUNE_KEY = ["D_H", "D_E", "tune_bucket"]
    _forward_tuned = triton.autotune(
        _configs("forward"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("forward")}
    )(_forward_kernel)
    # the builds that inference launches, compiled once whatever the number of tokens (`triton_launch.any_size`);
    # tuned per size class as training's, whose picks they share. One pick for every size would spare a prompt of a
    # new class the autotuner's benchmark, but the pick of the smallest class ran the larger ones up to 1.2x slower
    # (kernels/compare_inference_tuning.py)
    _forward_any_size = any_size(_forward_kernel, "total_rows", "seq_len", "num_splits")
    _forward_tuned_any_size = triton.autotune(
        _configs("forward"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("forward")}
    )(_forward_any_size)
    _backward_rows_tuned = triton.autotune(
        _configs("rows"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("rows")}
    )(_backward_rows_kernel)
    _backward_weights_tuned = triton.autotune(
        _configs("weights"), key=_TUNE_KEY, prune_configs_by={"early_config_prune": _pruner("weights")}
    )(_backward_weights_kernel)


# ----------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------
def _problem(q: torch.Tensor, k: torch.Tensor):
    """The launch sizes of these inputs (read-only; one object per shape, dtype and device: every call asks)."""
    return _problem_for(q.shape, k.shape, q.element_size(), q.device)


@functools.lru_cache(maxsize=256)
def _problem_for(q_shape, k_shape, element_size: int, device: torch.device):
    batch, num_heads, seq_len, head_dim = q_shape
    kv_heads, num_subnetworks, subnetwork_size, _ = k_shape
    group_size = num_heads // kv_heads
    return types.MappingProxyType(dict(
        kv_heads=kv_heads,
        num_subnetworks=num_subnetworks,
        subnetwork_size=subnetwork_size,
        head_dim=head_dim,
        total_rows=batch * group_size * seq_len,
        sizes=(batch * group_size * seq_len, seq_len, group_size, num_heads, num_subnetworks),
        element_size=element_size,
        shared_memory=_max_shared_memory(device),
    ))


def _max_shared_memory(device: torch.device) -> int | None:
    """Shared memory one program may use on ``device`` (None in the interpreter: no limit)."""
    if device.type != "cuda":
        return None
    return _max_shared_memory_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _max_shared_memory_of(device_index: int) -> int:
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _rows_dense(t: torch.Tensor) -> torch.Tensor:
    """The kernels read [B, H, L, d_h] tensors through (batch, head, position) strides; only d_h must be dense."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its storage span without gaps or overlaps, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _weight_descriptor(w: torch.Tensor, block_n: int):
    """Tensor descriptor over contiguous [H_kv, E, d_e, d_h] weights seen as [H_kv * E * d_e, d_h] rows, read in
    blocks of BLOCK_N rows."""
    rows = descriptor_ready(w.reshape(-1, w.shape[-1]))
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [block_n, w.shape[-1]])


def _sequence_descriptor(t: torch.Tensor, block_l: int):
    """Tensor descriptor over a [B, H, L, d_h] tensor (any strides), read in blocks of BLOCK_L positions of one
    sequence."""
    t = descriptor_ready(t)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_l, t.shape[-1]])


def _use_tensor_descriptors(device: torch.device, requested: bool | None) -> bool:
    """Whether the forward and weight-gradient kernels read their streamed tiles through tensor descriptors (bulk
    tensor copies, Hopper and newer; the interpreter emulates them) rather than per-thread pointers."""
    if requested is not None:
        return requested
    if _INTERPRET:
        return True
    return _capability_of(device) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _capability_of(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.lru_cache(maxsize=None)
def _kernel_flags(dtype: torch.dtype):
    """The kernels' precision flags for ``dtype`` (read-only)."""
    sixteen_bit = dtype in (torch.float16, torch.bfloat16)
    if _INTERPRET:
        return types.MappingProxyType(dict(FAST_SIGMOID=False, PRECISION="interpret"))
    return types.MappingProxyType(dict(FAST_SIGMOID=sixteen_bit, PRECISION="tf32" if sixteen_bit else "ieee"))


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small enough that the tests exercise the split loops
    return multiprocessor_count(device)


def _auto_splits(programs: int, loop_length: int, device: torch.device) -> int:
    """How many programs share one loop so that at least ~2 programs run per multiprocessor; 1 while
    ``torch.use_deterministic_algorithms`` is on (the programs of a split loop add their float32 partial sums
    atomically, in an order that changes from run to run)."""
    sms = _num_sms(device)
    if programs >= sms or torch.are_deterministic_algorithms_enabled():
        return 1
    return max(1, min(loop_length, cdiv(2 * sms, programs)))


def _fixed_config(kernel: str, problem: dict) -> dict:
    """Launch configuration for problems too small to autotune (and for the interpreter)."""
    head_dim, subnetwork_size, rows = problem["head_dim"], problem["subnetwork_size"], problem["total_rows"]
    block_l = 16 if rows <= 16 else (32 if rows <= 32 or _INTERPRET else 64)
    # widest column block that keeps the accumulators in registers (see _CANDIDATES)
    widest = {
        "forward": {64: 64, 128: 64, 256: 32},
        "rows": {64: 64, 128: 32, 256: 16},
        "weights": {64: 32, 128: 32, 256: 16},
    }[kernel][head_dim]
    warps = 8 if head_dim == 256 and kernel == "forward" else 4
    block_n = _largest_block_dividing(subnetwork_size, widest)
    # float32 tiles (or a GPU with less shared memory): narrower column blocks, then shorter row blocks
    element_size, limit = problem["element_size"], problem["shared_memory"]
    while limit is not None and _shared_memory_bytes(kernel, block_l, block_n, 2, head_dim, element_size) > limit:
        if block_n > 16:
            block_n //= 2
        elif block_l > 16:
            block_l //= 2
        else:
            break
    return dict(BLOCK_L=block_l, BLOCK_N=block_n, num_warps=warps, num_stages=2)


def _autotuned(problem: dict) -> bool:
    return not _INTERPRET and problem["total_rows"] * problem["kv_heads"] >= _TUNE_MIN_WORK_ROWS


# The configuration the autotuner picked for each launch key (the kernel, the tuning key, the dtypes and the reading
# mode). The first launch of a key goes through the autotuner, which tunes or looks its pick up; later launches go
# straight to the kernel with that configuration (through `triton_launch.launch`, which then launches the compiled
# kernel it keeps), without the autotuner's work per call (its key from the argument dictionary, the pre-hook's
# dictionary), about a fifth of the forward's host time.
_PICKED: dict = {}
# Held over a launch through the autotuner and the read of its pick: `best_config` is the pick of the autotuner's
# latest launch, which another thread's launch (another model, or another size class) replaces while this one runs.
_TUNING = threading.Lock()


def _launch_tuned(tuned, key: tuple, grid, *args, **kwargs) -> None:
    """``tuned[grid](*args, **kwargs)``, through the autotuner once per ``key`` and directly afterwards."""
    picked = _PICKED.get(key)
    if picked is None:
        with _TUNING:
            tuned[grid](*args, **kwargs, **COMPILE_OPTIONS)
            config = tuned.best_config
        _PICKED[key] = (config.all_kwargs(), config.pre_hook is not None)
        return
    config_kwargs, has_pre_hook = picked
    if has_pre_hook:  # the descriptors' block shapes follow the configuration's (what the autotuner's pre-hook does)
        _set_descriptor_blocks({**dict(zip(tuned.arg_names, args)), **config_kwargs})
    # the keyword arguments in the order the autotuner passes them: Triton's in-memory cache key spells the options
    # in that order, so another order compiles the picked configuration again
    options = {**kwargs, **COMPILE_OPTIONS, **config_kwargs}
    launch(tuned.fn, grid(options), *args, **options)


# The kernels that run as Gluon kernels where those apply (`gluon_kernels` narrows the set, for benchmarks that time
# the Triton kernels in place).
GLUON_ROLES = ("forward", "rows", "weights")
_gluon_roles = set(GLUON_ROLES)


@contextlib.contextmanager
def gluon_kernels(*roles: str):
    """Within the block, only ``roles`` (of ``GLUON_ROLES``) run as Gluon kernels where they apply; the others run
    their Triton kernels."""
    unknown = set(roles) - set(GLUON_ROLES)
    if unknown:
        raise ValueError(f"roles={sorted(unknown)}: expected some of {', '.join(GLUON_ROLES)}")
    global _gluon_roles
    before, _gluon_roles = _gluon_roles, set(roles)
    try:
        yield
    finally:
        _gluon_roles = before


def _chosen_kernels(q: torch.Tensor, k: torch.Tensor) -> tuple[str, str, str]:
    chosen = _kernels_for(q.shape, k.shape, q.dtype, q.device)
    return tuple(kernel if role in _gluon_roles else "triton" for role, kernel in zip(GLUON_ROLES, chosen))


def forward_kernel(q: torch.Tensor, k: torch.Tensor) -> str:
    """Which kernel computes the output for these inputs: ``"gluon"`` (``flash_mhf_gluon``, warp-specialised: Hopper,
    16-bit, d_h = 128, d_e a multiple of 64, problems large enough to autotune and to fill the GPU with one program
    per row block) or ``"triton"`` (``_forward_kernel``, everything else)."""
    return _chosen_kernels(q, k)[0]


def row_gradient_kernel(q: torch.Tensor, k: torch.Tensor) -> str:
    """Which kernel computes dq and dr for these inputs: ``"gluon"`` (``flash_mhf_gluon``, warp-specialised: Hopper,
    16-bit, d_h = 128, d_e a multiple of 64, problems large enough to autotune) or ``"triton"``
    (``_backward_rows_kernel``, everything else)."""
    return _chosen_kernels(q, k)[1]


def weight_gradient_kernel(q: torch.Tensor, k: torch.Tensor) -> str:
    """Which kernel computes dK, dU, dV for these inputs: ``"gluon"`` (``flash_mhf_gluon``: Hopper, 16-bit,
    d_h = 128, d_e a multiple of 64, problems large enough to autotune and to fill the GPU with one program per
    column block) or ``"triton"`` (``_backward_weights_kernel``, everything else)."""
    return _chosen_kernels(q, k)[2]


@functools.lru_cache(maxsize=256)
def _kernels_for(q_shape, k_shape, dtype: torch.dtype, device: torch.device) -> tuple[str, str, str]:
    """(forward kernel, dq/dr kernel, dK/dU/dV kernel), decided once per shape, dtype and device (every call asks)."""
    if _INTERPRET or gluon_reason_for(device, dtype, q_shape[-1], k_shape[2]) is not None:
        return "triton", "triton", "triton"
    p = _problem_for(q_shape, k_shape, dtype.itemsize, device)
    if not _autotuned(p):
        return "triton", "triton", "triton"
    sms = _num_sms(device)
    row_blocks = cdiv(p["total_rows"], GLUON_FORWARD_BLOCK_L)
    column_blocks = p["num_subnetworks"] * p["subnetwork_size"] // GLUON_BLOCK_N
    return ("triton" if row_blocks * p["kv_heads"] < sms else "gluon", "gluon",
            "triton" if column_blocks * p["kv_heads"] < sms else "gluon")


def triton_forward(q, k, u, v, r, *, splits: int | None = None, descriptors: bool | None = None,
                   inference: bool = False) -> torch.Tensor:
    """FlashMHF forward with the fused kernel; the output has q's layout.

    ``splits`` (tests only) forces the split-loop variant; ``descriptors`` (tests only) forces or forbids the
    tensor-descriptor reads of K, U, V (see ``_use_tensor_descriptors``); ``inference``: the kernels' builds for any
    number of tokens (`triton_launch.any_size`).
    """
    q = _rows_dense(q)
    k, u, v, r = (t.contiguous() for t in (k, u, v, r))
    p, k_dtype = _problem(q, k), k.dtype
    out = torch.empty_like(q)
    if p["total_rows"] == 0:
        return out
    if splits is None and descriptors is None and forward_kernel(q, k) == "gluon":
        return gluon_forward(q, k, u, v, r, out=out, inference=inference)[0]
    flags = _kernel_flags(q.dtype)
    use_descriptors = _use_tensor_descriptors(q.device, descriptors)
    constants = dict(D_H=p["head_dim"], D_E=p["subnetwork_size"], TENSOR_DESCRIPTORS=use_descriptors, **flags)
    fixed = _fixed_config("forward", p)
    if use_descriptors:  # block shapes: the fixed configuration's, or the tuned one's (set by the pre-hook)
        k, u, v = (_weight_descriptor(w, fixed["BLOCK_N"]) for w in (k, u, v))
    row_blocks = cdiv(p["total_rows"], fixed["BLOCK_L"])
    if splits is None:
        column_blocks = p["num_subnetworks"] * p["subnetwork_size"] // fixed["BLOCK_N"]
        splits = _auto_splits(row_blocks * p["kv_heads"], column_blocks, q.device)

    if splits == 1 and _autotuned(p):
        bucket = _tune_bucket(p["total_rows"] * p["kv_heads"])

        def grid(meta):
            return (cdiv(p["total_rows"], meta["BLOCK_L"]), p["kv_heads"], 1)

        key = ("forward", p["head_dim"], p["subnetwork_size"], bucket, q.dtype, k_dtype, r.dtype, use_descriptors)
        _launch_tuned(
            _forward_tuned_any_size if inference else _forward_tuned, key, grid, q, k, u, v, r, out, *_row_strides(q),
            *_row_strides(out), *p["sizes"], 1, bucket, ACCUMULATE=False, **constants,
        )
        return out

    accumulate = splits > 1
    target = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if accumulate else out
    launch(
        _forward_any_size if inference else _forward_kernel, (row_blocks, p["kv_heads"], splits),
        q, k, u, v, r, target, *_row_strides(q), *_row_strides(target), *p["sizes"], splits, 0,
        ACCUMULATE=accumulate, **fixed, **constants,
    )
    if accumulate:
        out.copy_(target)
    return out


def triton_backward(grad_out, q, k, u, v, r, *, weight_grads=None, splits: int | None = None,
                    descriptors: bool | None = None, fused_gates=None, weight_gradients: bool = True):
    """Gradients (dq, dk, du, dv, dr) from the two backward kernels; dq has q's layout, dr is contiguous.

    ``weight_grads``: three contiguous tensors shaped and typed like k, u, v that receive dk, du, dv (and are
    returned), e.g. the thirds of one gradient buffer; new tensors when None. ``weight_gradients=False`` (frozen
    weights, as under LoRA on the projections): the dK/dU/dV kernel is not launched and dk, du, dv are None.
    ``fused_gates`` (`flash_mhf_gluon.FusedGates`, the fused layer's backward where `row_gradient_kernel` is the Gluon
    kernel and every weight group has one head): the dq/dr kernel then also runs the layer's norm/gate backward and
    returns the gradient of the input projection's output in dq's place. ``splits`` (tests only) forces the split
    variant of the weight-gradient kernel; ``descriptors`` (tests only) forces or forbids its tensor-descriptor reads
    of q and dO.
    """
    # dq is written in q's layout into `torch.empty_like(q)`, which keeps that layout for a dense q in any order of
    # its dimensions (the [B, L, H, d_h] layout the input projection gives, seen as [B, H, L, d_h]), not for a view
    # with gaps (a slice of a longer buffer): such a q is copied
    q = _rows_dense(q) if _dense(q) else q.contiguous()
    grad_out = _rows_dense(grad_out.to(q.dtype))
    k, u, v, r = (t.contiguous() for t in (k, u, v, r))
    p = _problem(q, k)
    grad_q = torch.empty_like(q) if fused_gates is None else fused_gates.grad_p
    grad_r = torch.empty_like(r)
    if not weight_gradients:
        weight_grads = (None, None, None)
    elif weight_grads is None:
        weight_grads = [torch.empty_like(w) for w in (k, u, v)]
    elif any(g.shape != w.shape or g.dtype != w.dtype or not g.is_contiguous()
             for g, w in zip(weight_grads, (k, u, v))):
        raise ValueError("weight_grads must be three contiguous tensors with the shapes and dtypes of k, u and v")
    if p["total_rows"] == 0:
        return grad_q.zero_(), *(None if g is None else g.zero_() for g in weight_grads), grad_r.zero_()
    flags = _kernel_flags(q.dtype)
    constants = dict(D_H=p["head_dim"], D_E=p["subnetwork_size"], **flags)
    strides = (*_row_strides(q), *_row_strides(grad_out))
    bucket = _tune_bucket(p["total_rows"] * p["kv_heads"])
    e_pow2 = max(2, next_power_of_2(p["num_subnetworks"]))

    # dq, dr: one program per row block (the Gluon kernel on Hopper where it applies, see row_gradient_kernel)
    rows_kernel, weights_kernel = ("triton", "triton") if splits is not None or descriptors is not None else \
        _chosen_kernels(q, k)[1:]
    if fused_gates is not None and rows_kernel != "gluon":
        raise ValueError("fused_gates needs the Gluon dq/dr kernel (flash_mhf_triton.row_gradient_kernel)")
    gluon_weights = (weight_descriptors(k, u, v)
                     if rows_kernel == "gluon" or (weight_gradients and weights_kernel == "gluon") else None)
    if rows_kernel == "gluon":
        gluon_rows_gradients(grad_out, q, k, u, v, r, outputs=(grad_q, grad_r), weights=gluon_weights,
                             fused_gates=fused_gates)
    elif not _autotuned(p):
        fixed = _fixed_config("rows", p)
        launch(
            _backward_rows_kernel, (cdiv(p["total_rows"], fixed["BLOCK_L"]), p["kv_heads"]),
            q, k, u, v, r, grad_out, grad_q, grad_r, *strides, *p["sizes"], 0, E_POW2=e_pow2, **fixed, **constants,
        )
    else:

        def rows_grid(meta):
            return (cdiv(p["total_rows"], meta["BLOCK_L"]), p["kv_heads"])

        key = ("rows", p["head_dim"], p["subnetwork_size"], bucket, q.dtype, k.dtype, r.dtype)
        _launch_tuned(
            _backward_rows_tuned, key, rows_grid, q, k, u, v, r, grad_out, grad_q, grad_r, *strides, *p["sizes"],
            bucket, E_POW2=e_pow2, **constants
        )

    # dk, du, dv: the Gluon kernel on Hopper where it applies (weight_gradient_kernel), otherwise one Triton program
    # per column block (and per share of the rows when there are few column blocks)
    if not weight_gradients:
        return grad_q, *weight_grads, grad_r
    if weights_kernel == "gluon":
        grad_k, grad_u, grad_v, _ = gluon_weight_gradients(grad_out, q, k, u, v, r, outputs=weight_grads,
                                                            weights=gluon_weights)
        return grad_q, grad_k, grad_u, grad_v, grad_r
    fixed = _fixed_config("weights", p)
    constants["TENSOR_DESCRIPTORS"] = use_descriptors = _use_tensor_descriptors(q.device, descriptors)
    q_rows, grad_out_rows = q, grad_out
    if use_descriptors:  # block shapes: the fixed configuration's, or the tuned one's (set by the pre-hook)
        q_rows, grad_out_rows = (_sequence_descriptor(t, fixed["BLOCK_L"]) for t in (q, grad_out))
    column_blocks = p["num_subnetworks"] * p["subnetwork_size"] // fixed["BLOCK_N"]
    if splits is None:
        splits = _auto_splits(column_blocks * p["kv_heads"], cdiv(p["total_rows"], fixed["BLOCK_L"]), q.device)
    if splits == 1 and _autotuned(p):
        grad_k, grad_u, grad_v = weight_grads

        def weights_grid(meta):
            return (p["num_subnetworks"] * p["subnetwork_size"] // meta["BLOCK_N"], p["kv_heads"], 1)

        _launch_tuned(
            _backward_weights_tuned,
            ("weights", p["head_dim"], p["subnetwork_size"], bucket, q.dtype, k.dtype, r.dtype, use_descriptors),
            weights_grid, q_rows, k, u, v, r, grad_out_rows, grad_k, grad_u, grad_v, *strides, *p["sizes"], 1, bucket,
            ACCUMULATE=False, **constants,
        )
        return grad_q, grad_k, grad_u, grad_v, grad_r

    accumulate = splits > 1
    if accumulate:  # float32 partial sums, added up by the programs that share a column block
        targets = [torch.zeros(k.shape, dtype=torch.float32, device=k.device) for _ in range(3)]
    else:
        targets = weight_grads
    launch(
        _backward_weights_kernel, (column_blocks, p["kv_heads"], splits),
        q_rows, k, u, v, r, grad_out_rows, *targets, *strides, *p["sizes"], splits, 0, ACCUMULATE=accumulate,
        **fixed, **constants,
    )
    if accumulate:
        for grad, target in zip(weight_grads, targets):
            grad.copy_(target)
    return grad_q, *weight_grads, grad_r
