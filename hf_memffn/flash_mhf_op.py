"""The FlashMHF operator: multi-head FFN over parallel sub-networks, without materialising the activations.

For every head ``h`` (using weight group ``h // (H // H_kv)``) and token ``l``::

    o[b, h, l] = sum_e r[b, h, l, e] * (SiLU(q K_e^T) * (q U_e^T)) V_e

with ``q [B, H, L, d_h]``, ``K, U, V [H_kv, E, d_e, d_h]`` and gate weights ``r [B, H, L, E]``.

Two implementations compute the same function, behind one entry point :func:`flash_mhf`:

* ``"triton"``: fused forward and backward kernels (``flash_mhf_triton.py``); the ``[tokens, E * d_e]``
  activations live only in on-chip memory and are recomputed in the backward pass.
* ``"torch"``: a memory-bounded PyTorch reference. It walks over the sub-networks in column chunks, so it
  never holds more than one chunk of activations, and its backward recomputes each chunk instead of keeping
  anything alive from the forward pass.

``"auto"`` picks Triton for CUDA tensors and the reference for CPU tensors; a CUDA tensor never falls back
silently. Both run through the custom operators ``memffn_v2::flash_mhf`` / ``memffn_v2::flash_mhf_backward``,
so ``torch.compile`` traces them without a graph break and ``torch.library.opcheck`` applies.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .triton_launch import autocast_off, registered_operator

try:
    from .flash_mhf_triton import (
        TRITON_AVAILABLE,
        TRITON_IMPORT_ERROR,
        TRITON_VERSION,
        triton_backward,
        triton_forward,
        triton_interpreting,
        forward_kernel,
        row_gradient_kernel,
        weight_gradient_kernel,
    )
except ImportError as exc:  # pragma: no cover - only when the sibling file itself is missing
    TRITON_AVAILABLE, TRITON_IMPORT_ERROR, TRITON_VERSION = False, repr(exc), None
    triton_forward = triton_backward = forward_kernel = row_gradient_kernel = weight_gradient_kernel = None

    def triton_interpreting() -> bool:
        return False

try:
    from .flash_mhf_layer_triton import (
        DECODE_MAX_TOKENS,
        decode_forward,
        e_dot,
        finish_gate_gradients,
        queries_and_gates,
        queries_and_gates_backward,
    )
except ImportError:  # pragma: no cover - only when the sibling file itself is missing
    DECODE_MAX_TOKENS, decode_forward, queries_and_gates, queries_and_gates_backward = 0, None, None, None
try:
    from .flash_mhf_gluon import FusedGates, gate_partial_slots
except ImportError:  # pragma: no cover - only when the sibling file itself is missing
    FusedGates = gate_partial_slots = None


__all__ = [
    "flash_mhf",
    "flash_mhf_layer",
    "flash_mhf_layer_path",
    "flash_mhf_reference",
    "flash_mhf_dense",
    "flash_mhf_path",
    "SUPPORTED_HEAD_DIMS",
    "IMPLEMENTATIONS",
]

# Version of the operator namespace: bump it whenever the operators' schema or semantics change, so two copies
# of this file loaded from different checkpoints never register conflicting definitions under one name (v2: the fused
# layer takes key, up and value as one stacked tensor and returns its gradient as one).
OP_NAMESPACE = "memffn_v2"
SUPPORTED_HEAD_DIMS = (64, 128, 256)
IMPLEMENTATIONS = ("auto", "triton", "torch")
# The reference path processes this many sub-network columns at a time (at most; chunks never straddle two
# sub-networks), which bounds its activation memory to [B, H, L, REFERENCE_CHUNK_COLUMNS] per temporary.
REFERENCE_CHUNK_COLUMNS = 256


# ----------------------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------------------
def _check_inputs(q: torch.Tensor, k: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [batch, heads, seq_len, head_dim]; got shape {tuple(q.shape)}")
    for name, weight in (("k", k), ("u", u), ("v", v)):
        if weight.dim() != 4:
            raise ValueError(
                f"{name} must be [kv_heads, num_subnetworks, subnetwork_size, head_dim]; got {tuple(weight.shape)}"
            )
    if not (k.shape == u.shape == v.shape):
        raise ValueError(f"k, u, v must have one shape; got {tuple(k.shape)}, {tuple(u.shape)}, {tuple(v.shape)}")
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, num_subnetworks, _subnetwork_size, weight_head_dim = k.shape
    if weight_head_dim != head_dim:
        raise ValueError(f"k/u/v head_dim={weight_head_dim} must equal q's head_dim={head_dim}")
    if kv_heads < 1 or num_heads % kv_heads != 0:
        raise ValueError(f"kv_heads={kv_heads} must divide num_heads={num_heads}")
    if tuple(r.shape) != (batch, num_heads, seq_len, num_subnetworks):
        raise ValueError(
            f"r must be [batch, heads, seq_len, num_subnetworks] = {(batch, num_heads, seq_len, num_subnetworks)}; "
            f"got {tuple(r.shape)}"
        )
    for name, tensor in (("q", q), ("k", k), ("u", u), ("v", v), ("r", r)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor; got dtype {tensor.dtype}")
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device} but q is on {q.device}; all inputs must share a device")


def _resolve_impl(q: torch.Tensor, impl: str) -> str:
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not supported; allowed values: {IMPLEMENTATIONS}")
    if impl == "auto":
        return "triton" if q.device.type == "cuda" else "torch"
    return impl


def _triton_unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the Triton kernels cannot run these inputs, or None when they can."""
    if not TRITON_AVAILABLE:
        return f"triton is not importable ({TRITON_IMPORT_ERROR})"
    if q.device.type != "cuda" and not triton_interpreting():
        return f"tensors are on {q.device.type}; the Triton kernels need CUDA (or TRITON_INTERPRET=1)"
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return f"head_dim={q.shape[-1]} is not supported by the kernels; allowed values: {SUPPORTED_HEAD_DIMS}"
    if k.shape[2] % 16 != 0:
        return f"subnetwork_size={k.shape[2]} must be a multiple of 16 for the kernels"
    if 0 in k.shape[1:3]:  # (the column loops and tensor descriptors would have no block to read)
        return (f"num_subnetworks={k.shape[1]}, subnetwork_size={k.shape[2]}: the kernels need at least one "
                "sub-network of at least 16 units")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {q.dtype} is not supported by the kernels; allowed: float16, bfloat16, float32"
    return None


