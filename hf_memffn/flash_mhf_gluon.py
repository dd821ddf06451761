"""FlashMHF on Hopper GPUs as three explicitly scheduled Gluon kernels: the weight gradients (dK, dU, dV), the row
gradients (dq, dr) and the forward.

**dK, dU, dV** (``_weight_gradients_kernel``). Same maths and work split as ``_backward_weights_kernel`` in
``flash_mhf_triton.py`` (one program per column block of ``BLOCK_N`` sub-network units, resident ``K, U, V`` tiles,
the row blocks of every sequence streamed through, the gradients accumulated transposed as ``[d_h, BLOCK_N]``),
written in Gluon so that the schedule is ours rather than the compiler's pipeliner's:

* the next row block's ``q`` and ``dO`` bulk copies are issued as soon as the tiles they overwrite are free, early in
  the current iteration (the Triton kernel, with two stages, issues them at the end of an iteration and waits at the
  start of the next);
* the gate and up pre-activations come from one product with the K and U tiles stacked (``[BLOCK_L, 2 * BLOCK_N]``),
  and dK and dU are accumulated side by side (``[d_h, 2 * BLOCK_N]``) from one ``[dM | dN]`` tile. A product with
  twice the columns reads its other operand once instead of twice: at the tensor cores' peak rate a 64-column product
  with both operands in shared memory needs 128 bytes per cycle, all that shared memory delivers, and a 128-column one
  needs 96. The joined accumulators also keep the loop in registers: with Triton 3.6 nothing spills, against 12
  spilled registers with only dK and dU joined and 36 with neither;
* the row block's two activation products are queued behind the previous row block's gradient products, so the
  tensor cores have four products in flight while the warps wait only for the first; the SiLU then runs while
  ``dO V^T`` is still being multiplied.

Two warp groups (8 warps) split every product by rows: the activation products by the block's 128 rows, the gradient
products by ``d_h``. Each gradient product reads the activation tiles of both warp groups from shared memory, so every
iteration has two CTA-wide barriers (tiles free, tiles written). One program runs per multiprocessor, so when the
tiles are not a multiple of the multiprocessors the last round of programs leaves some idle (at the 370M preset's
layer shape, 336 tiles make two rounds of 132 and one of 72). The tiles of that round are split into row ranges
(``weight_splits``), whose programs write float32 shares that ``_add_weight_splits_kernel`` adds up in a fixed order.

**dq, dr** (``_rows_gradients_kernel``). Same work split as ``_backward_rows_kernel``: one program per block of
``BLOCK_L`` rows, the column blocks streamed through. It is warp-specialised: one loading warp streams the K|U and V
tiles of each column block into a ring of ``ROWS_STAGES`` slots, and two warp groups, each in its own partition, each
compute dq and dr of half of the rows. Neither waits for the other: a slot is refilled once both have released it, and
nothing else is shared. So while one warp group runs its SiLU and gradient arithmetic, the other's products keep the
tensor cores busy; with both warp groups in one partition, every shared-memory barrier that Triton inserts around the
bulk copies lines them up again, and the same kernel ran at 524-556 TFLOP/s instead of 637-648
(``kernels/flash_mhf_notes.md``, v9). In the fused layer's backward (``FusedGates``) each warp group then takes its
rows back through the gates and the query norm (``_gates_backward_epilogue``) and writes the gradient of the input
projection's output instead of dq (notes, v23).

**The forward** (``_warp_specialised_forward_kernel``). The dq/dr kernel's split with the forward's two products per
column block (``[gate | up] = q [K | U]^T``, then ``out += (SiLU(gate) * up * r_e) V`` from registers) and three
computing warp groups of 64 rows instead of two: the forward's warp groups hold fewer registers (the output and the
pre-activations), so three fit, and a program of 192 rows reads each column block from L2 for 1.5 times the rows.
It ran at 690-708 TFLOP/s at the paper's shape against 584-591 for ``_forward_kernel`` (with two warp groups,
645-655). One program runs per multiprocessor, so when the row blocks are not a multiple of the multiprocessors the
last round of programs leaves some idle (at both presets' layer shapes, 688 row blocks make five rounds of 132 and
one of 28). The row blocks of that round are split into column ranges (``forward_splits``), whose programs write
float32 shares that ``_add_forward_splits_kernel`` adds up in a fixed order.

Only Hopper (sm_90) runs them, for 16-bit inputs at ``d_h = 128`` with ``d_e`` a multiple of 64; ``flash_mhf_triton``
decides when they are used and ``flash_mhf_op.flash_mhf_path`` says so. Gluon has no interpreter mode: the CPU tests
compile them for sm_90 (and check that ptxas keeps their products asynchronous) and the GPU tests compare them with
the float64 reference.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .triton_launch import COMPILE_OPTIONS, any_size, launch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # names that differ across the supported Triton versions (3.6 .. 3.9)
    _cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    GLUON_AVAILABLE, GLUON_IMPORT_ERROR = True, None
except (ImportError, AttributeError) as exc:  # an older or newer triton without these Gluon APIs
    gluon = gl = GluonTensorDescriptor = None
    GLUON_AVAILABLE, GLUON_IMPORT_ERROR = False, repr(exc)

# The backward kernels' one launch shape: 128 rows per row block (one 64-row half per warp group), 64 columns per
# program.
BLOCK_L, BLOCK_N, NUM_WARPS = 128, 64, 8
ROWS_STAGES = 3  # column blocks in flight in the dq/dr kernel (3 x 48 KB + the 64 KB q and dO tiles)
ROWS_WARPS = 4  # per partition of the dq/dr and forward kernels (each adds warps in worker partitions)
# The forward kernel: three computing warp groups of 64 rows (FORWARD_BLOCK_L rows per program) with
# FORWARD_REGISTERS registers per thread each (what fits in the 64K beside the loading warp), and FORWARD_STAGES column
# blocks in flight (48 KB each, beside the q tiles' 16 KB per warp group). Three warp groups ran 1.08-1.21x faster
# than the Triton kernel on an H100 over two calls, two 1.09-1.11x (kernels/results/gluon/forward_kernels.md, from
# commit b635f54, which still had the two-warp-group launch, and forward_kernels_one_launch.md).
FORWARD_BLOCK_L, FORWARD_STAGES, FORWARD_REGISTERS = 192, 3, 160
FORWARD_MIN_SPLIT_BLOCKS = 4  # column blocks in one range of a split row block (see `forward_splits`)
# The weight kernel's split tiles (see `weight_splits`): at most WEIGHT_MAX_SPLITS row ranges per tile, and a range's
# start and its float32 shares costed as WEIGHT_SPLIT_COST_ROW_BLOCKS row blocks of work (about 3 from an H100 sweep,
# flash_mhf_notes.md v35).
WEIGHT_MAX_SPLITS, WEIGHT_SPLIT_COST_ROW_BLOCKS = 16, 4
# Whether `gluon_weight_gradients` splits tiles by default (benchmarks switch it off to time every tile whole).
SPLIT_WEIGHT_TILES = True
HEAD_DIM = 128


def gluon_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the Gluon backward kernels cannot run these inputs, or None when they can."""
    return gluon_reason_for(q.device, q.dtype, q.shape[-1], k.shape[2])


@functools.lru_cache(maxsize=None)
def gluon_reason_for(device: torch.device, dtype: torch.dtype, head_dim: int, subnetwork_size: int) -> str | None:
    """`gluon_unsupported_reason`, decided once per device, dtype and shape (every backward pass asks)."""
    if not GLUON_AVAILABLE:
        return f"triton's Gluon Hopper API is not importable ({GLUON_IMPORT_ERROR})"
    if device.type != "cuda":
        return f"tensors are on {device.type}"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype} (it takes float16 and bfloat16)"
    if head_dim != HEAD_DIM:
        return f"head_dim={head_dim} (it takes {HEAD_DIM})"
    if subnetwork_size % BLOCK_N:
        return f"subnetwork_size={subnetwork_size} (it takes multiples of {BLOCK_N})"
    return None


