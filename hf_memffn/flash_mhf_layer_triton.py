"""Triton kernels for the parts of the FlashMHF FFN layer around the fused op (see ``flash_mhf_layer`` in
``flash_mhf_op.py`` for the layer's maths and its public entry point).

The layer reads ``P = in_proj(x)``, ``[tokens, H * d_h]`` (the layout the projection writes: head ``h`` is the
column block ``h * d_h .. (h + 1) * d_h``), and per head computes

    q = RMSNorm(p) * w                           (the query norm; float32)
    r = sigmoid(q W_router) / (sum_E sigmoid(q W_router) + eps)      (the gates; float32)
    o = sum_e r_e (SiLU(q K_e^T) * (q U_e^T)) V_e                    (the op, from q rounded to the input dtype)

Kernels (all one program per block of tokens of one head; every row's norm and gates stay on chip):

* ``_queries_and_gates_kernel``: q (in P's layout and dtype, so the op kernels read it through strides, without a
  transpose) and r (float32, ``[B, H, L, E]``), in one pass over P; in training also the gates' totals, kept with q
  and r for the backward.
* ``_queries_and_gates_backward_kernel``: from the op's ``dq`` and ``dr``, the gradient of P (through the gates and
  the norm, in P's layout) and per-program partial sums of the norm-weight and router gradients (every output is
  written once, so the result is deterministic). Where the op's dq/dr kernel is its Gluon kernel and each weight
  group has one head, that kernel does this itself (``flash_mhf_gluon._gates_backward_epilogue``).
* ``_gate_gradient_sums_kernel``: either backward's partial sums added up, in a fixed order, into the norm-weight and
  router gradients.
* ``_decode_kernel``: the whole layer between the projections for a few tokens (decoding): norm, gates and the
  sub-networks in one launch. Programs split the heads' weight columns (the weights are what a decoding step reads)
  and write their float32 shares; ``_split_sum_kernel`` adds them up in a fixed order (no atomics: the output is the
  same from run to run).
"""

from __future__ import annotations

import contextlib
import functools

import torch

# (triton from the sibling that imports it in a `try` block: transformers refuses to load a checkpoint's code whose
# files import a missing package outside one, and triton is optional)
from .flash_mhf_triton import TRITON_AVAILABLE, _dot, _dot_acc, _kernel_flags, _num_sms, _sigmoid, tl, triton
from .triton_launch import any_size, cdiv, next_power_of_2
from .triton_launch import launch as launch_kernel

