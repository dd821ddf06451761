"""Triton kernels for the element-wise part of KV-FFN: `act(key) * value` (or `act(key) + value`) from the output of
its joint key/value projection, forward and backward.

`KVFeedForward.key_value_proj` writes key i and value i side by side (outputs 2i and 2i + 1, so that a contiguous
share of its rows, as tensor parallelism cuts it, holds matching keys and values). As PyTorch operations the keys and
values are stride-2 views: in eager mode the activation and the product each read the whole interleaved tensor, and
the backward stacks the two gradients into the interleaved layout with one more pass. Here each direction is one pass:

* ``_paired_forward_kernel``: ``hidden[i] = act(y[2i]) * y[2i + 1]`` (``+`` for the "sum" composition);
* ``_paired_backward_kernel``: ``dy[2i]`` and ``dy[2i + 1]`` from ``y`` and ``d hidden``, written interleaved.

Each program reads and writes the interleaved tensor as one contiguous block, split into keys and values (and joined
again) in registers, so that its loads and stores are 16-byte vectors wherever Triton specialises the launch on
aligned tensors and a number of pairs divisible by 16 (the presets' shapes).

The activations are KV-FFN's choices: SiLU, GELU (exact, erf), ReLU, and the sigmoid of the GLU baseline. Maths in
float32, outputs rounded once to the input dtype. ``decoder_kernels`` (the config field that also governs the decoder's
norm and rotary kernels) decides the path, by ``paired_kernels_unavailable``; ``KVFeedForward.path_description`` says
which runs. Under ``torch.compile`` the same kernels run as Triton operators (``torch.library.triton_op``), which
inductor launches from its generated code like its own kernels: its kernels for the interleaved layout take about
1.5x (forward) and 2x (backward) these kernels' time, and an opaque custom operator would cost more host time than
these save on the GPU at small batches (`kernels/profile_kvffn_layer.py`; `kernels/flash_mhf_notes.md`, v86-v87).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .configuration_memffn import DECODER_KERNELS
# (triton from the sibling that imports it in a `try` block: transformers refuses to load a checkpoint's code whose
# files import a missing package outside one, and triton is optional)
from .decoder_triton import KERNEL_DTYPES, TRITON_AVAILABLE, decoder_kernels_unavailable, tl, triton
from .triton_launch import INTERPRET_REQUESTED, cdiv, launch, refuse_kernel_dtype, registered_operator

# the activations the kernels compute (`KVFFNConfig.activations` and the GLU baseline's sigmoid), by constexpr id
PAIRED_ACTIVATIONS = {"silu": 0, "gelu": 1, "relu": 2, "sigmoid": 3}
PAIRED_BLOCK = 1024  # pairs per program

if TRITON_AVAILABLE:

    @triton.jit
    def _activation_and_derivative(x, ACTIVATION: tl.constexpr):
        """(act(x), act'(x)) in float32."""
        if ACTIVATION == 0:  # silu
            sig = 1.0 / (1.0 + tl.exp(-x))
            return x * sig, sig * (1.0 + x * (1.0 - sig))
        elif ACTIVATION == 1:  # gelu, exact
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return x * cdf, cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
        elif ACTIVATION == 2:  # relu
            positive = x > 0.0
            return tl.where(positive, x, 0.0), tl.where(positive, 1.0, 0.0)
        else:  # sigmoid
            sig = 1.0 / (1.0 + tl.exp(-x))
            return sig, sig * (1.0 - sig)

    @triton.jit
    def _num_elements(num_pairs):
        """``2 * num_pairs`` in 64 bits: Triton passes a number of pairs below 2**31 as a 32-bit integer, whose double
        wraps around from 2**30 pairs on (a batch's [tokens, 2W] projection of 2**31 elements and more)."""
        return 2 * tl.cast(num_pairs, tl.int64)

    @triton.jit
    def _load_pairs(Y, first_pair, num_pairs, BLOCK: tl.constexpr):
        """(keys, values) of pairs first_pair .. first_pair + BLOCK - 1 in float32, read as 2 * BLOCK contiguous
        elements (pairs past num_pairs read as zeros)."""
        elements = 2 * first_pair + tl.arange(0, 2 * BLOCK)
        y = tl.load(Y + elements, mask=elements < _num_elements(num_pairs), other=0.0).to(tl.float32)
        return tl.split(tl.reshape(y, (BLOCK, 2)))

    @triton.jit
    def _paired_forward_kernel(Y, H, num_pairs, ACTIVATION: tl.constexpr, PRODUCT: tl.constexpr,
                               BLOCK: tl.constexpr):
        first_pair = tl.program_id(0).to(tl.int64) * BLOCK
        key, value = _load_pairs(Y, first_pair, num_pairs, BLOCK)
        act, _ = _activation_and_derivative(key, ACTIVATION)
        hidden = act * value if PRODUCT else act + value
        pairs = first_pair + tl.arange(0, BLOCK)
        tl.store(H + pairs, hidden.to(H.dtype.element_ty), mask=pairs < num_pairs)

    @triton.jit
    def _paired_backward_kernel(Y, DH, DY, num_pairs, ACTIVATION: tl.constexpr, PRODUCT: tl.constexpr,
                                BLOCK: tl.constexpr):
        first_pair = tl.program_id(0).to(tl.int64) * BLOCK
        key, value = _load_pairs(Y, first_pair, num_pairs, BLOCK)
        pairs = first_pair + tl.arange(0, BLOCK)
        grad_hidden = tl.load(DH + pairs, mask=pairs < num_pairs, other=0.0).to(tl.float32)
        act, act_derivative = _activation_and_derivative(key, ACTIVATION)
        if PRODUCT:
            grad_key, grad_value = grad_hidden * value * act_derivative, grad_hidden * act
        else:
            grad_key, grad_value = grad_hidden * act_derivative, grad_hidden
        grad_y = tl.reshape(tl.join(grad_key, grad_value), (2 * BLOCK,))  # key i's gradient at 2i, value i's at 2i + 1
        elements = 2 * first_pair + tl.arange(0, 2 * BLOCK)
        tl.store(DY + elements, grad_y.to(DY.dtype.element_ty), mask=elements < _num_elements(num_pairs))


def _launch(kernel, pairs: int, *tensors, activation: int, product: bool, traced: bool) -> None:
    """One launch over ``pairs`` pairs; ``traced``: as a Triton operator's body, through ``torch.library.wrap_triton``
    so that inductor launches the kernel from its own code (torch 2.11 does not wrap the interpreter's kernels, which
    no compiled graph calls)."""
    if not pairs:
        return
    grid = (cdiv(pairs, PAIRED_BLOCK),)
    settings = dict(ACTIVATION=activation, PRODUCT=product, BLOCK=PAIRED_BLOCK, num_warps=4)
    if traced and not INTERPRET_REQUESTED:
        torch.library.wrap_triton(kernel)[grid](*tensors, pairs, **settings)
    else:
        launch(kernel, grid, *tensors, pairs, **settings)


def _forward(y: torch.Tensor, activation: int, product: bool, traced: bool = False) -> torch.Tensor:
    hidden = y.new_empty(*y.shape[:-1], y.shape[-1] // 2)
    _launch(_paired_forward_kernel, hidden.numel(), y, hidden, activation=activation, product=product, traced=traced)
    return hidden


def _backward(y: torch.Tensor, grad_hidden: torch.Tensor, activation: int, product: bool, traced: bool = False
              ) -> torch.Tensor:
    grad_y = torch.empty_like(y)
    _launch(_paired_backward_kernel, grad_hidden.numel(), y, grad_hidden, grad_y, activation=activation,
            product=product, traced=traced)
    return grad_y


def paired_forward(y: torch.Tensor, activation: str, product: bool) -> torch.Tensor:
    """``act(keys) * values`` (``+`` unless ``product``) of a contiguous ``y [..., 2W]`` holding key i at 2i and value
    i at 2i + 1: a new ``[..., W]`` tensor in y's dtype."""
    return _forward(y, PAIRED_ACTIVATIONS[activation], product)


def paired_backward(y: torch.Tensor, grad_hidden: torch.Tensor, activation: str, product: bool) -> torch.Tensor:
    """The gradient of :func:`paired_forward` with respect to ``y``, interleaved like ``y``."""
    return _backward(y, grad_hidden.contiguous(), PAIRED_ACTIVATIONS[activation], product)


class _PairedActivation(torch.autograd.Function):
    """The kernels' autograd; their backward is not differentiable again: a second derivative through it (a gradient
    of a gradient, `create_graph=True`) raises instead of leaving this function's share out."""

    @staticmethod
    def forward(ctx, y, activation, product):
        ctx.save_for_backward(y)
        ctx.settings = (activation, product)
        return paired_forward(y, activation, product)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_hidden):
        (y,) = ctx.saved_tensors
        return paired_backward(y, grad_hidden, *ctx.settings), None, None


# ----------------------------------------------------------------------------------------------------------------------
# The same kernels as Triton operators, for compiled graphs: inductor launches a Triton operator's kernels from its own
# generated code, as it launches the kernels it writes, so a compiled step pays no dispatch or Python for them (an
# opaque custom operator would; `kernels/flash_mhf_notes.md`, v86). Registered once per process, whichever copy of
# this file is imported first (a checkpoint's remote code may bring another).
OP_NAMESPACE = "memffn_v2"  # shared with flash_mhf_op.py and token_lookup_triton.py; the op names differ


def _register_paired_operators():
    @torch.library.triton_op(f"{OP_NAMESPACE}::kvffn_paired_forward", mutates_args=())
    def paired_forward_op(y: torch.Tensor, activation: int, product: bool) -> torch.Tensor:
        return _forward(y, activation, product, traced=True)

    @torch.library.triton_op(f"{OP_NAMESPACE}::kvffn_paired_backward", mutates_args=())
    def paired_backward_op(y: torch.Tensor, grad_hidden: torch.Tensor, activation: int, product: bool
                           ) -> torch.Tensor:
        return _backward(y, grad_hidden, activation, product, traced=True)

    def setup_context(ctx, inputs, output):
        y, activation, product = inputs
        ctx.save_for_backward(y)
        ctx.settings = (activation, product)

    def backward(ctx, grad_hidden):
        (y,) = ctx.saved_tensors
        return paired_backward_op(y, grad_hidden.contiguous(), *ctx.settings), None, None

    paired_forward_op.register_autograd(backward, setup_context=setup_context)


if TRITON_AVAILABLE and registered_operator(OP_NAMESPACE, "kvffn_paired_forward") is None:
    _register_paired_operators()


def paired_kernels_unavailable(y: torch.Tensor, kernels: str) -> str | None:
    """Why KV-FFN's activation runs as PyTorch operations for the projection output ``y`` under ``decoder_kernels``
    ``kernels``, or None when these kernels run: as the decoder's kernels do in eager mode, and on CUDA while Dynamo
    traces (``torch.compile``, strict ``torch.export``) as the Triton operators that inductor launches itself.
    Non-strict export (which ONNX export tries first) keeps the PyTorch operations, and so does a compiled graph on
    the CPU (the interpreter's kernels cannot be traced)."""
    if (kernels in DECODER_KERNELS and kernels != "torch" and TRITON_AVAILABLE and y.device.type == "cuda"
            and y.dtype in KERNEL_DTYPES and torch.compiler.is_dynamo_compiling()):
        return None
    return decoder_kernels_unavailable(y, kernels)


def _check(y: torch.Tensor, activation: str) -> None:
    if activation not in PAIRED_ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {tuple(PAIRED_ACTIVATIONS)}")
    if y.dim() == 0 or y.shape[-1] % 2:
        raise ValueError(f"y of shape {tuple(y.shape)}: its last dimension must be even (key i at 2i, value i at "
                         "2i + 1)")
    if y.dtype not in KERNEL_DTYPES:
        refuse_kernel_dtype("paired_activation", "y", y.dtype)


def paired_activation(y: torch.Tensor, activation: str, product: bool = True) -> torch.Tensor:
    """KV-FFN's hidden activation from its interleaved key/value projection ``y [..., 2W]`` by the Triton kernels:
    ``act(y[..., 0::2]) * y[..., 1::2]`` (``+`` with ``product=False``), ``[..., W]``, for ``y`` of a dtype of
    ``KERNEL_DTYPES``. While Dynamo traces (under ``torch.compile``), the Triton operator, which inductor launches
    itself."""
    _check(y, activation)
    y = y.contiguous()
    if torch.compiler.is_dynamo_compiling():
        return getattr(torch.ops, OP_NAMESPACE).kvffn_paired_forward(y, PAIRED_ACTIVATIONS[activation], product)
    if torch.is_grad_enabled() and y.requires_grad:
        return _PairedActivation.apply(y, activation, product)
    return paired_forward(y, activation, product)  # inference: no autograd node


__all__ = ["PAIRED_ACTIVATIONS", "paired_activation", "paired_kernels_unavailable"]