def flash_mhf_path(q: torch.Tensor, k: torch.Tensor | None = None, *, impl: str = "auto") -> str:
    """Which implementation ``flash_mhf(q, k, ...)`` would run, and why, as one human-readable line."""
    chosen = _resolve_impl(q, impl)
    if chosen == "torch":
        why = "requested" if impl == "torch" else f"{q.device.type} tensors"
        return f"torch reference (memory-bounded, chunked recompute; {why})"
    reason = _triton_unsupported_reason(q, k if k is not None else q.new_empty(1, 1, 16, q.shape[-1]))
    if reason is not None:
        asked = "triton requested" if impl == "triton" else f"auto chose triton for {q.device.type} tensors"
        return f"unavailable: {asked} but {reason}"
    mode = "interpreter" if triton_interpreting() else "CUDA"
    why = "requested" if impl == "triton" else f"{q.device.type} tensors"
    gluon = []
    if k is not None and forward_kernel(q, k) == "gluon":
        gluon.append("the output")
    if k is not None and row_gradient_kernel(q, k) == "gluon":
        gluon.append("dq/dr")
    if k is not None and weight_gradient_kernel(q, k) == "gluon":
        gluon.append("dK/dU/dV")
    listed = " and ".join([", ".join(gluon[:-1]), gluon[-1]] if len(gluon) > 1 else gluon)
    by_gluon = f"; {listed} by the Gluon Hopper kernels" if gluon else ""
    # (small problems split the Triton kernels' loops across programs that add float32 partial sums atomically, in an
    # order that changes from run to run: not under torch.use_deterministic_algorithms)
    deterministic = "; deterministic: no atomic split loops" if torch.are_deterministic_algorithms_enabled() else ""
    return f"triton fused kernels ({mode}, triton {TRITON_VERSION}; {why}{by_gluon}{deterministic})"