if GLUON_AVAILABLE:

    @gluon.jit
    def _fast_sigmoid(x):
        # sigmoid(x) = (1 + tanh(x / 2)) / 2 with the single-instruction hardware tanh (16-bit inputs only)
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=gl.float32, is_pure=True,
                                      pack=1)
        return 0.5 * t + 0.5

    @gluon.jit
    def _fast_silu(x):
        # SiLU(x) = h + h tanh(h), h = x / 2: four elements per block of instructions, their four tanh issued before
        # the multiply-adds that read them (16-bit inputs only)
        return gl.inline_asm_elementwise(
            "{ .reg .f32 t0, t1, t2, t3;\n"
            "tanh.approx.f32 t0, $4; tanh.approx.f32 t1, $5; tanh.approx.f32 t2, $6; tanh.approx.f32 t3, $7;\n"
            "fma.rn.f32 $0, $4, t0, $4; fma.rn.f32 $1, $5, t1, $5; fma.rn.f32 $2, $6, t2, $6;"
            " fma.rn.f32 $3, $7, t3, $7; }",
            "=f,=f,=f,=f,f,f,f,f", [x * 0.5], dtype=gl.float32, is_pure=True, pack=4)

    @gluon.jit
    def _sequence_block(row_block, group, blocks_per_sequence, group_size, BLOCK_L: gl.constexpr):
        """(batch, head, first position) of row block ``row_block`` of weight group ``group``, the blocks being
        counted per sequence (batch, head within the group)."""
        sequence = row_block // blocks_per_sequence
        batch = sequence // group_size
        head = group * group_size + (sequence - batch * group_size)
        return batch, head, (row_block - sequence * blocks_per_sequence) * BLOCK_L

    @gluon.jit
    def _load_row_block(q_desc, grad_out_desc, q_buffer, grad_out_buffer, ready, row_block, group,
                        blocks_per_sequence, group_size, BLOCK_L: gl.constexpr):
        """Issue the bulk copies of a row block's q and dO tiles; ``ready`` completes when both have landed (the
        copy engine zero-fills the positions past the sequence's end)."""
        batch, head, position = _sequence_block(row_block, group, blocks_per_sequence, group_size, BLOCK_L)
        mbarrier.expect(ready, q_desc.block_type.nbytes + grad_out_desc.block_type.nbytes)
        _tma_load(q_desc, [batch, head, position, 0], ready, q_buffer)
        _tma_load(grad_out_desc, [batch, head, position, 0], ready, grad_out_buffer)

    @gluon.jit
    def _row_block_gates(R, row_block, group, seq_len, blocks_per_sequence, group_size, num_heads, num_subnetworks,
                         subnetwork, BLOCK_L: gl.constexpr, layout: gl.constexpr):
        """Sub-network ``subnetwork``'s gates [BLOCK_L] (float32, 0 past the sequence's end) of a row block."""
        batch, head, first_position = _sequence_block(row_block, group, blocks_per_sequence, group_size, BLOCK_L)
        position = first_position + gl.arange(0, BLOCK_L, layout=layout)
        gate_row = (batch.to(gl.int64) * num_heads + head) * seq_len + position  # row of the contiguous r [B, H, L, E]
        return gl.load(R + gate_row * num_subnetworks + subnetwork, mask=position < seq_len, other=0.0).to(gl.float32)

    @gluon.jit
    def _weight_tile(program, split_from, splits):
        """(tile, share) of weight-kernel program ``program``: share -1 for a whole tile, else the index of the
        program's float32 share (its row range is share % splits)."""
        if program < split_from:
            tile = program
            share = -1
        else:
            share = program - split_from
            tile = split_from + share // splits
        return tile, share

    @gluon.jit
    def _row_range(share, splits, all_row_blocks):
        """(first, end) row block of a weight-kernel program. A split tile's ranges start at multiples of 4 row blocks
        (the last takes the remainder), so that a row block's index gives its stage and barrier phase."""
        if share < 0:
            first_row_block = 0
            end_row_block = all_row_blocks
        else:
            split = share % splits
            fours = all_row_blocks // 4
            first_row_block = 4 * (split * fours // splits)
            end_row_block = gl.where(split == splits - 1, all_row_blocks, 4 * ((split + 1) * fours // splits))
        return first_row_block, end_row_block

    @gluon.jit
    def _weight_gradients_kernel(
        q_desc, grad_out_desc, k_desc, u_desc, v_desc, R, DK, DU, DV, SHARES,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, split_from, splits,
        D_H: gl.constexpr, D_E: gl.constexpr, BLOCK_L: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        """q_desc, grad_out_desc: [B, H, L, d_h] with block [1, 1, BLOCK_L, d_h]; k/u/v_desc: [H_kv * E * d_e, d_h]
        with block [BLOCK_N, d_h]; DK, DU, DV: contiguous [H_kv, E, d_e, d_h].

        A tile is one column block of one weight group (tile = group * column blocks + column block, so tile *
        BLOCK_N is its first weight row). Programs 0 .. split_from - 1 each own a tile and all its row blocks. The
        tiles from ``split_from`` on (the last, partly filled round of programs) are each split into ``splits`` row
        ranges, one program per range, which writes its float32 share of dK, dU and dV into SHARES
        [(tiles - split_from) * splits, 3, BLOCK_N, d_h] for `_add_weight_splits_kernel`."""
        dtype: gl.constexpr = q_desc.dtype
        tile, share = _weight_tile(gl.program_id(0), split_from, splits)
        column_blocks = num_subnetworks * (D_E // BLOCK_N)
        group = tile // column_blocks
        col0 = (tile - group * column_blocks) * BLOCK_N
        subnetwork = col0 // D_E

        # accumulator layout of every product: rows split over the warps, BLOCK_N columns
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        ku_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                            instr_shape=[16, 2 * BLOCK_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        activation_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_L, BLOCK_N], dtype)

        # shared memory: K, U, V tiles (resident), two stages of q and dO tiles, the activation tiles (224 KB)
        # K and U rows stacked, [2 * BLOCK_N, D_H]: one product gives the gate and up pre-activations side by side
        ku_tile = gl.allocate_shared_memory(dtype, [2 * BLOCK_N, D_H], k_desc.layout)
        v_tile = gl.allocate_shared_memory(dtype, [BLOCK_N, D_H], k_desc.layout)
        q_stages = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_L, D_H], q_desc.layout)
        grad_out_stages = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_L, D_H], q_desc.layout)
        hidden_tile = gl.allocate_shared_memory(dtype, [BLOCK_L, BLOCK_N], activation_layout)
        # dM and dN side by side, [BLOCK_L, 2 * BLOCK_N]: one product accumulates dK and dU together
        grad_ku_tile = gl.allocate_shared_memory(
            dtype, [BLOCK_L, 2 * BLOCK_N], gl.NVMMASharedLayout.get_default_for([BLOCK_L, 2 * BLOCK_N], dtype))
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        weights_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)
        mbarrier.init(weights_ready, count=1)
        fence_async_shared()

        weight_row = group * num_subnetworks * D_E + col0
        mbarrier.expect(weights_ready, 3 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [weight_row, 0], weights_ready, ku_tile.slice(0, BLOCK_N))
        _tma_load(u_desc, [weight_row, 0], weights_ready, ku_tile.slice(BLOCK_N, BLOCK_N))
        _tma_load(v_desc, [weight_row, 0], weights_ready, v_tile)

        blocks_per_sequence = gl.cdiv(seq_len, BLOCK_L)
        first_row_block, end_row_block = _row_range(share, splits, (total_rows // seq_len) * blocks_per_sequence)
        _load_row_block(q_desc, grad_out_desc, q_stages.index(0), grad_out_stages.index(0), ready.index(0),
                        first_row_block, group, blocks_per_sequence, group_size, BLOCK_L)
        next_gate = _row_block_gates(R, first_row_block, group, seq_len, blocks_per_sequence, group_size, num_heads,
                                     num_subnetworks, subnetwork, BLOCK_L, row_layout)

        zero_pre_activations = gl.zeros([BLOCK_L, 2 * BLOCK_N], gl.float32, ku_layout)
        zero_activations = gl.zeros([BLOCK_L, BLOCK_N], gl.float32, acc_layout)
        grad_ku = warpgroup_mma_init(gl.zeros([D_H, 2 * BLOCK_N], gl.float32, ku_layout))  # [dK^T | dU^T]
        grad_v = warpgroup_mma_init(gl.zeros([D_H, BLOCK_N], gl.float32, acc_layout))
        mbarrier.wait(weights_ready, 0)
        ku_t = ku_tile.permute([1, 0])
        v_t = v_tile.permute([1, 0])

        # (first_row_block is a multiple of 4: the stage and the barrier phase follow from row_block alone)
        for row_block in range(first_row_block, end_row_block):
            stage = row_block % 2
            mbarrier.wait(ready.index(stage), (row_block // 2) & 1)
            q = q_stages.index(stage).reshape([BLOCK_L, D_H])
            grad_out = grad_out_stages.index(stage).reshape([BLOCK_L, D_H])
            gate = next_gate
            next_gate = _row_block_gates(R, gl.minimum(row_block + 1, end_row_block - 1), group, seq_len,
                                         blocks_per_sequence, group_size, num_heads, num_subnetworks, subnetwork,
                                         BLOCK_L, row_layout)

            # pre-activations [gate | up] as one [BLOCK_L, 2 * BLOCK_N] product, then dO V^T, both queued behind the
            # previous row block's gradient products
            pre = warpgroup_mma(q, ku_t, zero_pre_activations, use_acc=False, is_async=True)
            grad_hidden = warpgroup_mma(grad_out, v_t, zero_activations, use_acc=False, is_async=True)
            pre, grad_ku, grad_v = warpgroup_mma_wait(1, deps=[pre, grad_ku, grad_v])
            # each thread holds column c of the gate half and column c of the up half: the split moves no data
            gate_pre, up = pre.reshape([BLOCK_L, 2, BLOCK_N]).permute([0, 2, 1]).split()
            gate_pre = gl.convert_layout(gate_pre, acc_layout, assert_trivial=True)
            up = gl.convert_layout(up, acc_layout, assert_trivial=True)
            # both warp groups are past the previous gradient products: the other stage and the activation tiles
            # are free, so the next row block's copies go out now
            _cta_barrier()
            if row_block + 1 < end_row_block:
                _load_row_block(q_desc, grad_out_desc, q_stages.index(1 - stage), grad_out_stages.index(1 - stage),
                                ready.index(1 - stage), row_block + 1, group, blocks_per_sequence, group_size,
                                BLOCK_L)

            sig = _fast_sigmoid(gate_pre)
            silu = gate_pre * sig
            silu_derivative = sig + silu * (1.0 - sig)
            gate_2d = gate[:, None]
            hidden_tile.store((silu * up * gate_2d).to(dtype))
            up_silu_derivative = up * silu_derivative
            grad_hidden = warpgroup_mma_wait(0, deps=[grad_hidden]) * gate_2d
            grad_ku_tile.slice(0, BLOCK_N, dim=1).store((grad_hidden * up_silu_derivative).to(dtype))
            grad_ku_tile.slice(BLOCK_N, BLOCK_N, dim=1).store((grad_hidden * silu).to(dtype))
            fence_async_shared()
            _cta_barrier()

            # gradients, transposed: [D_H, width] += tile^T [D_H, BLOCK_L] @ activations [BLOCK_L, width]
            grad_v = warpgroup_mma(grad_out.permute([1, 0]), hidden_tile, grad_v, is_async=True)
            grad_ku = warpgroup_mma(q.permute([1, 0]), grad_ku_tile, grad_ku, is_async=True)

        grad_ku, grad_v = warpgroup_mma_wait(0, deps=[grad_ku, grad_v])
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))
        mbarrier.invalidate(weights_ready)

        dims = gl.arange(0, D_H, layout=gl.SliceLayout(1, acc_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        # columns [0, BLOCK_N) of the joint accumulator are dK^T, the others dU^T
        ku_dims = gl.arange(0, D_H, layout=gl.SliceLayout(1, ku_layout))
        ku_cols = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(0, ku_layout))
        is_u = (ku_cols >= BLOCK_N)[None, :] & (ku_dims >= 0)[:, None]
        if share >= 0:  # one row range of a split tile: float32 [dK | dU | dV] rows for `_add_weight_splits_kernel`
            base = share.to(gl.int64) * (3 * BLOCK_N * D_H)
            gl.store(SHARES + base + ku_cols[None, :] * D_H + ku_dims[:, None], grad_ku)
            gl.store(SHARES + base + (2 * BLOCK_N + cols)[None, :] * D_H + dims[:, None], grad_v)
        else:
            first_row = tile.to(gl.int64) * BLOCK_N
            gl.store(DV + (first_row + cols)[None, :] * D_H + dims[:, None], grad_v.to(DV.dtype.element_ty))
            ku_offsets = (first_row + ku_cols % BLOCK_N)[None, :] * D_H + ku_dims[:, None]
            gl.store(DK + ku_offsets, grad_ku.to(DK.dtype.element_ty), mask=~is_u)
            gl.store(DU + ku_offsets, grad_ku.to(DU.dtype.element_ty), mask=is_u)

    @gluon.jit
    def _add_weight_splits_kernel(SHARES, DK, DU, DV, split_from, splits, D_H: gl.constexpr,
                                  BLOCK_N: gl.constexpr):
        """One gradient's rows of one split tile of the weight kernel: its ``splits`` float32 shares added in order
        (the result does not depend on which program finished first) and written in the gradient's dtype. Program
        ``i`` takes dK (i % 3 == 0), dU (1) or dV (2) of split tile ``i // 3``."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        index = gl.program_id(0)
        which = index % 3
        split_tile = index // 3
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, layout))
        offsets = rows.to(gl.int64)[:, None] * D_H + dims[None, :]
        base = (split_tile.to(gl.int64) * splits * 3 + which) * (BLOCK_N * D_H)
        total = gl.load(SHARES + base + offsets)
        for split in range(1, splits):
            total += gl.load(SHARES + base + split * (3 * BLOCK_N * D_H) + offsets)
        weight_offsets = (split_from + split_tile).to(gl.int64) * (BLOCK_N * D_H) + offsets
        if which == 0:
            gl.store(DK + weight_offsets, total.to(DK.dtype.element_ty))
        elif which == 1:
            gl.store(DU + weight_offsets, total.to(DU.dtype.element_ty))
        else:
            gl.store(DV + weight_offsets, total.to(DV.dtype.element_ty))


    @gluon.jit
    def _flat_row_coordinates(rows, group, seq_len, group_size):
        """(batch, head, position) of rows counted over the sequences of weight group ``group`` (batch, head within
        the group, position), as the Triton kernels count them: a row block may span two sequences."""
        sequence = rows // seq_len
        batch = sequence // group_size
        head = group * group_size + (sequence - batch * group_size)
        return batch, head, rows - sequence * seq_len

    @gluon.jit
    def _load_column_block(k_desc, u_desc, v_desc, ku_buffer, v_buffer, ready, weight_row, BLOCK_N: gl.constexpr):
        """Issue the bulk copies of one column block: K and U rows stacked in ``ku_buffer``, V rows in ``v_buffer``."""
        mbarrier.expect(ready, 3 * k_desc.block_type.nbytes)
        _tma_load(k_desc, [weight_row, 0], ready, ku_buffer.slice(0, BLOCK_N))
        _tma_load(u_desc, [weight_row, 0], ready, ku_buffer.slice(BLOCK_N, BLOCK_N))
        _tma_load(v_desc, [weight_row, 0], ready, v_buffer)

    @gluon.jit
    def _row_block_tile(X, first_row, group, seq_len, group_size, total_rows, stride_b, stride_h, stride_l,
                        ROWS: gl.constexpr, D_H: gl.constexpr, layout: gl.constexpr):
        """Rows first_row .. first_row + ROWS of weight group ``group`` of a [B, H, L, d_h] tensor with the given
        strides, [ROWS, d_h] (0 past the last row)."""
        rows = first_row + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, layout))
        batch, head, position = _flat_row_coordinates(rows, group, seq_len, group_size)
        offsets = batch.to(gl.int64) * stride_b + head * stride_h + position * stride_l
        return gl.load(X + offsets[:, None] + dims[None, :], mask=(rows < total_rows)[:, None], other=0.0)

    @gluon.jit
    def _row_gate_offsets(first, group, total_rows, seq_len, group_size, num_heads, num_subnetworks,
                          ROWS: gl.constexpr, layout: gl.constexpr):
        """Offsets of rows first .. first + ROWS of weight group ``group`` in the contiguous [B, H, L, E] gates (their
        first sub-network), and the mask of the rows that exist."""
        rows = first + gl.arange(0, ROWS, layout=layout)
        batch, head, position = _flat_row_coordinates(rows, group, seq_len, group_size)
        return ((batch.to(gl.int64) * num_heads + head) * seq_len + position) * num_subnetworks, rows < total_rows

    @gluon.jit
    def _block_gates(R, gate_offsets, gate_mask, block, BLOCK_N: gl.constexpr, D_E: gl.constexpr):
        """The gates [ROWS] (float32) of the sub-network that column block ``block`` lies in."""
        return gl.load(R + gate_offsets + (block * BLOCK_N) // D_E, mask=gate_mask, other=0.0).to(gl.float32)

    @gluon.jit
    def _store_row_block(X, tile, first, group, total_rows, seq_len, group_size, stride_b, stride_h, stride_l,
                         ROWS: gl.constexpr, D_H: gl.constexpr, layout: gl.constexpr):
        """Writes ``tile`` [ROWS, d_h] (in ``layout``) to rows first .. first + ROWS of weight group ``group`` of a
        [B, H, L, d_h] tensor with the given strides (rows past the last are not written)."""
        rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, layout))
        batch, head, position = _flat_row_coordinates(rows, group, seq_len, group_size)
        offsets = batch.to(gl.int64) * stride_b + head * stride_h + position * stride_l
        gl.store(X + offsets[:, None] + dims[None, :], tile.to(X.dtype.element_ty), mask=(rows < total_rows)[:, None])

    @gluon.jit
    def _rows_step(q_tile, grad_out_tile, ku_tile, v_tile, grad_q, gate, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   wide_layout: gl.constexpr, half_layout: gl.constexpr, operand_layout: gl.constexpr):
        """One column block for one warp group's rows: the pre-activations and dO V^T, the activation gradients, and
        the dq products. Returns dq (its products complete) and the block's dr share [ROWS] (before gating).

        Every product completes within the step. The dq products read their left operands from registers, and
        ptxas neither keeps those registers from being reused while an asynchronous product reads them, nor lets
        non-wgmma code read one product's results while a product issued in an earlier loop iteration is still
        running (it then serialises every wgmma of the kernel)."""
        dtype: gl.constexpr = q_tile.dtype
        pre = warpgroup_mma(q_tile, ku_tile.permute([1, 0]), gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, wide_layout),
                            use_acc=False, is_async=True)
        grad_hidden = warpgroup_mma(grad_out_tile, v_tile.permute([1, 0]),
                                    gl.zeros([ROWS, BLOCK_N], gl.float32, half_layout), use_acc=False, is_async=True)
        pre = warpgroup_mma_wait(1, deps=[pre])
        # each thread holds column c of the gate half and column c of the up half: the split moves no data
        gate_pre, up = pre.reshape([ROWS, 2, BLOCK_N]).permute([0, 2, 1]).split()
        gate_pre = gl.convert_layout(gate_pre, half_layout, assert_trivial=True)
        up = gl.convert_layout(up, half_layout, assert_trivial=True)
        # everything that does not need dO V^T, while the tensor cores finish it
        sig = _fast_sigmoid(gate_pre)
        silu = gate_pre * sig
        silu_up = silu * up
        gate_2d = gate[:, None]
        gated_up_silu_derivative = (up * (sig + silu * (1.0 - sig))) * gate_2d
        gated_silu = silu * gate_2d
        grad_hidden = warpgroup_mma_wait(0, deps=[grad_hidden])
        grad_gate_share = gl.sum(grad_hidden * silu_up, axis=1)
        grad_gate_pre = gl.convert_layout((grad_hidden * gated_up_silu_derivative).to(dtype), operand_layout)
        grad_up = gl.convert_layout((grad_hidden * gated_silu).to(dtype), operand_layout)
        grad_q = warpgroup_mma(grad_gate_pre, ku_tile.slice(0, BLOCK_N), grad_q, is_async=True)
        grad_q = warpgroup_mma(grad_up, ku_tile.slice(BLOCK_N, BLOCK_N), grad_q, is_async=True)
        grad_q, grad_gate_pre, grad_up = warpgroup_mma_wait(0, deps=[grad_q, grad_gate_pre, grad_up])
        return grad_q, grad_gate_share

    @gluon.jit
    def _rows_producer(k_desc, u_desc, v_desc, ku_stages, v_stages, ready, empty, weight_row, num_blocks,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """The loading warp: streams the column blocks through the ring, each into a slot both warp groups have
        released (on the first pass the wait on the "previous" phase returns at once)."""
        for block in range(num_blocks):
            stage = block % STAGES
            mbarrier.wait(empty.index(stage), ((block // STAGES) & 1) ^ 1)
            _load_column_block(k_desc, u_desc, v_desc, ku_stages.index(stage), v_stages.index(stage),
                               ready.index(stage), weight_row + block * BLOCK_N, BLOCK_N)

    @gluon.jit
    def _gates_backward_epilogue(grad_q, q_tile, logits_tile, router_tile, P, NORM_W, ROUTER, R, DR, TOTALS, DP,
                                 NORM_PARTS, ROUTER_PARTS, first, head, total_rows, seq_len, num_heads,
                                 num_subnetworks, stride_p, eps, slot, D_H: gl.constexpr, E_DOT: gl.constexpr,
                                 ROWS: gl.constexpr, HAS_NORM: gl.constexpr, HAS_ROUTER: gl.constexpr,
                                 wide_layout: gl.constexpr):
        """The fused layer's norm/gate backward for one warp group's ROWS rows of one head (weight groups of one
        head: row ``t`` is token ``t``), from their complete dq (float32, in registers) and dr (in DR): the gradient of
        the input projection's output P [tokens, H * d_h] into DP (P's layout), and this warp group's shares of the
        norm-weight and router gradients into slot ``slot`` of NORM_PARTS [slots, H, d_h] and ROUTER_PARTS [slots, H,
        E_DOT, d_h]. The gates' totals ``sum_e sigmoid(q W_e) + gate_eps`` (TOTALS [B, H, L]) come from the forward's
        kernel, so the gates need no router product here: ``s_e = r_e * total``. Every tile is read with one load
        (one program per multiprocessor: nothing else would hide a chain of loads), and the router's two products
        run on the tensor cores from ``logits_tile`` [ROWS, E_DOT] (the logits' gradients, columns past E zero) and
        ``router_tile`` [d_h, E_DOT] (the head's router, 16-bit): dq += dlogits W^T, and the router's gradient
        q^T dlogits from the queries' tile ``q_tile`` (as the op multiplied them)."""
        dtype: gl.constexpr = q_tile.dtype
        row_layout: gl.constexpr = gl.SliceLayout(1, wide_layout)
        tokens = first + gl.arange(0, ROWS, layout=row_layout)
        dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, wide_layout))
        token_mask = tokens < total_rows
        p = gl.load(P + (tokens.to(gl.int64)[:, None] * stride_p + head * D_H + dims[None, :]), mask=token_mask[:, None],
                    other=0.0)
        if HAS_ROUTER:
            narrow_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                                    instr_shape=[16, E_DOT, 16])
            narrow_rows: gl.constexpr = gl.SliceLayout(1, narrow_layout)
            columns = gl.arange(0, E_DOT, layout=gl.SliceLayout(0, narrow_layout))
            router_dims = gl.arange(0, D_H, layout=narrow_rows)
            router_mask = (columns < num_subnetworks)[None, :] & (router_dims >= 0)[:, None]
            router = gl.load(ROUTER + (head * D_H + router_dims)[:, None] * num_subnetworks + columns[None, :],
                             mask=router_mask, other=0.0)
            gate_tokens = first + gl.arange(0, ROWS, layout=narrow_rows)
            batch = gate_tokens // seq_len
            gate_rows = (batch.to(gl.int64) * num_heads + head) * seq_len + (gate_tokens - batch * seq_len)
            gate_mask = (gate_tokens < total_rows)[:, None] & (columns < num_subnetworks)[None, :]
            gate_offsets = gate_rows[:, None] * num_subnetworks + columns[None, :]
            gates = gl.load(R + gate_offsets, mask=gate_mask, other=0.0)
            grad_gates = gl.load(DR + gate_offsets, mask=gate_mask, other=0.0)
            totals = gl.load(TOTALS + gate_rows, mask=gate_tokens < total_rows, other=1.0)[:, None]
            # r = s / total: ds_e = (dr_e - sum_j dr_j r_j) / total, then through the sigmoid
            scores = gates * totals
            grad_logits = ((grad_gates - gl.sum(grad_gates * gates, axis=1)[:, None]) / totals
                           * scores * (1.0 - scores))
            logits_tile.store(grad_logits.to(dtype))
            router_tile.store(router.to(dtype))
            fence_async_shared()
            _cta_barrier()
            grad_q = warpgroup_mma(logits_tile, router_tile.permute([1, 0]), grad_q, is_async=True)
            # the router's gradient, transposed [d_h, E_DOT] = q^T dlogits over the warp group's rows
            share = warpgroup_mma(q_tile.permute([1, 0]), logits_tile,
                                  gl.zeros([D_H, E_DOT], gl.float32, narrow_layout), use_acc=False, is_async=True)
            grad_q, share = warpgroup_mma_wait(0, deps=[grad_q, share])
            gl.store(ROUTER_PARTS + ((slot * num_heads + head) * E_DOT + columns[None, :]) * D_H + router_dims[:, None],
                     share, mask=router_mask)
        p = p.to(gl.float32)
        if HAS_NORM:
            inv_rms = 1.0 / gl.sqrt(gl.sum(p * p, axis=1) / D_H + eps)
            p_hat = p * inv_rms[:, None]
            gl.store(NORM_PARTS + (slot * num_heads + head) * D_H + dims, gl.sum(grad_q * p_hat, axis=0))
            grad_p_hat = grad_q * gl.load(NORM_W + dims).to(gl.float32)[None, :]
            grad_p = inv_rms[:, None] * (grad_p_hat - p_hat * (gl.sum(grad_p_hat * p_hat, axis=1) / D_H)[:, None])
        else:
            grad_p = grad_q
        gl.store(DP + (tokens.to(gl.int64)[:, None] * stride_p + head * D_H + dims[None, :]),
                 grad_p.to(DP.dtype.element_ty), mask=token_mask[:, None])

    @gluon.jit
    def _rows_consumer(half, Q, DO, R, DQ, DR, q_tile, grad_out_tile, ku_stages, v_stages, ready, empty,
                       stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, stride_db, stride_dh,
                       stride_dl, first_row, group, total_rows, seq_len, group_size, num_heads, num_subnetworks,
                       num_blocks, logits_tile, router_tile, P, NORM_W, ROUTER, TOTALS, NORM_PARTS, ROUTER_PARTS,
                       stride_p, eps, D_H: gl.constexpr, D_E: gl.constexpr, ROWS: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr, E_DOT: gl.constexpr, FUSED_GATES: gl.constexpr,
                       HAS_NORM: gl.constexpr, HAS_ROUTER: gl.constexpr):
        """One warp group: dq and dr of its ROWS rows (``half`` of the program's row block); with FUSED_GATES, then
        the layer's norm/gate backward of those rows (`_gates_backward_epilogue`, DQ being the layer's DP)."""
        dtype: gl.constexpr = q_tile.dtype
        # [gate | up] pre-activations and dq: 2 * BLOCK_N = D_H columns; dM, dN as the dq products' left operands
        wide_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, D_H, 16])
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BLOCK_N, 16])
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wide_layout, k_width=2)
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, half_layout)

        first = first_row + half * ROWS
        q_tile.store(_row_block_tile(Q, first, group, seq_len, group_size, total_rows, stride_qb, stride_qh,
                                     stride_ql, ROWS, D_H, load_layout))
        grad_out_tile.store(_row_block_tile(DO, first, group, seq_len, group_size, total_rows, stride_gb, stride_gh,
                                            stride_gl, ROWS, D_H, load_layout).to(dtype))
        fence_async_shared()
        _cta_barrier()  # the warp group's four warps wrote the tiles its products read

        gate_offsets, gate_mask = _row_gate_offsets(first, group, total_rows, seq_len, group_size, num_heads,
                                                    num_subnetworks, ROWS, row_layout)
        BLOCKS_PER_SUBNETWORK: gl.constexpr = D_E // BLOCK_N

        grad_q = gl.zeros([ROWS, D_H], gl.float32, wide_layout)
        grad_gate = gl.zeros([ROWS], gl.float32, row_layout)
        next_gate = _block_gates(R, gate_offsets, gate_mask, 0, BLOCK_N, D_E)
        for block in range(num_blocks):
            stage = block % STAGES
            gate = next_gate
            next_gate = _block_gates(R, gate_offsets, gate_mask, gl.minimum(block + 1, num_blocks - 1), BLOCK_N, D_E)
            mbarrier.wait(ready.index(stage), (block // STAGES) & 1)
            grad_q, share = _rows_step(q_tile, grad_out_tile, ku_stages.index(stage), v_stages.index(stage), grad_q,
                                       gate, ROWS, BLOCK_N, wide_layout, half_layout, operand_layout)
            mbarrier.arrive(empty.index(stage), count=1)  # this warp group is done with the slot
            grad_gate += share
            if block % BLOCKS_PER_SUBNETWORK == BLOCKS_PER_SUBNETWORK - 1:  # the sub-network's last block
                gl.store(DR + gate_offsets + block // BLOCKS_PER_SUBNETWORK, grad_gate.to(DR.dtype.element_ty),
                         mask=gate_mask)
                grad_gate = gl.zeros([ROWS], gl.float32, row_layout)

        if FUSED_GATES:
            _cta_barrier()  # the warp group's dr stores, read back by other threads of it
            _gates_backward_epilogue(grad_q, q_tile, logits_tile, router_tile, P, NORM_W, ROUTER, R, DR, TOTALS, DQ,
                                     NORM_PARTS, ROUTER_PARTS, first, group, total_rows, seq_len, num_heads,
                                     num_subnetworks, stride_p, eps, gl.program_id(0) * 2 + half, D_H, E_DOT, ROWS,
                                     HAS_NORM, HAS_ROUTER, wide_layout)
        else:
            _store_row_block(DQ, grad_q, first, group, total_rows, seq_len, group_size, stride_db, stride_dh,
                             stride_dl, ROWS, D_H, wide_layout)

    @gluon.jit
    def _rows_gradients_kernel(
        Q, DO, k_desc, u_desc, v_desc, R, DQ, DR,
        stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl, stride_db, stride_dh, stride_dl,
        total_rows, seq_len, group_size, num_heads, num_subnetworks,
        P, NORM_W, ROUTER, TOTALS, NORM_PARTS, ROUTER_PARTS, stride_p, eps,
        D_H: gl.constexpr, D_E: gl.constexpr, BLOCK_L: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        E_DOT: gl.constexpr, FUSED_GATES: gl.constexpr, HAS_NORM: gl.constexpr, HAS_ROUTER: gl.constexpr,
    ):
        """dq and dr of one block of BLOCK_L rows of one weight group, warp-specialised: two warp groups of four
        warps (one per half of the rows, each in its own partition, so that neither waits for the other except for
        a slot of the ring) and one loading warp. Q, DO, DQ: [B, H, L, d_h] through their (batch, head, position)
        strides; k/u/v_desc: [H_kv * E * d_e, d_h] with block [BLOCK_N, d_h]; R, DR: contiguous [B, H, L, E]."""
        dtype: gl.constexpr = k_desc.dtype
        ROWS: gl.constexpr = BLOCK_L // 2
        first_row = gl.program_id(0) * BLOCK_L
        group = gl.program_id(1)
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D_H], dtype)

        # shared memory (208 KB): each warp group's q and dO rows, a ring of STAGES column blocks (K and U rows
        # stacked [2 * BLOCK_N, d_h], V rows [BLOCK_N, d_h]), and per slot a "ready" (copies landed) and an "empty"
        # (both warp groups done) barrier
        q_tiles = gl.allocate_shared_memory(dtype, [2, ROWS, D_H], tile_layout)
        grad_out_tiles = gl.allocate_shared_memory(dtype, [2, ROWS, D_H], tile_layout)
        ku_stages = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, D_H], k_desc.layout)
        v_stages = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_H], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # the fused norm/gate backward's logit-gradient and router tiles (one each per warp group; token tiles
        # without it)
        LOGIT_ROWS: gl.constexpr = ROWS if FUSED_GATES else 16
        logits_tiles = gl.allocate_shared_memory(dtype, [2, LOGIT_ROWS, E_DOT],
                                                 gl.NVMMASharedLayout.get_default_for([LOGIT_ROWS, E_DOT], dtype))
        ROUTER_ROWS: gl.constexpr = D_H if FUSED_GATES else 16
        router_tiles = gl.allocate_shared_memory(dtype, [2, ROUTER_ROWS, E_DOT],
                                                 gl.NVMMASharedLayout.get_default_for([ROUTER_ROWS, E_DOT], dtype))
        for stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(stage), count=1)
            mbarrier.init(empty.index(stage), count=2)
        fence_async_shared()

        num_blocks = num_subnetworks * (D_E // BLOCK_N)
        gl.warp_specialize([
            (_rows_consumer, (0, Q, DO, R, DQ, DR, q_tiles.index(0), grad_out_tiles.index(0), ku_stages, v_stages,
                              ready, empty, stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
                              stride_db, stride_dh, stride_dl, first_row, group, total_rows, seq_len, group_size,
                              num_heads, num_subnetworks, num_blocks, logits_tiles.index(0),
                              router_tiles.index(0), P, NORM_W, ROUTER, TOTALS, NORM_PARTS, ROUTER_PARTS,
                              stride_p, eps, D_H, D_E, ROWS, BLOCK_N, STAGES, E_DOT, FUSED_GATES, HAS_NORM,
                              HAS_ROUTER)),
            (_rows_consumer, (1, Q, DO, R, DQ, DR, q_tiles.index(1), grad_out_tiles.index(1), ku_stages, v_stages,
                              ready, empty, stride_qb, stride_qh, stride_ql, stride_gb, stride_gh, stride_gl,
                              stride_db, stride_dh, stride_dl, first_row, group, total_rows, seq_len, group_size,
                              num_heads, num_subnetworks, num_blocks, logits_tiles.index(1),
                              router_tiles.index(1), P, NORM_W, ROUTER, TOTALS, NORM_PARTS, ROUTER_PARTS,
                              stride_p, eps, D_H, D_E, ROWS, BLOCK_N, STAGES, E_DOT, FUSED_GATES, HAS_NORM,
                              HAS_ROUTER)),
            (_rows_producer, (k_desc, u_desc, v_desc, ku_stages, v_stages, ready, empty,
                              group * num_subnetworks * D_E, num_blocks, BLOCK_N, STAGES)),
        ], [4, 1], [232, 24])


    @gluon.jit
    def _forward_step(q_tile, ku_tile, v_tile, out, gate, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                      wide_layout: gl.constexpr, half_layout: gl.constexpr, operand_layout: gl.constexpr):
        """One column block for one warp group's rows: ``out += (SiLU(q K^T) * q U^T * gate) V``. Both products
        complete within the step (the second reads its left operand from registers; see ``_rows_step``)."""
        dtype: gl.constexpr = q_tile.dtype
        pre = warpgroup_mma(q_tile, ku_tile.permute([1, 0]), gl.zeros([ROWS, 2 * BLOCK_N], gl.float32, wide_layout),
                            use_acc=False, is_async=True)
        pre = warpgroup_mma_wait(0, deps=[pre])
        gate_pre, up = pre.reshape([ROWS, 2, BLOCK_N]).permute([0, 2, 1]).split()
        gate_pre = gl.convert_layout(gate_pre, half_layout, assert_trivial=True)
        up = gl.convert_layout(up, half_layout, assert_trivial=True)
        hidden = _fast_silu(gate_pre) * up * gate[:, None]
        hidden = gl.convert_layout(hidden.to(dtype), operand_layout)
        out = warpgroup_mma(hidden, v_tile, out, is_async=True)
        out, hidden = warpgroup_mma_wait(0, deps=[out, hidden])
        return out

    @gluon.jit
    def _forward_consumer(part, Q, R, O, O_SPLITS, q_tile, ku_stages, v_stages, ready, empty,
                          stride_qb, stride_qh, stride_ql, stride_ob, stride_oh, stride_ol, first_row, group,
                          total_rows, seq_len, group_size, num_heads, num_subnetworks, first_block, num_blocks,
                          split_row, D_H: gl.constexpr, D_E: gl.constexpr, ROWS: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """One warp group: the output of its ROWS rows (part ``part`` of the program's row block) over column blocks
        first_block .. first_block + num_blocks, written to O, or (split_row >= 0) as float32 rows split_row + part *
        ROWS .. of O_SPLITS [rows, d_h]."""
        # [gate | up] pre-activations and the output: 2 * BLOCK_N = D_H columns; the activations as the output
        # product's left operand
        wide_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, D_H, 16])
        half_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                              instr_shape=[16, BLOCK_N, 16])
        operand_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wide_layout, k_width=2)
        load_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, half_layout)

        first = first_row + part * ROWS
        q_tile.store(_row_block_tile(Q, first, group, seq_len, group_size, total_rows, stride_qb, stride_qh,
                                     stride_ql, ROWS, D_H, load_layout))
        fence_async_shared()
        _cta_barrier()  # the warp group's four warps wrote the tile its products read

        gate_offsets, gate_mask = _row_gate_offsets(first, group, total_rows, seq_len, group_size, num_heads,
                                                    num_subnetworks, ROWS, row_layout)

        out = gl.zeros([ROWS, D_H], gl.float32, wide_layout)
        next_gate = _block_gates(R, gate_offsets, gate_mask, first_block, BLOCK_N, D_E)
        for block in range(num_blocks):  # counted from the program's first column block (the ring's phases)
            stage = block % STAGES
            gate = next_gate
            # (the last iteration's "next" gates lie past the range: masked, nothing is read)
            next_gate = _block_gates(R, gate_offsets, gate_mask & (block + 1 < num_blocks), first_block + block + 1,
                                     BLOCK_N, D_E)
            mbarrier.wait(ready.index(stage), (block // STAGES) & 1)
            out = _forward_step(q_tile, ku_stages.index(stage), v_stages.index(stage), out, gate, ROWS, BLOCK_N,
                                wide_layout, half_layout, operand_layout)
            mbarrier.arrive(empty.index(stage), count=1)  # this warp group is done with the slot

        if split_row >= 0:  # one column range of a split row block: float32 rows for `_add_forward_splits_kernel`
            rows = split_row + part * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, wide_layout))
            dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, wide_layout))
            gl.store(O_SPLITS + rows.to(gl.int64)[:, None] * D_H + dims[None, :], out)
        else:
            _store_row_block(O, out, first, group, total_rows, seq_len, group_size, stride_ob, stride_oh, stride_ol,
                             ROWS, D_H, wide_layout)

    @gluon.jit
    def _warp_specialised_forward_kernel(
        Q, k_desc, u_desc, v_desc, R, O, O_SPLITS,
        stride_qb, stride_qh, stride_ql, stride_ob, stride_oh, stride_ol,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, row_blocks, split_from, splits,
        D_H: gl.constexpr, D_E: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGISTERS: gl.constexpr,
    ):
        """The output of one block of 3 x 64 rows of one weight group, split like the dq/dr kernel: three warp groups
        of four warps, one per 64 rows, each in its own partition, and one loading warp that streams the column
        blocks through a ring of STAGES slots. Q, O: [B, H, L, d_h] through their (batch, head, position) strides;
        k/u/v_desc: [H_kv * E * d_e, d_h] with block [BLOCK_N, d_h]; R: contiguous [B, H, L, E].

        Programs 0 .. split_from - 1 each own a row block (``row_blocks`` per weight group, the groups one after the
        other) and all its column blocks. The row blocks from ``split_from`` on (the last, partly filled round of
        programs) are each split into ``splits`` column ranges, one program per range, which writes its float32
        share into O_SPLITS [(row blocks - split_from) * splits * 192, d_h] for `_add_forward_splits_kernel`."""
        dtype: gl.constexpr = k_desc.dtype
        ROWS: gl.constexpr = 64
        CONSUMERS: gl.constexpr = 3
        program = gl.program_id(0)
        all_blocks = num_subnetworks * (D_E // BLOCK_N)
        if program < split_from:
            tile = program
            first_block = 0
            num_blocks = all_blocks
            split_row = -1
        else:
            share = program - split_from
            split = share % splits
            tile = split_from + share // splits
            first_block = split * all_blocks // splits
            num_blocks = (split + 1) * all_blocks // splits - first_block
            split_row = share * (CONSUMERS * ROWS)
        group = tile // row_blocks
        first_row = (tile - group * row_blocks) * (CONSUMERS * ROWS)
        tile_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, D_H], dtype)

        # shared memory: each warp group's q rows and a ring of STAGES column blocks (K and U rows stacked
        # [2 * BLOCK_N, d_h], V rows [BLOCK_N, d_h]), with a "ready" and an "empty" barrier per slot
        q_tiles = gl.allocate_shared_memory(dtype, [CONSUMERS, ROWS, D_H], tile_layout)
        ku_stages = gl.allocate_shared_memory(dtype, [STAGES, 2 * BLOCK_N, D_H], k_desc.layout)
        v_stages = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D_H], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(stage), count=1)
            mbarrier.init(empty.index(stage), count=CONSUMERS)
        fence_async_shared()

        weight_row = (group * num_subnetworks * (D_E // BLOCK_N) + first_block) * BLOCK_N
        gl.warp_specialize([
            (_forward_consumer, (0, Q, R, O, O_SPLITS, q_tiles.index(0), ku_stages, v_stages, ready, empty, stride_qb,
                                 stride_qh, stride_ql, stride_ob, stride_oh, stride_ol, first_row, group,
                                 total_rows, seq_len, group_size, num_heads, num_subnetworks, first_block, num_blocks,
                                 split_row, D_H, D_E, ROWS, BLOCK_N, STAGES)),
            (_forward_consumer, (1, Q, R, O, O_SPLITS, q_tiles.index(1), ku_stages, v_stages, ready, empty, stride_qb,
                                 stride_qh, stride_ql, stride_ob, stride_oh, stride_ol, first_row, group,
                                 total_rows, seq_len, group_size, num_heads, num_subnetworks, first_block, num_blocks,
                                 split_row, D_H, D_E, ROWS, BLOCK_N, STAGES)),
            (_forward_consumer, (2, Q, R, O, O_SPLITS, q_tiles.index(2), ku_stages, v_stages, ready, empty, stride_qb,
                                 stride_qh, stride_ql, stride_ob, stride_oh, stride_ol, first_row, group,
                                 total_rows, seq_len, group_size, num_heads, num_subnetworks, first_block, num_blocks,
                                 split_row, D_H, D_E, ROWS, BLOCK_N, STAGES)),
            (_rows_producer, (k_desc, u_desc, v_desc, ku_stages, v_stages, ready, empty, weight_row, num_blocks,
                              BLOCK_N, STAGES)),
        ], [4, 4, 1], [CONSUMER_REGISTERS, CONSUMER_REGISTERS, 24])

    @gluon.jit
    def _add_forward_splits_kernel(O_SPLITS, O, stride_ob, stride_oh, stride_ol, total_rows, seq_len, group_size,
                                   row_blocks, split_from, splits, D_H: gl.constexpr, ROWS: gl.constexpr):
        """The output of 64 rows of a split row block of the forward: its ``splits`` float32 shares added in order
        (the result does not depend on which program finished first) and written to O in O's dtype. Program ``i``
        takes rows (i % 3) * 64 .. of split row block ``i // 3``."""
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        index = gl.program_id(0)
        third = index % 3
        tile = split_from + index // 3
        group = tile // row_blocks
        first = (tile - group * row_blocks) * (3 * ROWS) + third * ROWS
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        dims = gl.arange(0, D_H, layout=gl.SliceLayout(0, layout))
        offsets = rows.to(gl.int64)[:, None] * D_H + dims[None, :]
        base = ((index // 3) * splits * 3 + third) * ROWS * D_H
        total = gl.load(O_SPLITS + base + offsets)
        for split in range(1, splits):
            total += gl.load(O_SPLITS + base + split * (3 * ROWS * D_H) + offsets)
        _store_row_block(O, total, first, group, total_rows, seq_len, group_size, stride_ob, stride_oh, stride_ol,
                         ROWS, D_H, layout)

    # the builds that inference launches, compiled once whatever the number of tokens (`triton_launch.any_size`)
    _FORWARD_SIZES = ("total_rows", "seq_len", "row_blocks", "split_from", "splits")
    _warp_specialised_forward_any_size = any_size(_warp_specialised_forward_kernel, *_FORWARD_SIZES)
    _add_forward_splits_any_size = any_size(_add_forward_splits_kernel, *_FORWARD_SIZES)


def descriptor_ready(t: torch.Tensor) -> torch.Tensor:
    """``t``, or an aligned copy of it: a bulk tensor copy needs a 16-byte aligned base and 16-byte multiples as
    strides (but the last). Both kernel modules build their tensor descriptors from it."""
    size = t.element_size()
    if t.data_ptr() % 16 or any(stride * size % 16 for stride in t.stride()[:-1]):
        # a new allocation, hence aligned (contiguous() returns an already contiguous tensor as it is)
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


@functools.lru_cache(maxsize=None)
def _shared_layout(block_shape: tuple, dtype: torch.dtype):
    """The shared-memory layout of a tensor descriptor's ``block_shape`` tiles (the same object for every launch)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), _gl_dtype(dtype))


def _launch_sizes(q, k, kernel: str):
    """Checks that the Gluon kernels can run, then (B, H, L, d_h, H_kv, E, d_e, H / H_kv)."""
    reason = gluon_unsupported_reason(q, k)
    if reason is not None:
        raise ValueError(f"the Gluon {kernel} kernel cannot run: {reason}")
    return (*q.shape, *k.shape[:3], q.shape[1] // k.shape[0])


_DESCRIPTORS: dict = {}  # (dtype, shape, strides, block shape) -> a checked descriptor without its base
MAX_DESCRIPTORS = 1024


def tensor_descriptor(t: torch.Tensor, block_shape: tuple) -> GluonTensorDescriptor:
    """The tensor descriptor of ``t`` (16-byte aligned, from `descriptor_ready`) read in ``block_shape`` tiles, with
    their shared-memory layout. Gluon's descriptor checks its fields when it is built (alignment, strides, layout);
    those checks depend only on the dtype, the shape, the strides and the alignment, so they run once per such key,
    and later descriptors are copies of that checked one with ``t`` as their base (on a CPU 2.3 µs against 4.1 for a
    checked build, `kernels/launch_host_cpu.py`), carrying that key for `triton_launch.launch`'s signature."""
    aligned = t.data_ptr() % 16 == 0
    key = (t.dtype, t.shape, t.stride(), block_shape, aligned)
    checked = _DESCRIPTORS.get(key)
    if checked is None:
        checked = GluonTensorDescriptor(t, list(t.shape), list(t.stride()), list(block_shape),
                                        _shared_layout(block_shape, t.dtype))
        checked.base = None  # (the kept copy holds no tensor)
        if len(_DESCRIPTORS) >= MAX_DESCRIPTORS:
            _DESCRIPTORS.clear()
        _DESCRIPTORS[key] = checked
    descriptor = object.__new__(GluonTensorDescriptor)
    descriptor.__dict__.update(checked.__dict__)
    descriptor.base = t
    # what a launch's compiled kernel may depend on, for `triton_launch.launch` (which otherwise reads every field)
    descriptor.launch_key = (GluonTensorDescriptor, *key)
    return descriptor


def weight_descriptors(k, u, v):
    """The [BLOCK_N, d_h] tensor descriptors of contiguous [H_kv, E, d_e, d_h] weights, as both Gluon kernels read
    them: ``triton_backward`` builds them once for the two launches."""
    return tuple(tensor_descriptor(descriptor_ready(w.reshape(-1, w.shape[-1])), (BLOCK_N, w.shape[-1]))
                 for w in (k, u, v))


def gluon_weight_gradients(grad_out, q, k, u, v, r, outputs=None, weights=None, split: bool | None = None,
                           splits: int | None = None):
    """(dK, dU, dV) in the weights' dtype; q and grad_out [B, H, L, d_h] (any strides with a dense last dimension),
    k, u, v contiguous [H_kv, E, d_e, d_h], r contiguous [B, H, L, E]. ``outputs``: three contiguous tensors to
    write instead of new ones (the fused layer passes the thirds of one gradient buffer); ``weights``: k, u, v's
    `weight_descriptors`, when the caller has them; ``split=False`` (tests and benchmarks): no tile split into row
    ranges (see `weight_splits`; None: ``SPLIT_WEIGHT_TILES``); ``splits`` (benchmarks): the number of row ranges
    instead of the one `weight_splits` picks. Returns the gradients and the compiled kernel."""
    batch, num_heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, group_size = _launch_sizes(
        q, k, "weight-gradient")

    def sequence_descriptor(t):
        return tensor_descriptor(descriptor_ready(t), (1, 1, BLOCK_L, head_dim))

    grads = outputs if outputs is not None else [torch.empty_like(w) for w in (k, u, v)]
    tiles = num_subnetworks * subnetwork_size // BLOCK_N * kv_heads
    if SPLIT_WEIGHT_TILES if split is None else split:
        row_blocks = batch * group_size * -(-seq_len // BLOCK_L)
        split_from, splits = weight_splits(tiles, multiprocessor_count(q.device), row_blocks, splits)
    else:
        split_from, splits = tiles, 1
    split_tiles = tiles - split_from
    # float32 shares of the split tiles (when none is split, the float32 gates: a pointer the kernel does not read)
    shares = q.new_empty((split_tiles * splits * 3 * BLOCK_N * head_dim,), dtype=torch.float32) if split_tiles else r
    compiled = launch(
        _weight_gradients_kernel, (split_from + split_tiles * splits,),
        sequence_descriptor(q), sequence_descriptor(grad_out if grad_out.dtype == q.dtype else grad_out.to(q.dtype)),
        *(weights or weight_descriptors(k, u, v)), r, *grads, shares,
        batch * group_size * seq_len, seq_len, group_size, num_heads, num_subnetworks, split_from, splits,
        D_H=head_dim, D_E=subnetwork_size, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS,
    )
    if split_tiles:
        launch(_add_weight_splits_kernel, (3 * split_tiles,), shares, *grads, split_from, splits, D_H=head_dim,
               BLOCK_N=BLOCK_N, num_warps=4)
    return (*grads, compiled)


def weight_row_ranges(splits: int, row_blocks: int) -> list[tuple[int, int]]:
    """The (first, end) row blocks of each of a split tile's ``splits`` ranges, as `_row_range` computes them: starts
    at multiples of 4 row blocks (the kernel's two stages and their barrier phases then follow from a row block's
    index), the last range taking the remainder."""
    fours = row_blocks // 4
    starts = [4 * (split * fours // splits) for split in range(splits)]
    return list(zip(starts, starts[1:] + [row_blocks]))


@functools.lru_cache(maxsize=256)  # asked at every backward call: the count of row blocks is Python loops
def weight_splits(tiles: int, multiprocessors: int, row_blocks: int, splits: int | None = None) -> tuple[int, int]:
    """(split_from, splits) of the weight kernel's launch for ``tiles`` programs (one per multiprocessor at a time)
    of ``row_blocks`` row blocks each. When the tiles are not a multiple of the multiprocessors, the last round of
    programs leaves some idle (at the 370M preset's layer shape 336 = 2 x 132 + 72: 72 programs run a third round
    alone). The tiles of that round are then split into ``splits`` row ranges (`weight_row_ranges`), the number that
    finishes the round soonest by a count of row blocks: rounds of ranges times (the longest range + what a range's
    start and float32 shares cost, ``WEIGHT_SPLIT_COST_ROW_BLOCKS``). At 370M that is 3 ranges, 216 programs in two
    rounds of 44 + 4 row blocks against one round of 128 + 4 (5 and 7 ranges cost the same; on an H100 3, 5 and 7 ran
    within 0.5% of each other, 5.5-6% faster than no split; flash_mhf_notes.md, v35). No split unless that saves a
    tenth of the round (at the 1.3B preset's shape the last round is 120 of 132 tiles, and none is split). ``splits``
    (benchmarks): that many ranges instead, where a last round exists."""
    last_round = tiles % multiprocessors
    most = min(WEIGHT_MAX_SPLITS, row_blocks // 4)  # (each range at least 4 row blocks)
    if splits is not None:
        if not 1 <= splits <= max(1, most):
            raise ValueError(f"splits={splits}: expected 1 to {max(1, most)} for {row_blocks} row blocks (at least "
                             f"4 per range, at most WEIGHT_MAX_SPLITS={WEIGHT_MAX_SPLITS})")
        return (tiles - last_round, splits) if last_round and splits > 1 else (tiles, 1)
    if not last_round:
        return tiles, 1

    def round_cost(splits: int) -> float:
        longest = max(end - first for first, end in weight_row_ranges(splits, row_blocks))
        return -(-last_round * splits // multiprocessors) * (longest + WEIGHT_SPLIT_COST_ROW_BLOCKS)

    splits = min(range(1, max(1, most) + 1), key=lambda n: (round_cost(n), n))
    if splits < 2 or round_cost(splits) > 0.9 * round_cost(1):
        return tiles, 1
    return tiles - last_round, splits


class FusedGates(NamedTuple):
    """What the dq/dr kernel needs to run the fused layer's norm/gate backward after dq (`_gates_backward_epilogue`):
    the input projection's output ``p`` [tokens, H * d_h] (rows of tokens), the norm weight [d_h] and router [H, d_h,
    E] (or None), the gates' totals [B, H, L] (float32, None without a router), and the outputs: ``grad_p`` like p,
    ``norm_parts`` [slots, H, d_h] and ``router_parts`` [slots, H, E_DOT, d_h] (float32, `gate_partial_slots`
    slots, each written once; None without a norm / router)."""

    p: torch.Tensor
    norm_weight: torch.Tensor | None
    router: torch.Tensor | None
    totals: torch.Tensor | None
    grad_p: torch.Tensor
    norm_parts: torch.Tensor | None
    router_parts: torch.Tensor | None
    eps: float


def gate_partial_slots(tokens: int) -> int:
    """Slots of the partial sums that the dq/dr kernel's norm/gate epilogue writes per head: one per warp group."""
    return 2 * -(-tokens // BLOCK_L)


def gluon_rows_gradients(grad_out, q, k, u, v, r, outputs=None, weights=None, fused_gates: FusedGates | None = None):
    """(dq, dr): dq in q's dtype and layout, dr like r; q and grad_out [B, H, L, d_h] (any strides with a dense last
    dimension), k, u, v contiguous [H_kv, E, d_e, d_h], r contiguous [B, H, L, E]. ``outputs`` (benchmarks): two
    tensors to write instead of new ones; ``weights``: k, u, v's `weight_descriptors`, when the caller has them.
    ``fused_gates`` (the fused layer's backward; one head per weight group): the kernel then writes its outputs
    instead of dq, which it returns in dq's place. Returns the gradients and the compiled kernel."""
    batch, num_heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, group_size = _launch_sizes(
        q, k, "dq/dr")
    total_rows = batch * group_size * seq_len
    if grad_out.dtype != q.dtype:
        grad_out = grad_out.to(q.dtype)
    grad_q, grad_r = outputs if outputs is not None else (None, torch.empty_like(r))
    if fused_gates is None:
        grad_q = grad_q if grad_q is not None else torch.empty_like(q)
        strides = grad_q.stride()[:3]
        extra = (q, q, q, r, r, r, 0, 0.0)  # pointers the kernel does not read
        flags = dict(E_DOT=16, FUSED_GATES=False, HAS_NORM=False, HAS_ROUTER=False)
    else:
        if group_size != 1:
            raise ValueError(f"the fused norm/gate backward needs one head per weight group; got {group_size}")
        gates = fused_gates
        grad_q, strides = gates.grad_p, (0, 0, 0)
        # (a tensor the kernel does not read, where its flag is off, still needs a pointer)
        extra = (gates.p, *(t if t is not None else gates.p for t in (gates.norm_weight, gates.router)),
                 *(t if t is not None else r for t in (gates.totals, gates.norm_parts, gates.router_parts)),
                 gates.p.stride(0), gates.eps)
        e_dot = gates.router_parts.shape[2] if gates.router_parts is not None else 16
        flags = dict(E_DOT=e_dot, FUSED_GATES=True, HAS_NORM=gates.norm_weight is not None,
                     HAS_ROUTER=gates.router is not None)
    compiled = launch(
        _rows_gradients_kernel, (-(-total_rows // BLOCK_L), kv_heads),
        q, grad_out, *(weights or weight_descriptors(k, u, v)), r, grad_q, grad_r,
        *q.stride()[:3], *grad_out.stride()[:3], *strides,
        total_rows, seq_len, group_size, num_heads, num_subnetworks, *extra,
        D_H=head_dim, D_E=subnetwork_size, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, STAGES=ROWS_STAGES, num_warps=ROWS_WARPS,
        **flags,
    )
    return grad_q, grad_r, compiled


@functools.lru_cache(maxsize=None)
def _multiprocessor_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def multiprocessor_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (looked up once per device)."""
    return _multiprocessor_count_of(device.index if device.index is not None else torch.cuda.current_device())


def forward_splits(row_blocks: int, multiprocessors: int, column_blocks: int) -> tuple[int, int]:
    """(split_from, splits) of the forward's launch for ``row_blocks`` programs of 192 rows (one per multiprocessor
    at a time). The last round of programs leaves multiprocessors idle when the row blocks are not a multiple of
    their number (at both presets' shapes 688 = 5 x 132 + 28: 28 programs run a sixth round alone). The row blocks
    from ``split_from`` on are therefore split into ``splits`` column ranges, enough to fill that round (28 x 4 =
    112 programs of a quarter of the work), each at least ``FORWARD_MIN_SPLIT_BLOCKS`` column blocks long."""
    last_round = row_blocks % multiprocessors
    splits = min(multiprocessors // last_round, column_blocks // FORWARD_MIN_SPLIT_BLOCKS) if last_round else 1
    if splits < 2:
        return row_blocks, 1
    return row_blocks - last_round, splits


_ADD_SPLITS_COMPILED: set = set()  # (device, dtype, d_h) for which inference's build of the splits' sum is compiled


def _load_now(compiled) -> None:
    """Load a kernel compiled ahead of its first launch (``JITFunction.warmup``) onto the device now. Its first launch
    would do it: load the module and build the launcher for its arguments, which Triton compiles from C source with
    the host's compiler when its disk cache does not hold it (0.34 s on an H100 machine: the first split prompt
    of a continuous-batching process was that much slower, `examples/results/continuous_batching_h100_rounds/
    first_step/`). Indexing a compiled kernel with a grid loads it and launches nothing (Triton 3.6 to 3.9)."""
    if hasattr(compiled, "result"):  # Triton's asynchronous compilation mode returns a future
        compiled = compiled.result()
    if compiled is not None:
        compiled[(1, 1, 1)]


def gluon_forward(q, k, u, v, r, out=None, weights=None, split: bool = True, inference: bool = False):
    """The FlashMHF output in q's dtype and layout; q [B, H, L, d_h] (any strides with a dense last dimension), k, u,
    v contiguous [H_kv, E, d_e, d_h], r contiguous [B, H, L, E]. ``out`` (benchmarks): a tensor to write instead of a
    new one; ``weights``: k, u, v's `weight_descriptors`, when the caller has them; ``split=False`` (tests and
    benchmarks): no row block split into column ranges (see `forward_splits`); ``inference``: the kernels' builds for
    any number of tokens. Returns the output and the compiled kernel."""
    batch, num_heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, group_size = _launch_sizes(
        q, k, "forward")
    total_rows = batch * group_size * seq_len
    out = out if out is not None else torch.empty_like(q)
    row_blocks = -(-total_rows // FORWARD_BLOCK_L)
    tiles = row_blocks * kv_heads
    column_blocks = num_subnetworks * subnetwork_size // BLOCK_N
    split_from, splits = tiles, 1
    if split:
        split_from, splits = forward_splits(tiles, multiprocessor_count(q.device), column_blocks)
    split_tiles = tiles - split_from
    # float32 shares of the split row blocks (a 4-byte placeholder when none is split)
    shares = q.new_empty((max(1, split_tiles * splits * FORWARD_BLOCK_L), head_dim), dtype=torch.float32)
    sizes = (total_rows, seq_len, group_size)
    forward, add_splits = ((_warp_specialised_forward_any_size, _add_forward_splits_any_size) if inference
                           else (_warp_specialised_forward_kernel, _add_forward_splits_kernel))
    compiled = launch(
        forward, (split_from + split_tiles * splits,),
        q, *(weights or weight_descriptors(k, u, v)), r, out, shares, *q.stride()[:3], *out.stride()[:3],
        *sizes, num_heads, num_subnetworks, row_blocks, split_from, splits,
        D_H=head_dim, D_E=subnetwork_size, BLOCK_N=BLOCK_N, STAGES=FORWARD_STAGES,
        CONSUMER_REGISTERS=FORWARD_REGISTERS, num_warps=ROWS_WARPS,
    )
    # inference compiles the splits' sum with the forward's first call rather than in the middle of serving, at the
    # first prompt whose last round of programs is split (its build for any size: these arguments compile what that
    # launch runs)
    first_inference = inference and (q.device, q.dtype, head_dim) not in _ADD_SPLITS_COMPILED
    if split_tiles or first_inference:
        arguments = (shares, out, *out.stride()[:3], *sizes, row_blocks, split_from, splits)
        options = dict(D_H=head_dim, ROWS=FORWARD_BLOCK_L // 3, num_warps=4)
        if split_tiles:
            launch(add_splits, (3 * split_tiles,), *arguments, **options)
        else:
            _load_now(add_splits.warmup(*arguments, grid=(1,), **options, **COMPILE_OPTIONS))
        if first_inference:
            _ADD_SPLITS_COMPILED.add((q.device, q.dtype, head_dim))
    return out, compiled


def compile_for_hopper(kernel: str = "weights", dtype: torch.dtype = torch.bfloat16, subnetwork_size: int = 384,
                       fused_gates: bool = False) -> dict:
    """Compile ``kernel`` ("weights": dK/dU/dV; "add_weight_splits": its split tiles added up; "rows": dq/dr, with
    ``fused_gates`` the fused layer's norm/gate backward after it; "forward": the output; "add_forward_splits": the
    forward's split row blocks added up) for sm_90 without a GPU (tests and compile reports): its shared memory in
    bytes, the number of wgmma instructions in its PTX, and the compiled kernel (``asm`` holds its PTX and cubin). It
    is compiled without a launch's specialisation of its arguments (aligned pointers, integers that are multiples of
    16), on which registers and spills can depend; ``kernels/compare_triton_builds.py export`` compiles exactly what a
    launch compiles."""
    try:  # (in a `try` block: transformers refuses to load a checkpoint's code whose files import a missing package
        # outside one, and triton is optional)
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.experimental.gluon._runtime import GluonASTSource
        from triton.runtime.jit import mangle_type
    except ImportError as error:
        raise ImportError(f"compile_for_hopper needs triton's Gluon compiler: {error}") from error

    kernels = {"weights": _weight_gradients_kernel, "add_weight_splits": _add_weight_splits_kernel,
               "rows": _rows_gradients_kernel, "forward": _warp_specialised_forward_kernel,
               "add_forward_splits": _add_forward_splits_kernel}
    if kernel not in kernels:
        raise ValueError(f"kernel={kernel!r}: expected one of {', '.join(kernels)}")
    element = _gl_dtype(dtype)
    sequence = torch.empty(1, 1, BLOCK_L, HEAD_DIM, dtype=dtype)
    weights = torch.empty(BLOCK_N, HEAD_DIM, dtype=dtype)
    sequence_desc = GluonTensorDescriptor(sequence, list(sequence.shape), list(sequence.stride()),
                                          [1, 1, BLOCK_L, HEAD_DIM],
                                          gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_L, HEAD_DIM], element))
    weight_desc = GluonTensorDescriptor(weights, list(weights.shape), list(weights.stride()), [BLOCK_N, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], element))
    fn = kernels[kernel]
    constants = dict(D_H=HEAD_DIM, D_E=subnetwork_size, BLOCK_N=BLOCK_N)
    if kernel == "weights":
        constants.update(BLOCK_L=BLOCK_L, NUM_WARPS=NUM_WARPS)
    elif kernel == "rows":
        constants.update(BLOCK_L=BLOCK_L, STAGES=ROWS_STAGES, E_DOT=16, FUSED_GATES=fused_gates, HAS_NORM=fused_gates,
                         HAS_ROUTER=fused_gates)
    elif kernel == "forward":
        constants.update(STAGES=FORWARD_STAGES, CONSUMER_REGISTERS=FORWARD_REGISTERS)
    elif kernel == "add_weight_splits":
        constants = dict(D_H=HEAD_DIM, BLOCK_N=BLOCK_N)
    else:
        constants = dict(D_H=HEAD_DIM, ROWS=FORWARD_BLOCK_L // 3)
    pointer = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("q_desc", "grad_out_desc"):
            signature[name] = mangle_type(sequence_desc)
        elif name.endswith("_desc"):
            signature[name] = mangle_type(weight_desc)
        elif name in ("R", "DR", "TOTALS", "NORM_PARTS", "ROUTER_PARTS", "NORM_W", "ROUTER", "O_SPLITS", "SHARES"):
            signature[name] = "*fp32"
        elif name in ("Q", "DO", "DQ", "DK", "DU", "DV", "O", "P"):
            signature[name] = pointer
        elif name == "eps":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})
    warps = NUM_WARPS if kernel == "weights" else ROWS_WARPS  # (4 for the splits' sums too)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **COMPILE_OPTIONS})
    return {"shared_memory": compiled.metadata.shared, "wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
            "compiled": compiled}
