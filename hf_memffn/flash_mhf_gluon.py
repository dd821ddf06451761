"""FlashMHF weight gradients (dK, dU, dV) as an explicitly scheduled Gluon kernel for Hopper GPUs.

Same maths and work split as ``_backward_weights_kernel`` in ``flash_mhf_triton.py`` (one program per column block of
``BLOCK_N`` sub-network units, resident ``K, U, V`` tiles, the row blocks of every sequence streamed through, the
gradients accumulated transposed as ``[d_h, BLOCK_N]``), written in Gluon so that the schedule is ours rather than
the compiler's pipeliner's:

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
iteration has two CTA-wide barriers (tiles free, tiles written).

Only Hopper (sm_90) runs it, for 16-bit inputs at ``d_h = 128`` with ``d_e`` a multiple of 64; ``flash_mhf_triton``
decides when it is used and ``hf_memffn.flash_mhf_path`` says so. Gluon has no interpreter mode: the CPU tests compile
it for sm_90 and the GPU tests compare it with the float64 reference.
"""

from __future__ import annotations

import torch

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

# The one launch shape: 128 rows per row block (one 64-row half per warp group), 64 columns per program.
BLOCK_L, BLOCK_N, NUM_WARPS = 128, 64, 8
HEAD_DIM = 128