# ----------------------------------------------------------------------------------------------------------
# Memory-bounded PyTorch reference (forward and recomputing backward)
# ----------------------------------------------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _column_chunks(num_subnetworks: int, subnetwork_size: int):
    """(subnetwork, first column, last column) over the flattened E * d_e columns; chunks stay in one subnetwork."""
    for e in range(num_subnetworks):
        for start in range(0, subnetwork_size, REFERENCE_CHUNK_COLUMNS):
            stop = min(start + REFERENCE_CHUNK_COLUMNS, subnetwork_size)
            yield e, e * subnetwork_size + start, e * subnetwork_size + stop


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, L, X] -> [B, H_kv, (H / H_kv) * L, X]: the heads of one weight group become one row block."""
    batch, num_heads, seq_len, last = q.shape
    return q.reshape(batch, kv_heads, (num_heads // kv_heads) * seq_len, last)


def _reference_forward(q, k, u, v, r) -> torch.Tensor:
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, num_subnetworks, subnetwork_size, _ = k.shape
    dtype = _compute_dtype(q.dtype)
    rows = _grouped(q.contiguous(), kv_heads).to(dtype)
    gates = _grouped(r.contiguous(), kv_heads).to(dtype)
    keys, ups, values = (w.reshape(kv_heads, num_subnetworks * subnetwork_size, head_dim) for w in (k, u, v))
    out = torch.zeros(rows.shape, dtype=dtype, device=q.device)
    for e, start, stop in _column_chunks(num_subnetworks, subnetwork_size):
        gate_pre = rows @ keys[:, start:stop].to(dtype).transpose(-1, -2)  # [B, H_kv, G*L, chunk]
        up = rows @ ups[:, start:stop].to(dtype).transpose(-1, -2)
        hidden = torch.nn.functional.silu(gate_pre).mul_(up).mul_(gates[..., e : e + 1])
        del gate_pre, up
        out += hidden @ values[:, start:stop].to(dtype)
    return out.reshape(batch, num_heads, seq_len, head_dim).to(q.dtype)


def _reference_backward(grad_out, q, k, u, v, r):
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads, num_subnetworks, subnetwork_size, _ = k.shape
    dtype = _compute_dtype(q.dtype)
    rows = _grouped(q.contiguous(), kv_heads).to(dtype)
    gates = _grouped(r.contiguous(), kv_heads).to(dtype)
    grad_rows = _grouped(grad_out.contiguous(), kv_heads).to(dtype)
    keys, ups, values = (w.reshape(kv_heads, num_subnetworks * subnetwork_size, head_dim) for w in (k, u, v))
    grad_q = torch.zeros(rows.shape, dtype=dtype, device=q.device)
    grad_r = torch.zeros(gates.shape, dtype=dtype, device=q.device)
    grad_k, grad_u, grad_v = (torch.empty(keys.shape, dtype=dtype, device=q.device) for _ in range(3))
    for e, start, stop in _column_chunks(num_subnetworks, subnetwork_size):
        key, up_w, value = (w[:, start:stop].to(dtype) for w in (keys, ups, values))
        gate_pre = rows @ key.transpose(-1, -2)
        up = rows @ up_w.transpose(-1, -2)
        sig = torch.sigmoid(gate_pre)
        silu = gate_pre * sig
        activated = silu * up  # before the gate weight
        grad_hidden = grad_rows @ value.transpose(-1, -2)
        grad_r[..., e] += (grad_hidden * activated).sum(-1)
        gate = gates[..., e : e + 1]
        grad_v[:, start:stop] = ((activated * gate).transpose(-1, -2) @ grad_rows).sum(0)
        grad_hidden.mul_(gate)
        grad_up = grad_hidden * silu
        # d SiLU(x)/dx = sig * (1 + x * (1 - sig)) = sig + silu * (1 - sig)
        grad_gate_pre = grad_hidden.mul_(up).mul_(sig + silu * (1 - sig))
        del gate_pre, up, sig, silu, activated
        grad_q += grad_gate_pre @ key + grad_up @ up_w
        grad_k[:, start:stop] = (grad_gate_pre.transpose(-1, -2) @ rows).sum(0)
        grad_u[:, start:stop] = (grad_up.transpose(-1, -2) @ rows).sum(0)
    shape_w = k.shape
    return (
        grad_q.reshape(q.shape).to(q.dtype),
        grad_k.reshape(shape_w).to(k.dtype),
        grad_u.reshape(shape_w).to(u.dtype),
        grad_v.reshape(shape_w).to(v.dtype),
        grad_r.reshape(r.shape).to(r.dtype),
    )


def flash_mhf_dense(q, k, u, v, r) -> torch.Tensor:
    """Plain autograd version that materialises all [B, H, L, E, d_e] activations.

    Only for checking (in float64 it is the ground truth of the tests) and as the naive baseline of the
    benchmark; use :func:`flash_mhf` everywhere else.
    """
    _check_inputs(q, k, u, v, r)
    batch, num_heads, seq_len, head_dim = q.shape
    kv_heads = k.shape[0]
    rows = _grouped(q, kv_heads)  # [B, Hkv, R, D]
    gate_pre = torch.einsum("bgrd,gefd->bgref", rows, k)
    up = torch.einsum("bgrd,gefd->bgref", rows, u)
    hidden = torch.nn.functional.silu(gate_pre) * up * _grouped(r, kv_heads).unsqueeze(-1)
    out = torch.einsum("bgref,gefd->bgrd", hidden, v)
    return out.reshape(batch, num_heads, seq_len, head_dim)


# ----------------------------------------------------------------------------------------------------------
# Custom operators (registered once per process, whichever copy of this file is imported first)
# ----------------------------------------------------------------------------------------------------------
def _registered(name: str):
    return registered_operator(OP_NAMESPACE, name)


def _in_layout_of(template: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result`` with the strides of ``torch.empty_like(template)``: what the fake implementations promise."""
    if template.is_contiguous() and result.stride() == template.stride():
        return result  # (empty_like keeps a dense template's strides: no allocation needed to know them)
    like = torch.empty_like(template, dtype=result.dtype)
    if like.stride() == result.stride():
        return result
    return like.copy_(result)


def _forward_impl(q, k, u, v, r, impl):
    if impl == "triton":
        out = triton_forward(q, k, u, v, r)
    else:
        # (float32 products also under autocast, which an operator's implementation would otherwise run under in
        # eager mode only: a compiled graph runs it with autocast off)
        with autocast_off(q.device.type):
            out = _reference_forward(q, k, u, v, r)
    return _in_layout_of(q, out)


def _backward_impl(grad_out, q, k, u, v, r, impl):
    if impl == "triton":
        grads = triton_backward(grad_out, q, k, u, v, r)
    else:
        with autocast_off(q.device.type):  # (as in the forward)
            grads = _reference_backward(grad_out, q, k, u, v, r)
    return tuple(_in_layout_of(t, g) for t, g in zip((q, k, u, v, r), grads))