if TRITON_AVAILABLE:

    @triton.jit
    def _token_tile(P, tokens, token_mask, head, stride_token, D_H: tl.constexpr):
        """P[tokens, head * d_h : (head + 1) * d_h] in float32 (0 for masked tokens), and its offsets."""
        dims = tl.arange(0, D_H)
        offsets = tokens.to(tl.int64)[:, None] * stride_token + head * D_H + dims[None, :]
        return tl.load(P + offsets, mask=token_mask[:, None], other=0.0).to(tl.float32), offsets

    @triton.jit
    def _normalized(p, NORM_W, eps, D_H: tl.constexpr, HAS_NORM: tl.constexpr):
        """(q, p / rms(p), 1 / rms(p)) of a float32 tile; without a norm, (p, p, 1)."""
        if HAS_NORM:
            inv_rms = 1.0 / tl.sqrt(tl.sum(p * p, axis=1) / D_H + eps)
            p_hat = p * inv_rms[:, None]
            weight = tl.load(NORM_W + tl.arange(0, D_H)).to(tl.float32)
            return p_hat * weight[None, :], p_hat, inv_rms
        else:
            return p, p, tl.full([p.shape[0]], 1.0, tl.float32)

    @triton.jit
    def _router_tile(ROUTER, head, num_subnetworks, D_H: tl.constexpr, E_DOT: tl.constexpr):
        """Head ``head``'s router weights [d_h, E_DOT] in float32 (columns past E are 0)."""
        dims = tl.arange(0, D_H)
        subnetworks = tl.arange(0, E_DOT)
        offsets = (head * D_H + dims)[:, None] * num_subnetworks + subnetworks[None, :]
        return tl.load(ROUTER + offsets, mask=subnetworks[None, :] < num_subnetworks, other=0.0).to(tl.float32)

    @triton.jit
    def _gate_scores(q, router, num_subnetworks, E_DOT: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
        """(sigmoid scores s [rows, E_DOT], 0 past E) of float32 queries: the router product accumulated in float32
        (inputs rounded to tf32 when ROUTER_PRECISION is "tf32")."""
        logits = tl.dot(q, router, input_precision=ROUTER_PRECISION)
        scores = tl.sigmoid(logits)
        return tl.where(tl.arange(0, E_DOT)[None, :] < num_subnetworks, scores, 0.0)

    @triton.jit
    def _gates(q, ROUTER, head, num_subnetworks, gate_eps, D_H: tl.constexpr, E_DOT: tl.constexpr,
               HAS_ROUTER: tl.constexpr, ROUTER_PRECISION: tl.constexpr):
        """(the normalised gates r [rows, E_DOT] (float32, 0 past E), their totals sum_E sigmoid + gate_eps [rows])
        of float32 queries; r = 1 (and totals 1) without a router."""
        if HAS_ROUTER:
            scores = _gate_scores(q, _router_tile(ROUTER, head, num_subnetworks, D_H, E_DOT), num_subnetworks, E_DOT,
                                  ROUTER_PRECISION)
            total = tl.sum(scores, axis=1) + gate_eps
            return scores / total[:, None], total
        else:
            return tl.full([q.shape[0], E_DOT], 1.0, tl.float32), tl.full([q.shape[0]], 1.0, tl.float32)

    @triton.jit
    def _queries_and_gates_kernel(
        P, NORM_W, ROUTER, Q, R, TOTALS,
        num_tokens, seq_len, num_heads, num_subnetworks, stride_p, stride_q, eps, gate_eps,
        D_H: tl.constexpr, E_DOT: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_ROUTER: tl.constexpr, ROUTER_PRECISION: tl.constexpr, WITH_TOTALS: tl.constexpr,
    ):
        """WITH_TOTALS (set only with a router): also the gates' totals sum_E sigmoid(q W_router) + gate_eps, TOTALS
        [B, H, L]."""
        head = tl.program_id(1)
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = tokens < num_tokens
        p, _ = _token_tile(P, tokens, token_mask, head, stride_p, D_H)
        q, _, _ = _normalized(p, NORM_W, eps, D_H, HAS_NORM)
        dims = tl.arange(0, D_H)
        q_offsets = tokens.to(tl.int64)[:, None] * stride_q + head * D_H + dims[None, :]
        tl.store(Q + q_offsets, q.to(Q.dtype.element_ty), mask=token_mask[:, None])

        subnetworks = tl.arange(0, E_DOT)
        batch = (tokens // seq_len).to(tl.int64)
        gate_rows = (batch * num_heads + head) * seq_len + tokens % seq_len  # rows of r [B, H, L, E]
        gates, totals = _gates(q, ROUTER, head, num_subnetworks, gate_eps, D_H, E_DOT, HAS_ROUTER, ROUTER_PRECISION)
        if WITH_TOTALS:
            tl.store(TOTALS + gate_rows, totals, mask=token_mask)
        r_mask = token_mask[:, None] & (subnetworks[None, :] < num_subnetworks)
        tl.store(R + gate_rows[:, None] * num_subnetworks + subnetworks[None, :], gates, mask=r_mask)

    # the build that inference launches, compiled once whatever the number of tokens (`triton_launch.any_size`)
    _queries_and_gates_any_size = any_size(_queries_and_gates_kernel, "num_tokens", "seq_len")

    @triton.jit
    def _queries_and_gates_backward_kernel(
        P, NORM_W, ROUTER, DQ, DR, DP, DNORM_PARTS, DROUTER_PARTS,
        num_tokens, seq_len, num_heads, num_subnetworks, stride_p, stride_dq, stride_dp, eps, gate_eps,
        blocks_per_program,
        D_H: tl.constexpr, E_DOT: tl.constexpr, BLOCK_T: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_ROUTER: tl.constexpr, ROUTER_PRECISION: tl.constexpr,
        ROUTER_GRAD_TRANSPOSED: tl.constexpr,
    ):
        """DNORM_PARTS [programs, H, d_h] and DROUTER_PARTS [programs, H, d_h, E_DOT] (ROUTER_GRAD_TRANSPOSED:
        [programs, H, E_DOT, d_h], from the product grad_logits^T q, which transposes the small gate tile instead of
        the queries): this program's sums."""
        part = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, D_H)
        subnetworks = tl.arange(0, E_DOT)
        grad_norm = tl.zeros([D_H], dtype=tl.float32)
        if ROUTER_GRAD_TRANSPOSED:
            grad_router = tl.zeros([E_DOT, D_H], dtype=tl.float32)
        else:
            grad_router = tl.zeros([D_H, E_DOT], dtype=tl.float32)
        router = tl.zeros([D_H, E_DOT], dtype=tl.float32)
        if HAS_ROUTER:
            router = _router_tile(ROUTER, head, num_subnetworks, D_H, E_DOT)
        router_t = tl.trans(router)
        for i in range(0, blocks_per_program):
            tokens = (part * blocks_per_program + i) * BLOCK_T + tl.arange(0, BLOCK_T)
            token_mask = tokens < num_tokens
            p, _ = _token_tile(P, tokens, token_mask, head, stride_p, D_H)
            grad_q, _ = _token_tile(DQ, tokens, token_mask, head, stride_dq, D_H)
            q, p_hat, inv_rms = _normalized(p, NORM_W, eps, D_H, HAS_NORM)
            if HAS_ROUTER:
                scores = _gate_scores(q, router, num_subnetworks, E_DOT, ROUTER_PRECISION)
                total = tl.sum(scores, axis=1) + gate_eps
                gates = scores / total[:, None]
                batch = (tokens // seq_len).to(tl.int64)
                gate_rows = (batch * num_heads + head) * seq_len + tokens % seq_len
                r_mask = token_mask[:, None] & (subnetworks[None, :] < num_subnetworks)
                grad_gates = tl.load(DR + gate_rows[:, None] * num_subnetworks + subnetworks[None, :], mask=r_mask,
                                     other=0.0).to(tl.float32)
                # r = s / (sum s + eps): ds_j = (dr_j - sum_e dr_e r_e) / (sum s + eps); then through the sigmoid
                grad_scores = (grad_gates - tl.sum(grad_gates * gates, axis=1)[:, None]) / total[:, None]
                grad_logits = grad_scores * scores * (1.0 - scores)
                grad_q += tl.dot(grad_logits, router_t, input_precision=ROUTER_PRECISION)
                if ROUTER_GRAD_TRANSPOSED:
                    grad_router += tl.dot(tl.trans(grad_logits), q, input_precision=ROUTER_PRECISION)
                else:
                    grad_router += tl.dot(tl.trans(q), grad_logits, input_precision=ROUTER_PRECISION)
            if HAS_NORM:
                weight = tl.load(NORM_W + dims).to(tl.float32)
                grad_norm += tl.sum(grad_q * p_hat, axis=0)
                grad_p_hat = grad_q * weight[None, :]
                grad_p = inv_rms[:, None] * (grad_p_hat - p_hat * (tl.sum(grad_p_hat * p_hat, axis=1) / D_H)[:, None])
            else:
                grad_p = grad_q
            dp_offsets = tokens.to(tl.int64)[:, None] * stride_dp + head * D_H + dims[None, :]
            tl.store(DP + dp_offsets, grad_p.to(DP.dtype.element_ty), mask=token_mask[:, None])
        slot = part * num_heads + head
        if HAS_NORM:
            tl.store(DNORM_PARTS + slot * D_H + dims, grad_norm)
        if HAS_ROUTER:
            if ROUTER_GRAD_TRANSPOSED:
                tl.store(DROUTER_PARTS + (slot * E_DOT + subnetworks)[:, None] * D_H + dims[None, :], grad_router)
            else:
                tl.store(DROUTER_PARTS + (slot * D_H + dims)[:, None] * E_DOT + subnetworks[None, :], grad_router)

    @triton.jit
    def _gate_gradient_sums_kernel(
        NORM_PARTS, ROUTER_PARTS, DNORM, DROUTER, slots, num_heads, num_subnetworks,
        D_H: tl.constexpr, E_DOT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
        NORM_BLOCK_S: tl.constexpr, NORM_BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROUTER: tl.constexpr,
    ):
        """The norm/gate backward's partial sums added up, in a fixed order. Program (block, h) for h < H: columns
        block * BLOCK_C .. of head h's router partial sums ROUTER_PARTS [slots, H, E_DOT * d_h] (column e * d_h + d),
        summed over the slots BLOCK_S at a time, into DROUTER[h, d, e] (e < E). Program (block, H): the norm
        weight's gradient DNORM at dims block * NORM_BLOCK_D .. from NORM_PARTS [slots * H, d_h], NORM_BLOCK_S rows
        at a time."""
        block = tl.program_id(0)
        head = tl.program_id(1)
        if head < num_heads:
            if HAS_ROUTER:
                columns = block * BLOCK_C + tl.arange(0, BLOCK_C)
                slot_rows = tl.arange(0, BLOCK_S)
                router_sum = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
                for first in range(0, slots, BLOCK_S):
                    rows = first + slot_rows
                    router_sum += tl.load(
                        ROUTER_PARTS + ((rows.to(tl.int64) * num_heads + head) * (E_DOT * D_H))[:, None]
                        + columns[None, :], mask=(rows < slots)[:, None], other=0.0)
                subnetwork = columns // D_H
                tl.store(DROUTER + (head * D_H + columns % D_H) * num_subnetworks + subnetwork,
                         tl.sum(router_sum, axis=0).to(DROUTER.dtype.element_ty), mask=subnetwork < num_subnetworks)
        else:
            if HAS_NORM:
                if block < D_H // NORM_BLOCK_D:
                    dims = block * NORM_BLOCK_D + tl.arange(0, NORM_BLOCK_D)
                    norm_rows = tl.arange(0, NORM_BLOCK_S)
                    norm_sum = tl.zeros([NORM_BLOCK_S, NORM_BLOCK_D], dtype=tl.float32)
                    for first in range(0, slots * num_heads, NORM_BLOCK_S):
                        rows = first + norm_rows
                        norm_sum += tl.load(NORM_PARTS + rows.to(tl.int64)[:, None] * D_H + dims[None, :],
                                            mask=(rows < slots * num_heads)[:, None], other=0.0)
                    tl.store(DNORM + dims, tl.sum(norm_sum, axis=0).to(DNORM.dtype.element_ty))

    @triton.jit
    def _decode_weight_tiles(K, U, V, weight_base, block, D_H: tl.constexpr, BLOCK_N: tl.constexpr):
        """Column block ``block``'s K, U and V tiles [BLOCK_N, d_h] of one weight group."""
        offsets = (weight_base + (block * BLOCK_N + tl.arange(0, BLOCK_N))[:, None] * D_H
                   + tl.arange(0, D_H)[None, :])
        return tl.load(K + offsets), tl.load(U + offsets), tl.load(V + offsets)

    @triton.jit
    def _decode_block(q, gates, k, u, v, block, acc, D_E: tl.constexpr, E_DOT: tl.constexpr, BLOCK_N: tl.constexpr,
                      FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr):
        """acc + the column block's share of the heads' output: (r_e SiLU(q k^T) * (q u^T)) v, e the block's
        sub-network."""
        gate_pre = _dot(q, tl.trans(k), PRECISION)
        up = _dot(q, tl.trans(u), PRECISION)
        subnetwork = block * BLOCK_N // D_E
        gate = tl.sum(tl.where(tl.arange(0, E_DOT)[None, :] == subnetwork, gates, 0.0), axis=1)
        hidden = gate_pre * _sigmoid(gate_pre, FAST_SIGMOID) * up * gate[:, None]
        return _dot_acc(hidden.to(v.dtype), v, acc, PRECISION)

    @triton.jit(do_not_specialize=["num_tokens", "blocks_per_split"])
    def _decode_kernel(
        P, NORM_W, ROUTER, K, U, V, OUT,
        num_tokens, group_size, num_subnetworks, stride_p, eps, gate_eps, blocks_per_split,
        D_H: tl.constexpr, D_E: tl.constexpr, E_DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_NORM: tl.constexpr, HAS_ROUTER: tl.constexpr, ROUTER_PRECISION: tl.constexpr,
        FAST_SIGMOID: tl.constexpr, PRECISION: tl.constexpr, WEIGHTS_FIRST: tl.constexpr,
    ):
        """OUT [splits, tokens, H * d_h]: program (head, split, token block) writes its columns' share of the heads'
        output, in float32 where ``_split_sum_kernel`` adds the splits up (or, with one split, the output itself).

        A decoding step's time is the weights' reading, so with WEIGHTS_FIRST a program asks for its first column
        block before it loads the queries: the norm and the gates are computed while those tiles arrive."""
        head = tl.program_id(0)
        split = tl.program_id(1)
        tokens = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        token_mask = tokens < num_tokens
        num_heads = tl.num_programs(0)
        weight_base = (head // group_size).to(tl.int64) * num_subnetworks * D_E * D_H
        first = split * blocks_per_split
        last = tl.minimum(first + blocks_per_split, num_subnetworks * (D_E // BLOCK_N))
        if WEIGHTS_FIRST:
            k, u, v = _decode_weight_tiles(K, U, V, weight_base, first, D_H, BLOCK_N)
        p, _ = _token_tile(P, tokens, token_mask, head, stride_p, D_H)
        q, _, _ = _normalized(p, NORM_W, eps, D_H, HAS_NORM)
        gates, _ = _gates(q, ROUTER, head, num_subnetworks, gate_eps, D_H, E_DOT, HAS_ROUTER, ROUTER_PRECISION)
        q = q.to(K.dtype.element_ty)  # the op multiplies the queries in the input dtype
        if not WEIGHTS_FIRST:
            k, u, v = _decode_weight_tiles(K, U, V, weight_base, first, D_H, BLOCK_N)
        acc = _decode_block(q, gates, k, u, v, first, tl.zeros([BLOCK_T, D_H], dtype=tl.float32), D_E, E_DOT, BLOCK_N,
                            FAST_SIGMOID, PRECISION)
        for block in range(first + 1, last):
            k, u, v = _decode_weight_tiles(K, U, V, weight_base, block, D_H, BLOCK_N)
            acc = _decode_block(q, gates, k, u, v, block, acc, D_E, E_DOT, BLOCK_N, FAST_SIGMOID, PRECISION)
        width = num_heads * D_H
        out_offsets = (split.to(tl.int64) * num_tokens * width + tokens.to(tl.int64)[:, None] * width + head * D_H
                       + tl.arange(0, D_H)[None, :])
        tl.store(OUT + out_offsets, acc.to(OUT.dtype.element_ty), mask=token_mask[:, None])

    @triton.jit(do_not_specialize=["num_splits"])
    def _split_sum_kernel(PARTS, OUT, num_splits, num_elements, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr):
        """OUT[i] = sum over s of PARTS[s, i] (float32, then OUT's dtype), for BLOCK elements per program: the splits
        in a fixed order, so the decode kernel's output is the same from run to run."""
        elements = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        element_mask = elements < num_elements
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for first in range(0, num_splits, BLOCK_S):
            splits = first + tl.arange(0, BLOCK_S)
            offsets = splits.to(tl.int64)[:, None] * num_elements + elements[None, :]
            parts = tl.load(PARTS + offsets, mask=(splits < num_splits)[:, None] & element_mask[None, :], other=0.0)
            total += tl.sum(parts, axis=0)
        tl.store(OUT + elements, total.to(OUT.dtype.element_ty), mask=element_mask)


# ----------------------------------------------------------------------------------------------------------
# Launchers. ``p``: the input projection's output [B, L, H * d_h]; the gates r are [B, H, L, E] as the op reads them.
# ----------------------------------------------------------------------------------------------------------
# How the norm/gate kernels are launched: tokens per program, warps, and for the backward programs per
# multiprocessor, software-pipelining stages and which product gives the router's gradient.
# The router products run on the tensor cores in tf32 (float32 accumulation) for 16-bit layers, whose op multiplies
# the queries rounded to 16 bits anyway (tf32 keeps 10 mantissa bits, bfloat16 7), and as float32 FMAs ("ieee") for
# float32 layers. `kernels/tune_flash_mhf_layer.py` times the alternatives on a GPU
# (`kernels/results/models/h100_gate_kernels_tune_v2.md`, H100, 370M / 1.3B shapes, against 28 us for a copy of the
# input): the forward 36.5 / 38.3 us in tf32 (ieee 53, tf32x3 65); the backward 104 / 107 us as launched here, 142 /
# 138 us as launched before (PREVIOUS_GATES_BACKWARD_LAUNCH). Its router gradient is the transposed product
# grad_logits^T q, which transposes the [tokens, E] gate tile instead of the [tokens, d_h] queries.
GATES_LAUNCH = {"block_t": 32, "num_warps": 4}
GATES_BACKWARD_LAUNCH = {"block_t": 16, "num_warps": 2, "programs_per_sm": 4, "num_stages": 3,
                         "router_grad_transposed": True}
PREVIOUS_GATES_BACKWARD_LAUNCH = {"block_t": 32, "num_warps": 4, "programs_per_sm": 4,
                                  "router_grad_transposed": False}
ROUTER_PRECISIONS = ("tf32", "ieee", "tf32x3")
# The partial sums' finishing kernel: router columns (E_DOT * d_h per head) per program and slots per step; the norm
# weight's dims per program and rows of its partial sums per step. Each program's loop is short (8 steps at the
# presets' shapes): a step waits for its loads, so 128 one-slot steps took 33 us where 8 wide ones take 21.
GATE_SUMS_BLOCK_C, GATE_SUMS_BLOCK_S = 256, 16
GATE_SUMS_NORM_BLOCK_D, GATE_SUMS_NORM_BLOCK_S = 32, 256


def router_precision(dtype: torch.dtype) -> str:
    """The router products' precision for a layer whose input has ``dtype``."""
    return "ieee" if dtype == torch.float32 else "tf32"


DECODE_BLOCK_T = 16  # tokens per program of the decode kernel (the smallest tile a product takes)
DECODE_MAX_TOKENS = 64  # the decode kernel runs the layer for up to this many tokens
# How the decode kernel is launched: weight columns per step (for 16-bit weights; see `decode_block_n`), warps,
# software-pipelining stages of its column loop, programs per multiprocessor (each takes a share of a head's column
# blocks), and whether a program asks for its first weight tiles before computing the norm and gates.
# `python kernels/tune_flash_mhf_layer.py --decode` times the alternatives.
DECODE_LAUNCH = {"block_n": 64, "num_warps": 4, "num_stages": 2, "programs_per_sm": 2, "weights_first": True}
# The splits' sum: output elements per program, and splits per step (all of a decoding step's splits in one load;
# one value for every number of splits, so that the kernel is compiled once)
DECODE_SUM_BLOCK, DECODE_SUM_BLOCK_S = 128, 64


def e_dot(num_subnetworks: int) -> int:
    """Width of the gate tiles: a power of two the products accept (>= 16)."""
    return max(16, next_power_of_2(num_subnetworks))


def _flags(norm_weight, router, dtype: torch.dtype, precision: str | None = None) -> dict:
    precision = precision or router_precision(dtype)
    if precision not in ROUTER_PRECISIONS:
        raise ValueError(f"router precision={precision!r} is not one of {ROUTER_PRECISIONS}")
    return dict(HAS_NORM=norm_weight is not None, HAS_ROUTER=router is not None, ROUTER_PRECISION=precision)


def _pointer_or(tensor, fallback):
    """A tensor argument the kernel never reads when its flag is off still needs a pointer."""
    return tensor if tensor is not None else fallback


def queries_and_gates(p, norm_weight, router, head_dim: int, num_subnetworks: int, eps: float, gate_eps: float,
                      launch: dict | None = None, precision: str | None = None, totals: bool = False):
    """(q like p, r float32 [B, H, L, E]) for ``p`` [B, L, H * d_h] (contiguous); with ``totals``, a third tensor:
    the gates' totals ``sum_E sigmoid(q W_router) + gate_eps`` (float32 [B, H, L]; None without a router), from which
    the fused backward gets the sigmoid scores back (``r * total``). ``launch`` and ``precision`` (benchmarks)
    override ``GATES_LAUNCH`` and ``router_precision``."""
    launch = launch or GATES_LAUNCH
    batch, length, width = p.shape
    num_heads = width // head_dim
    rows = p.reshape(batch * length, width)
    q = torch.empty_like(p)
    r = torch.empty(batch, num_heads, length, num_subnetworks, device=p.device, dtype=torch.float32)
    gate_totals = r.new_empty(batch, num_heads, length) if totals and router is not None else None
    num_tokens = batch * length
    if num_tokens:
        launch_kernel(  # training (totals) launches the kernel as it is, inference its build for any size
            _queries_and_gates_kernel if totals else _queries_and_gates_any_size,
            (cdiv(num_tokens, launch["block_t"]), num_heads),
            rows, _pointer_or(norm_weight, rows), _pointer_or(router, rows), q, r, _pointer_or(gate_totals, r),
            num_tokens, length, num_heads, num_subnetworks, rows.stride(0), width, eps, gate_eps,
            D_H=head_dim, E_DOT=e_dot(num_subnetworks), BLOCK_T=launch["block_t"], num_warps=launch["num_warps"],
            WITH_TOTALS=gate_totals is not None, **_flags(norm_weight, router, p.dtype, precision),
        )
    return (q, r, gate_totals) if totals else (q, r)


@functools.lru_cache(maxsize=256)  # (keyed by the number of tokens, which changes from batch to batch)
def _backward_programs(num_tokens: int, num_heads: int, num_sms: int, block_t: int, programs_per_sm: int
                       ) -> tuple[int, int]:
    """(programs per head, token blocks per program): about ``programs_per_sm`` programs per multiprocessor."""
    blocks = cdiv(num_tokens, block_t)
    per_program = max(1, cdiv(blocks * num_heads, programs_per_sm * num_sms))
    return cdiv(blocks, per_program), per_program


@contextlib.contextmanager
def gates_backward_launch(launch: dict):
    """Within the block, the norm/gate backward launches with ``launch`` (benchmarks)."""
    global GATES_BACKWARD_LAUNCH
    before, GATES_BACKWARD_LAUNCH = GATES_BACKWARD_LAUNCH, launch
    try:
        yield
    finally:
        GATES_BACKWARD_LAUNCH = before


def queries_and_gates_backward(p, norm_weight, router, grad_q, grad_r, head_dim: int, eps: float, gate_eps: float,
                               launch: dict | None = None, precision: str | None = None):
    """(dP like p, d norm weight or None, d router or None) for ``p`` [B, L, H * d_h] (contiguous), from the op's dq
    (P's layout) and dr ([B, H, L, E]). ``launch`` and ``precision`` (benchmarks) override ``GATES_BACKWARD_LAUNCH``
    and ``router_precision``."""
    launch = launch or GATES_BACKWARD_LAUNCH
    batch, length, width = p.shape
    num_heads = width // head_dim
    num_subnetworks = grad_r.shape[-1]
    num_tokens = batch * length
    rows = p.reshape(num_tokens, width)
    grad_rows = grad_q.reshape(num_tokens, width)  # a view of the op's dq (in p's layout)
    grad_p = torch.empty_like(p)
    gate_width = e_dot(num_subnetworks)
    programs, per_program = _backward_programs(num_tokens, num_heads, _num_sms(p.device), launch["block_t"],
                                               launch["programs_per_sm"])
    flags = _flags(norm_weight, router, p.dtype, precision)
    transposed = bool(launch.get("router_grad_transposed", False))
    norm_parts = torch.empty(programs, num_heads, head_dim, device=p.device, dtype=torch.float32) \
        if flags["HAS_NORM"] else None
    parts_shape = ((programs, num_heads, gate_width, head_dim) if transposed
                   else (programs, num_heads, head_dim, gate_width))
    router_parts = torch.empty(parts_shape, device=p.device, dtype=torch.float32) if flags["HAS_ROUTER"] else None
    if num_tokens:
        stages = {"num_stages": launch["num_stages"]} if "num_stages" in launch else {}
        launch_kernel(
            _queries_and_gates_backward_kernel, (programs, num_heads),
            rows, _pointer_or(norm_weight, rows), _pointer_or(router, rows), grad_rows, grad_r.contiguous(), grad_p,
            _pointer_or(norm_parts, rows), _pointer_or(router_parts, rows),
            num_tokens, length, num_heads, num_subnetworks, rows.stride(0), grad_rows.stride(0), width, eps, gate_eps,
            per_program, D_H=head_dim, E_DOT=gate_width, BLOCK_T=launch["block_t"], ROUTER_GRAD_TRANSPOSED=transposed,
            num_warps=launch["num_warps"], **stages, **flags,
        )
    if transposed or not num_tokens:
        return (grad_p, *finish_gate_gradients(norm_parts, router_parts, norm_weight, router, num_tokens))
    grad_norm = norm_parts.sum((0, 1)).to(norm_weight.dtype) if norm_parts is not None else None
    # (the sum of the slice is a new contiguous [H, d_h, E] tensor; a slice of the sum would keep the padded strides
    # wherever no cast copies it)
    grad_router = router_parts[..., :num_subnetworks].sum(0).to(router.dtype) if router_parts is not None else None
    return grad_p, grad_norm, grad_router


def finish_gate_gradients(norm_parts, router_parts, norm_weight, router, num_tokens: int):
    """(d norm weight or None, d router or None) from the norm/gate backward's partial sums: ``norm_parts`` [slots, H,
    d_h] and ``router_parts`` [slots, H, E_DOT, d_h] (float32, None where the layer has no norm / router), added up
    in a fixed order, in the parameters' dtypes and layouts (the router's gradient a new contiguous [H, d_h, E])."""
    if not num_tokens:
        return (None if norm_parts is None else torch.zeros_like(norm_weight),
                None if router_parts is None else torch.zeros_like(router))
    grad_norm = None if norm_parts is None else torch.empty_like(norm_weight, memory_format=torch.contiguous_format)
    grad_router = None if router_parts is None else torch.empty_like(router, memory_format=torch.contiguous_format)
    if grad_norm is None and grad_router is None:
        return None, None
    slots, num_heads, head_dim = (norm_parts if norm_parts is not None else router_parts[:, :, 0]).shape
    gate_width = 16 if router_parts is None else router_parts.shape[2]
    any_part = norm_parts if norm_parts is not None else router_parts
    blocks = max(cdiv(gate_width * head_dim, GATE_SUMS_BLOCK_C), head_dim // GATE_SUMS_NORM_BLOCK_D)
    launch_kernel(
        _gate_gradient_sums_kernel, (blocks, num_heads + 1),
        _pointer_or(norm_parts, any_part), _pointer_or(router_parts, any_part), _pointer_or(grad_norm, any_part),
        _pointer_or(grad_router, any_part), slots, num_heads, 1 if router is None else router.shape[-1],
        D_H=head_dim, E_DOT=gate_width, BLOCK_C=GATE_SUMS_BLOCK_C, BLOCK_S=GATE_SUMS_BLOCK_S,
        NORM_BLOCK_S=GATE_SUMS_NORM_BLOCK_S, NORM_BLOCK_D=GATE_SUMS_NORM_BLOCK_D, HAS_NORM=grad_norm is not None,
        HAS_ROUTER=grad_router is not None, num_warps=8,
    )
    return grad_norm, grad_router


def gate_gradient_sums_reference(norm_parts, router_parts, norm_weight, router):
    """`finish_gate_gradients` as PyTorch reductions (benchmarks time the kernel against it)."""
    grad_norm = None if norm_parts is None else norm_parts.sum((0, 1)).to(norm_weight.dtype)
    grad_router = None
    if router_parts is not None:
        grad_router = torch.empty(router.shape, device=router.device, dtype=router.dtype)
        grad_router.copy_(router_parts[:, :, :router.shape[-1]].sum(0).transpose(1, 2))
    return grad_norm, grad_router


@functools.lru_cache(maxsize=None)
def _decode_splits(num_heads: int, token_blocks: int, num_blocks: int, num_sms: int, programs_per_sm: int) -> int:
    """Column blocks per program so that about ``programs_per_sm`` programs run per multiprocessor."""
    splits = max(1, min(num_blocks, cdiv(programs_per_sm * num_sms, num_heads * token_blocks)))
    return cdiv(num_blocks, splits)


def decode_block_n(subnetwork_size: int, head_dim: int, element_size: int, block_n: int | None = None) -> int:
    """Weight columns per step of the decode kernel: a power of two dividing d_e, at most ``block_n`` (by default
    ``DECODE_LAUNCH``'s). Float32 products stage their operands through shared memory, so float32 weights take
    narrower blocks that keep the K, U, V tiles within it (d_h 128: 32 columns, ~60 KB; 64 columns would need
    ~110 KB, and ~410 KB at d_h 256)."""
    block_n = block_n or DECODE_LAUNCH["block_n"]
    if element_size > 2:
        block_n = min(block_n, 4096 // head_dim)
    while subnetwork_size % block_n:
        block_n //= 2
    return block_n


def decode_forward(p, norm_weight, router, k, u, v, eps: float, gate_eps: float, launch: dict | None = None
                   ) -> torch.Tensor:
    """The layer's heads output [B, L, H * d_h] (p's dtype) for at most ``DECODE_MAX_TOKENS`` tokens: one kernel, and
    a second that adds up the float32 shares of the programs that split a head's columns (in a fixed order: the
    output does not change from run to run). ``launch`` (benchmarks) overrides ``DECODE_LAUNCH``."""
    launch = launch or DECODE_LAUNCH
    batch, length, width = p.shape
    kv_heads, num_subnetworks, subnetwork_size, head_dim = k.shape
    num_heads = width // head_dim
    num_tokens = batch * length
    rows = p.reshape(num_tokens, width)
    out = torch.empty(num_tokens, width, device=p.device, dtype=p.dtype)
    if not num_tokens:
        return out.view(batch, length, width)
    block_n = decode_block_n(subnetwork_size, head_dim, k.element_size(), launch["block_n"])
    num_blocks = num_subnetworks * subnetwork_size // block_n
    token_blocks = cdiv(num_tokens, DECODE_BLOCK_T)
    per_split = _decode_splits(num_heads, token_blocks, num_blocks, _num_sms(p.device), launch["programs_per_sm"])
    splits = cdiv(num_blocks, per_split)
    parts = torch.empty(splits, num_tokens, width, device=p.device, dtype=torch.float32) if splits > 1 else out
    launch_kernel(
        _decode_kernel, (num_heads, splits, token_blocks),
        rows, _pointer_or(norm_weight, rows), _pointer_or(router, rows), k, u, v, parts,
        num_tokens, num_heads // kv_heads, num_subnetworks, rows.stride(0), eps, gate_eps, per_split,
        D_H=head_dim, D_E=subnetwork_size, E_DOT=e_dot(num_subnetworks), BLOCK_T=DECODE_BLOCK_T, BLOCK_N=block_n,
        WEIGHTS_FIRST=launch["weights_first"], num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        **_flags(norm_weight, router, p.dtype), **_kernel_flags(k.dtype),
    )
    if splits > 1:
        launch_kernel(
            _split_sum_kernel, (cdiv(out.numel(), DECODE_SUM_BLOCK),), parts, out, splits, out.numel(),
            BLOCK_S=DECODE_SUM_BLOCK_S, BLOCK=DECODE_SUM_BLOCK, num_warps=4,
        )
    return out.view(batch, length, width)


__all__ = ["queries_and_gates", "queries_and_gates_backward", "finish_gate_gradients", "decode_forward", "e_dot",
           "DECODE_MAX_TOKENS"]