def gluon_weights_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the Gluon weight-gradient kernel cannot run these inputs, or None when it can."""
    if not GLUON_AVAILABLE:
        return f"triton's Gluon Hopper API is not importable ({GLUON_IMPORT_ERROR})"
    if q.device.type != "cuda":
        return f"tensors are on {q.device.type}"
    if torch.cuda.get_device_capability(q.device)[0] != 9:
        return "it needs a Hopper GPU (compute capability 9.x)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {q.dtype} (it takes float16 and bfloat16)"
    if q.shape[-1] != HEAD_DIM:
        return f"head_dim={q.shape[-1]} (it takes {HEAD_DIM})"
    if k.shape[2] % BLOCK_N:
        return f"subnetwork_size={k.shape[2]} (it takes multiples of {BLOCK_N})"
    return None


if GLUON_AVAILABLE:

    @gluon.jit
    def _fast_sigmoid(x):
        # sigmoid(x) = (1 + tanh(x / 2)) / 2 with the single-instruction hardware tanh (16-bit inputs only)
        t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x * 0.5], dtype=gl.float32, is_pure=True,
                                      pack=1)
        return 0.5 * t + 0.5

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
    def _weight_gradients_kernel(
        q_desc, grad_out_desc, k_desc, u_desc, v_desc, R, DK, DU, DV,
        total_rows, seq_len, group_size, num_heads, num_subnetworks,
        D_H: gl.constexpr, D_E: gl.constexpr, BLOCK_L: gl.constexpr, BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        """q_desc, grad_out_desc: [B, H, L, d_h] with block [1, 1, BLOCK_L, d_h]; k/u/v_desc: [H_kv * E * d_e, d_h]
        with block [BLOCK_N, d_h]; DK, DU, DV: contiguous [H_kv, E, d_e, d_h]."""
        dtype: gl.constexpr = q_desc.dtype
        col0 = gl.program_id(0) * BLOCK_N
        group = gl.program_id(1)
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
        num_row_blocks = (total_rows // seq_len) * blocks_per_sequence
        _load_row_block(q_desc, grad_out_desc, q_stages.index(0), grad_out_stages.index(0), ready.index(0), 0, group,
                        blocks_per_sequence, group_size, BLOCK_L)
        next_gate = _row_block_gates(R, 0, group, seq_len, blocks_per_sequence, group_size, num_heads,
                                     num_subnetworks, subnetwork, BLOCK_L, row_layout)

        zero_pre_activations = gl.zeros([BLOCK_L, 2 * BLOCK_N], gl.float32, ku_layout)
        zero_activations = gl.zeros([BLOCK_L, BLOCK_N], gl.float32, acc_layout)
        grad_ku = warpgroup_mma_init(gl.zeros([D_H, 2 * BLOCK_N], gl.float32, ku_layout))  # [dK^T | dU^T]
        grad_v = warpgroup_mma_init(gl.zeros([D_H, BLOCK_N], gl.float32, acc_layout))
        mbarrier.wait(weights_ready, 0)
        ku_t = ku_tile.permute([1, 0])
        v_t = v_tile.permute([1, 0])

        for row_block in range(num_row_blocks):
            stage = row_block % 2
            mbarrier.wait(ready.index(stage), (row_block // 2) & 1)
            q = q_stages.index(stage).reshape([BLOCK_L, D_H])
            grad_out = grad_out_stages.index(stage).reshape([BLOCK_L, D_H])
            gate = next_gate
            next_gate = _row_block_gates(R, gl.minimum(row_block + 1, num_row_blocks - 1), group, seq_len,
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
            if row_block + 1 < num_row_blocks:
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
        offsets = (group.to(gl.int64) * num_subnetworks * D_E + col0 + cols)[None, :] * D_H + dims[:, None]
        gl.store(DV + offsets, grad_v.to(DV.dtype.element_ty))
        # columns [0, BLOCK_N) of the joint accumulator are dK^T, the others dU^T
        ku_dims = gl.arange(0, D_H, layout=gl.SliceLayout(1, ku_layout))
        ku_cols = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(0, ku_layout))
        is_u = (ku_cols >= BLOCK_N)[None, :] & (ku_dims >= 0)[:, None]
        ku_offsets = ((group.to(gl.int64) * num_subnetworks * D_E + col0 + ku_cols % BLOCK_N)[None, :] * D_H
                      + ku_dims[:, None])
        gl.store(DK + ku_offsets, grad_ku.to(DK.dtype.element_ty), mask=~is_u)
        gl.store(DU + ku_offsets, grad_ku.to(DU.dtype.element_ty), mask=is_u)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def gluon_weight_gradients(grad_out, q, k, u, v, r, outputs=None):
    """(dK, dU, dV) in the weights' dtype; q and grad_out [B, H, L, d_h] (any strides with a dense last dimension),
    k, u, v contiguous [H_kv, E, d_e, d_h], r contiguous [B, H, L, E]. ``outputs`` (benchmarks): three tensors to
    write instead of new ones. Returns the gradients and the compiled kernel."""
    reason = gluon_weights_unsupported_reason(q, k)
    if reason is not None:
        raise ValueError(f"the Gluon weight-gradient kernel cannot run: {reason}")
    from .flash_mhf_triton import _descriptor_ready  # the sibling imports this module, so not at the top

    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, num_subnetworks, subnetwork_size, _ = k.shape
    group_size = num_heads // kv_heads
    element = _gl_dtype(q.dtype)
    sequence_layout = gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_L, head_dim], element)
    weight_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, head_dim], element)

    def sequence_descriptor(t):
        t = _descriptor_ready(t)
        return GluonTensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, BLOCK_L, head_dim], sequence_layout)

    def weight_descriptor(w):
        rows = _descriptor_ready(w.reshape(-1, head_dim))
        return GluonTensorDescriptor(rows, list(rows.shape), list(rows.stride()), [BLOCK_N, head_dim], weight_layout)

    grads = outputs if outputs is not None else [torch.empty_like(w) for w in (k, u, v)]
    compiled = _weight_gradients_kernel[(num_subnetworks * subnetwork_size // BLOCK_N, kv_heads)](
        sequence_descriptor(q), sequence_descriptor(grad_out.to(q.dtype)),
        *(weight_descriptor(w) for w in (k, u, v)), r, *grads,
        batch * group_size * seq_len, seq_len, group_size, num_heads, num_subnetworks,
        D_H=head_dim, D_E=subnetwork_size, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS,
        num_warps=NUM_WARPS,
    )
    return (*grads, compiled)


def compile_for_hopper(dtype: torch.dtype = torch.bfloat16, subnetwork_size: int = 384) -> dict:
    """Compile the kernel for sm_90 without a GPU (tests and compile reports): its shared memory in bytes and the
    number of wgmma instructions in its PTX (all of them are in the row loop)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    element = _gl_dtype(dtype)
    sequence = torch.empty(1, 1, BLOCK_L, HEAD_DIM, dtype=dtype)
    weights = torch.empty(BLOCK_N, HEAD_DIM, dtype=dtype)
    sequence_desc = GluonTensorDescriptor(sequence, list(sequence.shape), list(sequence.stride()),
                                          [1, 1, BLOCK_L, HEAD_DIM],
                                          gl.NVMMASharedLayout.get_default_for([1, 1, BLOCK_L, HEAD_DIM], element))
    weight_desc = GluonTensorDescriptor(weights, list(weights.shape), list(weights.stride()), [BLOCK_N, HEAD_DIM],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], element))
    fn = _weight_gradients_kernel
    constants = dict(D_H=HEAD_DIM, D_E=subnetwork_size, BLOCK_L=BLOCK_L, BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS)
    pointer = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("q_desc", "grad_out_desc"):
            signature[name] = mangle_type(sequence_desc)
        elif name.endswith("_desc"):
            signature[name] = mangle_type(weight_desc)
        elif name == "R":
            signature[name] = "*fp32"
        elif name in ("DK", "DU", "DV"):
            signature[name] = pointer
        else:
            signature[name] = "i32"
    source = GluonASTSource(fn=fn, signature=signature,
                            constexprs={(fn.arg_names.index(name),): value for name, value in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
    return {"shared_memory": compiled.metadata.shared,
            "wgmma_per_row_block": compiled.asm["ptx"].count("wgmma.mma_async")}