def _register_ops():
    forward_name, backward_name = f"{OP_NAMESPACE}::flash_mhf", f"{OP_NAMESPACE}::flash_mhf_backward"

    @torch.library.custom_op(forward_name, mutates_args=())
    def forward_op(
        q: torch.Tensor, k: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor, impl: str
    ) -> torch.Tensor:
        return _forward_impl(q, k, u, v, r, impl)

    @forward_op.register_fake
    def _(q, k, u, v, r, impl):
        return torch.empty_like(q)

    @torch.library.custom_op(backward_name, mutates_args=())
    def backward_op(
        grad_out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        u: torch.Tensor,
        v: torch.Tensor,
        r: torch.Tensor,
        impl: str,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_impl(grad_out, q, k, u, v, r, impl)

    @backward_op.register_fake
    def _(grad_out, q, k, u, v, r, impl):
        return tuple(torch.empty_like(t) for t in (q, k, u, v, r))

    def setup_context(ctx, inputs, output):
        q, k, u, v, r, impl = inputs
        ctx.save_for_backward(q, k, u, v, r)
        ctx.impl = impl

    def backward(ctx, grad_out):
        q, k, u, v, r = ctx.saved_tensors
        grads = getattr(torch.ops, OP_NAMESPACE).flash_mhf_backward(grad_out, q, k, u, v, r, ctx.impl)
        return (*grads, None)

    forward_op.register_autograd(backward, setup_context=setup_context)


if _registered("flash_mhf") is None:
    _register_ops()
_forward_op = _registered("flash_mhf")
_backward_op = _registered("flash_mhf_backward")


# ----------------------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------------------
def flash_mhf(
    q: torch.Tensor, k: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor, *, impl: str = "auto"
) -> torch.Tensor:
    """FlashMHF: ``o[b,h,l] = sum_e r[b,h,l,e] * (SiLU(q K_e^T) * (q U_e^T)) V_e``, differentiable in all inputs.

    Args:
        q: ``[batch, heads, seq_len, head_dim]`` per-head queries.
        k, u, v: ``[kv_heads, num_subnetworks, subnetwork_size, head_dim]`` gate, up and down weights; head ``h``
            uses group ``h // (heads // kv_heads)``. They are cast to ``q.dtype`` (differentiably).
        r: ``[batch, heads, seq_len, num_subnetworks]`` sub-network weights (any float dtype; float32 advised).
        impl: ``"auto"`` (Triton on CUDA, the reference on CPU), ``"triton"`` (error if it cannot run) or
            ``"torch"`` (memory-bounded reference, any device).

    Returns:
        ``[batch, heads, seq_len, head_dim]`` in ``q.dtype``.
    """
    _check_inputs(q, k, u, v, r)
    chosen = _resolve_impl(q, impl)
    if chosen == "triton":
        reason = _triton_unsupported_reason(q, k)
        if reason is not None:
            raise ValueError(f"flash_mhf(impl={impl!r}) cannot use the Triton kernels: {reason}; impl='torch' (a "
                             "FlashMHF model's ffn_kernel='torch') runs the PyTorch reference on any device")
    k, u, v = (w.to(q.dtype) for w in (k, u, v))
    return _forward_op(q, k, u, v, r, chosen)


def flash_mhf_reference(
    q: torch.Tensor, k: torch.Tensor, u: torch.Tensor, v: torch.Tensor, r: torch.Tensor
) -> torch.Tensor:
    """The memory-bounded PyTorch implementation of :func:`flash_mhf` (same as ``impl="torch"``)."""
    return flash_mhf(q, k, u, v, r, impl="torch")


# ----------------------------------------------------------------------------------------------------------
# The FFN layer between its projections: query norm, gates and the op
# ----------------------------------------------------------------------------------------------------------
# The fused layer takes its [B, L, H * d_h] input straight from the input projection and returns the heads in the
# layout the output projection reads; the query norm and the gates are computed by the kernels of
# flash_mhf_layer_triton.py (forward and backward), the queries are re-derived in the backward pass instead of kept.
def router_gates(queries: torch.Tensor, router: torch.Tensor | None, gate_eps: float) -> torch.Tensor:
    """The normalised sub-network gates ``sigmoid(q W_h) / (sum_E sigmoid(q W_h) + gate_eps)`` in float32 (float64 for
    float64 queries), for queries ``[B, H, L, d_h]`` and ``router [H, d_h, E]`` (also under autocast); all ones
    ``[B, H, L, 1]`` without a router."""
    dtype = _compute_dtype(queries.dtype)
    if router is None:
        return queries.new_ones((*queries.shape[:-1], 1), dtype=dtype)
    with autocast_off(queries.device.type):
        scores = torch.sigmoid(torch.einsum("bhld,hde->bhle", queries.to(dtype), router.to(dtype)))
        return scores / (scores.sum(dim=-1, keepdim=True) + gate_eps)


def flash_mhf_layer_reference(p, norm_weight, router, k, u, v, head_dim: int, eps: float, gate_eps: float,
                              impl: str = "torch") -> torch.Tensor:
    """The layer composed of PyTorch operations around :func:`flash_mhf` (``impl`` runs the op): the unfused path,
    and the reference the fused layer is tested against. Same maths as :func:`flash_mhf_layer`."""
    batch, length, width = p.shape
    dtype = _compute_dtype(p.dtype)  # (a float64 layer keeps its precision, as the op's reference does)
    with autocast_off(p.device.type):  # float32 norm and gates, also under autocast
        queries = p.view(batch, length, width // head_dim, head_dim).transpose(1, 2).to(dtype)
        if norm_weight is not None:
            queries = queries * torch.rsqrt(queries.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(dtype)
        gates = router_gates(queries, router, gate_eps)
        if router is None:  # r = 1 for every sub-network, as the kernels take it
            gates = gates.expand(*gates.shape[:-1], k.shape[1])
    heads = flash_mhf(queries.to(p.dtype), k, u, v, gates, impl=impl)
    return heads.transpose(1, 2).reshape(batch, length, width)


def _layer_forward_impl(p, norm_weight, router, weights, head_dim, eps, gate_eps):
    batch, length, width = p.shape
    k, u, v = weights.chunk(3)
    if batch * length <= DECODE_MAX_TOKENS:
        return decode_forward(p, norm_weight, router, k, u, v, eps, gate_eps)
    return _layer_forward_keeping_queries(p, norm_weight, router, weights, head_dim, eps, gate_eps, totals=False)[0]


def _layer_forward_keeping_queries(p, norm_weight, router, weights, head_dim, eps, gate_eps, totals: bool = True):
    """(the layer's output, q, r, the gates' totals or None): the forward of training, which keeps q, r and the totals
    for the backward instead of recomputing them there (inference asks for no totals)."""
    batch, length, width = p.shape
    k, u, v = weights.chunk(3)
    inference = not totals  # the kernels' builds for any number of tokens (`triton_launch.any_size`)
    outputs = queries_and_gates(p, norm_weight, router, head_dim, k.shape[1], eps, gate_eps, totals=totals)
    q, r, totals = outputs if totals else (*outputs, None)
    heads = triton_forward(q.view(batch, length, width // head_dim, head_dim).transpose(1, 2), k, u, v, r,
                           inference=inference)
    return heads.transpose(1, 2).reshape(batch, length, width), q, r, totals  # heads has q's layout: a view


# Where the op's dq/dr kernel is its Gluon kernel and every weight group has one head, the layer's norm/gate backward
# runs inside it (benchmarks switch this off to time the norm/gate backward kernel of its own instead).
GATES_IN_ROWS_KERNEL = True


def _gates_in_rows_kernel(queries: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the layer's norm/gate backward runs inside the op's dq/dr kernel (its Gluon kernel, one head per
    weight group) rather than as a kernel of its own."""
    return (GATES_IN_ROWS_KERNEL and FusedGates is not None and queries.shape[1] == k.shape[0]
            and row_gradient_kernel(queries, k) == "gluon")


def _layer_backward_impl(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps, saved=None,
                         weight_gradients: bool = True):
    """The layer's gradients; ``saved``: the forward's (q, r, totals), or None to recompute them from p;
    ``weight_gradients=False`` (frozen sub-network weights): no dK/dU/dV kernel, and None for the weights."""
    batch, length, width = p.shape
    k, u, v = weights.chunk(3)
    if saved is None:
        saved = queries_and_gates(p, norm_weight, router, head_dim, k.shape[1], eps, gate_eps, totals=True)
    q, r, totals = saved

    def heads(t):  # [B, L, H * d_h] -> a [B, H, L, d_h] view
        return t.view(batch, length, width // head_dim, head_dim).transpose(1, 2)

    # the kernels write dK, dU, dV into the thirds of one buffer: the gradient of `weights`, with no concatenation
    grad_weights = torch.empty_like(weights) if weight_gradients else None
    weight_arguments = dict(weight_grads=grad_weights.chunk(3) if weight_gradients else None,
                            weight_gradients=weight_gradients)
    if _gates_in_rows_kernel(heads(p), k):
        tokens, num_heads = batch * length, width // head_dim
        slots = gate_partial_slots(tokens)

        def parts(*shape):
            return torch.empty(slots, num_heads, *shape, device=p.device, dtype=torch.float32)

        gates = FusedGates(p.view(tokens, width), norm_weight, router, totals, torch.empty_like(p).view(tokens, width),
                           None if norm_weight is None else parts(head_dim),
                           None if router is None else parts(e_dot(k.shape[1]), head_dim), eps)
        triton_backward(heads(grad_out.contiguous()), heads(q), k, u, v, r, fused_gates=gates, **weight_arguments)
        grad_p = gates.grad_p.view(batch, length, width)
        grad_norm, grad_router = finish_gate_gradients(gates.norm_parts, gates.router_parts, norm_weight, router,
                                                       tokens)
    else:
        grad_q, _, _, _, grad_r = triton_backward(heads(grad_out.contiguous()), heads(q), k, u, v, r,
                                                  **weight_arguments)
        grad_q = grad_q.transpose(1, 2).reshape(batch, length, width)  # grad_q has q's layout: a view
        grad_p, grad_norm, grad_router = queries_and_gates_backward(p, norm_weight, router, grad_q, grad_r, head_dim,
                                                                    eps, gate_eps)
    # each gradient in the layout the backward operator's fake kernel promises a compiled graph (no copy where it is)
    return tuple(None if g is None else _in_layout_of(t, g) for t, g in zip(
        (p, norm_weight, router, weights), (grad_p, grad_norm, grad_router, grad_weights)))


def _operator_gradients(grads, p):
    """The layer's gradients as a backward operator returns them: a custom op returns tensors, so an empty one stands
    for the gradient of an absent norm weight or router."""
    return tuple(p.new_empty(0) if g is None else g for g in grads)


def _fake_gradients(p, norm_weight, router, weights):
    """What a layer backward operator's fake kernel returns (the shapes and layouts of `_operator_gradients`)."""
    optional = [p.new_empty(0) if t is None else torch.empty_like(t) for t in (norm_weight, router)]
    return (torch.empty_like(p), *optional, torch.empty_like(weights))


def _autograd_gradients(grads, norm_weight, router):
    """A backward operator's gradients as autograd takes them: None for an absent norm weight or router and for the
    layer's three settings."""
    grad_p, grad_norm, grad_router, grad_weights = grads
    return (grad_p, None if norm_weight is None else grad_norm, None if router is None else grad_router, grad_weights,
            None, None, None)


def _register_layer_ops():
    forward_name, backward_name = f"{OP_NAMESPACE}::flash_mhf_layer", f"{OP_NAMESPACE}::flash_mhf_layer_backward"

    @torch.library.custom_op(forward_name, mutates_args=())
    def layer_op(p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None,
                 weights: torch.Tensor, head_dim: int, eps: float, gate_eps: float) -> torch.Tensor:
        return _layer_forward_impl(p, norm_weight, router, weights, head_dim, eps, gate_eps)

    @layer_op.register_fake
    def _(p, norm_weight, router, weights, head_dim, eps, gate_eps):
        return torch.empty_like(p)

    @torch.library.custom_op(backward_name, mutates_args=())
    def layer_backward_op(
        grad_out: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None,
        weights: torch.Tensor, head_dim: int, eps: float, gate_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _operator_gradients(
            _layer_backward_impl(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps), p)

    @layer_backward_op.register_fake
    def _(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps):
        return _fake_gradients(p, norm_weight, router, weights)

    def setup_context(ctx, inputs, output):
        p, norm_weight, router, weights, head_dim, eps, gate_eps = inputs
        ctx.save_for_backward(p, norm_weight, router, weights)
        ctx.settings = (head_dim, eps, gate_eps)

    def backward(ctx, grad_out):
        p, norm_weight, router, weights = ctx.saved_tensors
        grads = getattr(torch.ops, OP_NAMESPACE).flash_mhf_layer_backward(grad_out, p, norm_weight, router, weights,
                                                                           *ctx.settings)
        return _autograd_gradients(grads, norm_weight, router)

    layer_op.register_autograd(backward, setup_context=setup_context)


if _registered("flash_mhf_layer") is None:
    _register_layer_ops()
_layer_op = _registered("flash_mhf_layer")


def _register_training_layer_ops():
    """The layer's operators for training: the forward also returns q, r and the gates' totals, which autograd keeps
    for the backward (one [tokens, H * d_h] tensor in p's dtype and two small float32 ones per layer) so that the
    backward does not compute them again from p. `flash_mhf_layer` (inference) returns the output alone. Frozen
    sub-network weights get no gradient: their backward operator skips the weight-gradient kernel."""
    forward_name = f"{OP_NAMESPACE}::flash_mhf_layer_keeping_queries"
    backward_name = f"{OP_NAMESPACE}::flash_mhf_layer_backward_from_queries"
    frozen_weights_backward_name = f"{OP_NAMESPACE}::flash_mhf_layer_backward_from_queries_frozen_weights"

    @torch.library.custom_op(forward_name, mutates_args=())
    def training_op(p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None,
                    weights: torch.Tensor, head_dim: int, eps: float, gate_eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out, q, r, totals = _layer_forward_keeping_queries(p, norm_weight, router, weights, head_dim, eps, gate_eps)
        # a custom op returns tensors: an empty one stands for the totals of a layer without a router
        return out, q, r, p.new_empty(0, dtype=torch.float32) if totals is None else totals

    @training_op.register_fake
    def _(p, norm_weight, router, weights, head_dim, eps, gate_eps):
        batch, length, width = p.shape
        gates_shape = (batch, width // head_dim, length)
        totals = p.new_empty(gates_shape if router is not None else (0,), dtype=torch.float32)
        return (torch.empty_like(p), torch.empty_like(p), p.new_empty(*gates_shape, weights.shape[1],
                                                                        dtype=torch.float32), totals)

    @torch.library.custom_op(backward_name, mutates_args=())
    def training_backward_op(
        grad_out: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None,
        weights: torch.Tensor, q: torch.Tensor, r: torch.Tensor, totals: torch.Tensor, head_dim: int, eps: float,
        gate_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        saved = (q, r, None if router is None else totals)
        return _operator_gradients(
            _layer_backward_impl(grad_out, p, norm_weight, router, weights, head_dim, eps, gate_eps, saved), p)

    @training_backward_op.register_fake
    def _(grad_out, p, norm_weight, router, weights, q, r, totals, head_dim, eps, gate_eps):
        return _fake_gradients(p, norm_weight, router, weights)

    # the same without the sub-network weights' gradient, for weights that need none (frozen, as under LoRA on the
    # projections): the weight-gradient kernel, the layer's longest, is not launched
    @torch.library.custom_op(frozen_weights_backward_name, mutates_args=())
    def frozen_weights_backward_op(
        grad_out: torch.Tensor, p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None,
        weights: torch.Tensor, q: torch.Tensor, r: torch.Tensor, totals: torch.Tensor, head_dim: int, eps: float,
        gate_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        saved = (q, r, None if router is None else totals)
        return _operator_gradients(_layer_backward_impl(grad_out, p, norm_weight, router, weights, head_dim, eps,
                                                        gate_eps, saved, weight_gradients=False)[:3], p)

    @frozen_weights_backward_op.register_fake
    def _(grad_out, p, norm_weight, router, weights, q, r, totals, head_dim, eps, gate_eps):
        return _fake_gradients(p, norm_weight, router, weights)[:3]

    def setup_context(ctx, inputs, output):
        p, norm_weight, router, weights, head_dim, eps, gate_eps = inputs
        _, q, r, totals = output
        ctx.save_for_backward(p, norm_weight, router, weights, q, r, totals)
        ctx.mark_non_differentiable(q, r, totals)
        ctx.set_materialize_grads(False)
        ctx.settings = (head_dim, eps, gate_eps)

    def backward(ctx, grad_out, *_):
        p, norm_weight, router, weights, q, r, totals = ctx.saved_tensors
        operators = getattr(torch.ops, OP_NAMESPACE)
        arguments = (grad_out, p, norm_weight, router, weights, q, r, totals, *ctx.settings)
        if ctx.needs_input_grad[3]:
            grads = operators.flash_mhf_layer_backward_from_queries(*arguments)
        else:
            grads = (*operators.flash_mhf_layer_backward_from_queries_frozen_weights(*arguments), None)
        return _autograd_gradients(grads, norm_weight, router)

    training_op.register_autograd(backward, setup_context=setup_context)


if _registered("flash_mhf_layer_keeping_queries") is None:
    _register_training_layer_ops()
_training_layer_op = _registered("flash_mhf_layer_keeping_queries")


class _EagerLayer(torch.autograd.Function):
    """The fused layer's autograd outside torch.compile: the same forward and backward as the custom operator (which
    torch.compile needs), without its dispatch, whose Python costs about as much host time per training step as the
    layer's GPU work at the 370M shape. Its backward, like the operator's, is not differentiable again: a second
    derivative through it (`create_graph=True`) raises instead of leaving the layer's share out. Sub-network weights
    that need no gradient (frozen, as under LoRA on the projections) get none: their kernel, the layer's longest
    (docs/speed.md), is not launched."""

    @staticmethod
    def forward(ctx, p, norm_weight, router, weights, head_dim, eps, gate_eps):
        out, q, r, totals = _layer_forward_keeping_queries(p, norm_weight, router, weights, head_dim, eps, gate_eps)
        ctx.save_for_backward(p, norm_weight, router, weights, q, r, totals)
        ctx.settings = (head_dim, eps, gate_eps)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        p, norm_weight, router, weights, *saved = ctx.saved_tensors
        grads = _layer_backward_impl(grad_out, p, norm_weight, router, weights, *ctx.settings, saved=saved,
                                     weight_gradients=ctx.needs_input_grad[3])
        return (*grads, None, None, None)


def _fused_layer_unsupported_reason(p, k, impl: str) -> str | None:
    """Why the fused layer cannot run (None when it can); decided once per device type, dtype and shape (decoding
    calls this for every layer of every step). A compiled graph decides once, while tracing: the uncached function
    then, since Dynamo traces through a cache wrapper anyway and warns about it."""
    decide = _fused_layer_reason_for.__wrapped__ if torch.compiler.is_compiling() else _fused_layer_reason_for
    return decide(p.device, p.dtype, k.shape[-1], k.shape[1], k.shape[2], impl)


@functools.lru_cache(maxsize=None)
def _fused_layer_reason_for(device, dtype, head_dim: int, num_subnetworks: int, subnetwork_size: int,
                            impl: str) -> str | None:
    probe = torch.empty(1, 1, 1, head_dim, device=device, dtype=dtype)
    if _resolve_impl(probe, impl) != "triton":
        return "the op runs the PyTorch reference" + ("" if impl == "torch" else f" on {device.type} tensors")
    if queries_and_gates is None:
        return "flash_mhf_layer_triton.py is missing"
    return _triton_unsupported_reason(probe, probe.new_empty(1, num_subnetworks, subnetwork_size, head_dim))


def flash_mhf_layer_path(p: torch.Tensor, k: torch.Tensor, *, impl: str = "auto", fused: bool = True,
                         needs_grad: bool | None = None) -> str:
    """What :func:`flash_mhf_layer` runs for ``p`` [B, L, H * d_h] and the key ``k`` [H_kv, E, d_e, d_h], as one
    line. ``needs_grad``: whether autograd records the forward (training runs the decode kernel for no size); by
    default, whether it would for ``p`` and ``k`` now."""
    if needs_grad is None:
        needs_grad = torch.is_grad_enabled() and (p.requires_grad or k.requires_grad)
    reason = _fused_layer_unsupported_reason(p, k, impl) if fused else "fusion switched off"
    # (the path depends on the queries' shape, dtype and device only: one element viewed as [B, H, L, d_h], not a
    # tensor as large as the layer's input, which the FFN module would allocate at its first forward)
    queries = p.new_empty(1, 1, 1, 1).expand(p.shape[0], p.shape[-1] // k.shape[-1], p.shape[1], k.shape[-1])
    if reason is not None:
        return f"unfused layer (PyTorch norm and gates, {reason}); op: {flash_mhf_path(queries, k, impl=impl)}"
    tokens = p.shape[0] * p.shape[1]
    if tokens <= DECODE_MAX_TOKENS and not needs_grad:
        return (f"fused layer: the Triton decode kernel (norm, gates and op for {tokens} <= {DECODE_MAX_TOKENS} "
                "tokens) and the sum of its column splits")
    if _gates_in_rows_kernel(queries, k):
        gates = "Triton norm/gate forward kernel, norm/gate backward inside the Gluon dq/dr kernel"
    else:
        gates = "Triton norm/gate kernels"
    return f"fused layer: {gates} + {flash_mhf_path(queries, k, impl=impl)}"


def flash_mhf_layer(
    p: torch.Tensor, norm_weight: torch.Tensor | None, router: torch.Tensor | None, weights: torch.Tensor, *,
    eps: float, gate_eps: float, impl: str = "auto", fused: bool = True,
) -> torch.Tensor:
    """The FlashMHF FFN layer between its projections, ``[B, L, H * d_h] -> [B, L, H * d_h]``. Per head ``h``, with
    ``p_h`` the head's slice of ``p``:

        q = p_h / rms(p_h) * norm_weight                              (float32; no norm when norm_weight is None)
        r = sigmoid(q router_h) / (sum_E sigmoid(q router_h) + gate_eps)   (float32; r = 1 when router is None)
        o_h = flash_mhf(q in p's dtype, k, u, v, r)

    (The norm and the gates in float64 for a float64 ``p``, which the PyTorch path runs: the kernels take 16- and
    32-bit floats.)

    ``norm_weight`` [d_h], ``router`` [H, d_h, E], ``weights`` [3 * H_kv, E, d_e, d_h]: ``k, u, v`` stacked (its
    thirds; cast to ``p``'s dtype). On the Triton path the norm and the gates are computed by kernels, forward and
    backward, and the backward writes the three weight gradients into one tensor (``fused=False`` runs the norm and
    the gates as PyTorch operations around the op, the reference); :func:`flash_mhf_layer_path` says which path runs.
    """
    if p.dim() != 3:
        raise ValueError(f"p must be [batch, seq_len, heads * head_dim]; got shape {tuple(p.shape)}")
    if weights.dim() != 4 or weights.shape[0] % 3:
        raise ValueError("weights must be [3 * kv_heads, num_subnetworks, subnetwork_size, head_dim] (key, up and "
                         f"value stacked); got shape {tuple(weights.shape)}")
    head_dim = weights.shape[-1]
    if p.shape[-1] % head_dim:
        raise ValueError(f"p's last dimension {p.shape[-1]} must be a multiple of head_dim={head_dim}")
    heads, kv_heads, num_subnetworks = p.shape[-1] // head_dim, weights.shape[0] // 3, weights.shape[1]
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"weights' kv_heads={kv_heads} (its first dimension / 3) must divide the heads of p "
                         f"({p.shape[-1]} // head_dim {head_dim} = {heads})")
    if norm_weight is not None and tuple(norm_weight.shape) != (head_dim,):
        raise ValueError(f"norm_weight must be [head_dim] = ({head_dim},); got shape {tuple(norm_weight.shape)}")
    if router is not None and tuple(router.shape) != (heads, head_dim, num_subnetworks):
        raise ValueError(f"router must be [heads, head_dim, num_subnetworks] = {(heads, head_dim, num_subnetworks)}; "
                         f"got shape {tuple(router.shape)}")
    for name, tensor in (("p", p), ("norm_weight", norm_weight), ("router", router), ("weights", weights)):
        if tensor is not None and not tensor.is_floating_point():  # (as `flash_mhf` refuses: not cast and run)
            raise ValueError(f"{name} must be a floating-point tensor; got dtype {tensor.dtype}")
    # (a cast or copy that changes nothing still costs a call per layer; a cast keeps the weights' layout unless told,
    # and the kernels read them contiguous)
    weights = (weights.to(p.dtype, memory_format=torch.contiguous_format) if weights.dtype != p.dtype
               else weights.contiguous())
    if not fused or _fused_layer_unsupported_reason(p, weights, impl) is not None:
        return flash_mhf_layer_reference(p, norm_weight, router, *weights.chunk(3), head_dim, eps, gate_eps,
                                         impl=impl)
    # (the kernels read p as rows, the norm weight [d_h] and the router [H, d_h, E] as dense tensors)
    p = p.contiguous()
    norm_weight = norm_weight.contiguous() if norm_weight is not None else None
    router = router.contiguous() if router is not None else None
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (p, norm_weight, router, weights))
    # (compiled graphs call the operators; so does eager code under a dispatch mode such as FlopCounterMode, which
    # sees operators, not the kernels that `_EagerLayer` launches)
    if torch.compiler.is_compiling() or _dispatch_mode_active():
        if needs_grad:
            return _training_layer_op(p, norm_weight, router, weights, head_dim, eps, gate_eps)[0]
        return _layer_op(p, norm_weight, router, weights, head_dim, eps, gate_eps)
    if not needs_grad:  # inference: the kernels directly, no autograd node
        return _layer_forward_impl(p, norm_weight, router, weights, head_dim, eps, gate_eps)
    return _EagerLayer.apply(p, norm_weight, router, weights, head_dim, eps, gate_eps)


def _dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode watches the operators run (`torch.utils.flop_counter.FlopCounterMode`, a
    debugging mode) or traces them (a fake tensor mode); not asked while compiling."""
    return _get_current_dispatch_mode() is not None


# --------------------------------------------------------------------------------------------------------------------
# FLOPs for `torch.utils.flop_counter.FlopCounterMode`
# --------------------------------------------------------------------------------------------------------------------
# The operators count as the products they compute would count as torch's own: per query row, the three products of
# every sub-network column with the head's d_h values (2 FLOPs per multiply-add), the router's d_h x E product in the
# layer operators, and twice those for a backward (each product's gradient for both operands), as FlopCounterMode
# counts a matmul and its backward; whatever the kernels recompute on top is not counted. The norm, gates and SiLU
# are elementwise, which FlopCounterMode counts for no operator.
def _op_flops(rows: int, subnetworks: int, subnetwork_size: int, head_dim: int) -> int:
    return 6 * rows * subnetworks * subnetwork_size * head_dim


def _layer_flops(p_shape, router_shape, weights_shape, head_dim: int) -> int:
    batch, length, width = p_shape
    rows = batch * length * (width // head_dim)
    _, subnetworks, subnetwork_size, _ = weights_shape
    router = 0 if router_shape is None else 2 * rows * head_dim * subnetworks
    return _op_flops(rows, subnetworks, subnetwork_size, head_dim) + router


def _register_flop_formulas() -> None:
    from torch.utils import flop_counter

    def op_forward(q, k, u, v, r, impl, out_shape=None, **kwargs):
        return _op_flops(q[0] * q[1] * q[2], k[1], k[2], k[3])

    def op_backward(grad_out, q, k, u, v, r, impl, out_shape=None, **kwargs):
        return 2 * op_forward(q, k, u, v, r, impl)

    def layer_forward(p, norm_weight, router, weights, head_dim, *settings, out_shape=None, **kwargs):
        return _layer_flops(p, router, weights, head_dim)

    def layer_backward(grad_out, p, norm_weight, router, weights, *rest, out_shape=None, **kwargs):
        head_dim = rest[-3]  # (head_dim, eps, gate_eps close both backward operators' arguments)
        return 2 * _layer_flops(p, router, weights, head_dim)

    operators = getattr(torch.ops, OP_NAMESPACE)
    formulas = {operators.flash_mhf: op_forward, operators.flash_mhf_backward: op_backward,
                operators.flash_mhf_layer: layer_forward, operators.flash_mhf_layer_backward: layer_backward,
                operators.flash_mhf_layer_keeping_queries: layer_forward,
                operators.flash_mhf_layer_backward_from_queries: layer_backward}
    for operator, formula in formulas.items():
        if operator not in flop_counter.flop_registry:  # (once per process, whichever copy of this file comes first)
            flop_counter.register_flop_formula(operator)(formula)


_register_flop_formulas()
