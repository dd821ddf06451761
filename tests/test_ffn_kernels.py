"""KV-FFN's Triton kernels for `act(keys) * values` (`hf_memffn/ffn_triton.py`) against a float64 ground truth, output
and gradient, for every activation and composition; and the block on the kernels against its PyTorch operations.

The kernel tests run on CUDA in this process, and on CPU in a child pytest under TRITON_INTERPRET=1
(`test_ffn_kernels_under_interpreter_in_subprocess`).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from hf_memffn import ffn_triton
from hf_memffn.ffn import KVFeedForward
from hf_memffn.testing import tiny_config
from kernel_scripts_support import kernel_script
from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
REFERENCE_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu, "sigmoid": torch.sigmoid}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", sorted(ffn_triton.PAIRED_ACTIVATIONS))
@pytest.mark.parametrize("product", [True, False], ids=["product", "sum"])
def test_paired_activation_matches_float64(activation, product, dtype):
    """Ragged sizes (not a multiple of the block), an odd number of rows, fresh random inputs."""
    generator = torch.Generator().manual_seed(len(activation) + product)
    y = torch.randn(3, 7, 2 * 173, generator=generator, dtype=torch.float64).to(DEVICE)
    grad_hidden = torch.randn(3, 7, 173, generator=generator, dtype=torch.float64).to(DEVICE)
    y64 = y.clone().requires_grad_(True)
    keys, values = y64[..., 0::2], y64[..., 1::2]
    act = REFERENCE_ACTIVATIONS[activation](keys)
    expected = act * values if product else act + values
    expected.backward(grad_hidden)
    y_k = y.to(dtype).requires_grad_(True)
    out = ffn_triton.paired_activation(y_k, activation, product)
    assert out.dtype == dtype and out.shape == (3, 7, 173)
    out.backward(grad_hidden.to(dtype))
    errors = {"out": relative_error(out, expected), "y": relative_error(y_k.grad, y64.grad)}
    assert max(errors.values()) < TOLERANCE[dtype], errors
    with torch.no_grad():  # inference: no autograd node, the same values
        torch.testing.assert_close(ffn_triton.paired_activation(y_k, activation, product), out.detach(), rtol=0,
                                   atol=0)


@needs_kernels
@pytest.mark.parametrize("num_pairs", [1, 2**30 - 1, 2**30, 2**31 - 1, 2**31], ids=str)
def test_paired_kernels_count_the_pairs_of_a_large_projection(num_pairs):
    """One program of each kernel, told that the projection holds ``num_pairs`` pairs (its own block is in bounds
    either way): from 2**30 pairs on (a [tokens, 2W] projection of 2**31 elements, 4 GB in bf16), twice the count
    of pairs, a 32-bit integer below 2**31 pairs, must not wrap around and mask out every element, which left the
    activation zero and its gradient unwritten."""
    block = ffn_triton.PAIRED_BLOCK
    generator = torch.Generator().manual_seed(11)
    y = torch.randn(2 * block, generator=generator, dtype=torch.float64).to(DEVICE)
    grad_hidden = torch.randn(block, generator=generator, dtype=torch.float64).to(DEVICE)
    valid = min(num_pairs, block)
    y64 = y.clone().requires_grad_(True)
    expected = F.silu(y64[0::2]) * y64[1::2]
    expected[:valid].backward(grad_hidden[:valid])
    y32, hidden, grad_y = y.float(), torch.zeros(block, device=DEVICE), torch.zeros(2 * block, device=DEVICE)
    settings = dict(ACTIVATION=ffn_triton.PAIRED_ACTIVATIONS["silu"], PRODUCT=True, BLOCK=block, num_warps=4)
    ffn_triton.launch(ffn_triton._paired_forward_kernel, (1,), y32, hidden, num_pairs, **settings)
    ffn_triton.launch(ffn_triton._paired_backward_kernel, (1,), y32, grad_hidden.float(), grad_y, num_pairs,
                      **settings)
    errors = {"out": relative_error(hidden[:valid], expected[:valid]),
              "y": relative_error(grad_y[:2 * valid], y64.grad[:2 * valid])}
    assert max(errors.values()) < TOLERANCE[torch.float32], errors


@needs_kernels
@pytest.mark.parametrize("overrides", [{}, {"ffn_variant": "glu"}, {"kvffn_activation": "gelu",
                                                                    "kvffn_composition": "sum"}], ids=str)
def test_kvffn_block_on_the_kernels_matches_its_pytorch_operations(overrides):
    """The block's output and every parameter's gradient, float32: the same on both paths; and each says its path."""
    blocks = {}
    for kernels in ("triton", "torch"):
        torch.manual_seed(0)
        blocks[kernels] = KVFeedForward(tiny_config("kvffn", decoder_kernels=kernels, **overrides)).to(DEVICE)
    x = torch.randn(2, 5, blocks["torch"].out_proj.out_features, device=DEVICE)
    outs = {kernels: block(x) for kernels, block in blocks.items()}
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=1e-5, atol=1e-6)
    for out in outs.values():
        out.square().sum().backward()
    for (name, a), b in zip(blocks["triton"].named_parameters(), blocks["torch"].parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert blocks["triton"].path_description(x).startswith("Triton kernels")
    assert blocks["torch"].path_description(x) == "PyTorch operations for the activation (decoder_kernels='torch')"


@pytest.mark.parametrize("kernel_name", ["_paired_forward_kernel", "_paired_backward_kernel"])
def test_paired_kernels_move_16_byte_vectors_on_hopper(kernel_name):
    """Compiled for sm_90 (no GPU needed) as Triton specialises a launch at the presets' shapes (16-byte aligned
    tensors, a number of pairs divisible by 16), every global load and store of the kernel is a 16-byte vector: the
    interleaved keys and values are read and written as one contiguous block, not element by element."""
    pytest.importorskip("triton")
    compile_check = kernel_script("compile_check")
    kernel = getattr(ffn_triton, kernel_name)
    constants = {"ACTIVATION": ffn_triton.PAIRED_ACTIVATIONS["silu"], "PRODUCT": True, "BLOCK": ffn_triton.PAIRED_BLOCK}
    pointers = {name: "*bf16" for name in kernel.arg_names if name not in constants and name != "num_pairs"}
    compiled = compile_check.build(kernel, 90, pointers, {"num_pairs": 1}, constants, divisible_scalars=("num_pairs",))
    accesses = re.findall(r"\b(?:ld|st)\.global[\w.]*", compiled.asm["ptx"])
    assert accesses and all(".v4.b32" in access for access in accesses), sorted(set(accesses))


def test_baselines_with_keys_only_run_pytorch_operations():
    block = KVFeedForward(tiny_config("kvffn", ffn_variant="relu"))
    assert block.path_description() == "PyTorch operations for the activation (the relu baseline has keys only)"


@needs_kernels
def test_paired_activation_rejects_what_it_cannot_compute():
    y = torch.zeros(2, 6, device=DEVICE)
    with pytest.raises(ValueError, match="activation='tanh' is not one of"):
        ffn_triton.paired_activation(y, "tanh")
    with pytest.raises(ValueError, match="must be even"):
        ffn_triton.paired_activation(y[:, :5], "silu")


def test_paired_activation_refuses_a_tensor_of_no_dimension_by_name():
    with pytest.raises(ValueError, match=r"y of shape \(\): its last dimension must be even"):
        ffn_triton.paired_activation(torch.zeros((), device=DEVICE), "silu")


def test_paired_activation_refuses_float64_by_name():
    """The kernels compute in float32: a float64 projection came back as float64 of float32 precision."""
    with pytest.raises(ValueError, match=r"paired_activation: y has dtype torch.float64, which the Triton kernels do "
                                         r"not take .*allowed: float16, bfloat16, float32"):
        ffn_triton.paired_activation(torch.zeros(2, 6, dtype=torch.float64, device=DEVICE), "silu")


@needs_kernels
def test_paired_activation_refuses_a_second_derivative():
    """The backward kernel is not differentiable again: a gradient of its gradient (a gradient penalty added to the
    loss) raises instead of leaving the activation's share out of it."""
    y = torch.randn(3, 2 * 40, device=DEVICE, requires_grad=True)
    out = ffn_triton.paired_activation(y, "silu")
    (grad,) = torch.autograd.grad(out.square().sum(), y, create_graph=True)
    penalty = grad.square().sum()
    assert penalty.requires_grad
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + penalty).backward()


@needs_kernels
@pytest.mark.parametrize("activation,product", [("silu", True), ("gelu", False)])
def test_triton_operators_compute_what_the_kernels_compute(activation, product):
    """The Triton operators that compiled graphs call: the eager path's output and gradient, to the bit."""
    operator = getattr(torch.ops, ffn_triton.OP_NAMESPACE).kvffn_paired_forward
    y = torch.randn(3, 7, 2 * 40, device=DEVICE, dtype=torch.bfloat16)
    grad_hidden = torch.randn(3, 7, 40, device=DEVICE, dtype=torch.bfloat16)
    results = []
    for run in (lambda y: ffn_triton.paired_activation(y, activation, product),
                lambda y: operator(y, ffn_triton.PAIRED_ACTIVATIONS[activation], product)):
        leaf = y.clone().requires_grad_(True)
        out = run(leaf)
        out.backward(grad_hidden)
        results.append((out.detach(), leaf.grad))
    for eager, operator_result in zip(*results):
        torch.testing.assert_close(operator_result, eager, rtol=0, atol=0)


def test_compiled_block_traces_its_activation_to_the_two_kernels(monkeypatch):
    """Dynamo and AOT autograd (no GPU needed: Triton's driver is the stand-in sm_90 of
    `compare_triton_builds.compiling_for_hopper`, the block's tensors on the CPU taken for CUDA ones) trace the
    block's activation to the forward kernel and its gradient to the backward kernel, each writing only its output."""
    pytest.importorskip("triton")
    if ffn_triton.INTERPRET_REQUESTED:
        pytest.skip("the interpreter's kernels are not traced")
    from hf_memffn import ffn
    from torch._dynamo.backends.common import aot_autograd

    builds = kernel_script("compare_triton_builds")
    unavailable = ffn_triton.paired_kernels_unavailable
    monkeypatch.setattr(ffn, "paired_kernels_unavailable", lambda y, kernels: (
        None if torch.compiler.is_dynamo_compiling() and kernels != "torch" else unavailable(y, kernels)))
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return graph

    block = KVFeedForward(tiny_config("kvffn", hidden_size=128, intermediate_size=256))
    x = torch.randn(2, 64, 128, requires_grad=True)
    torch._dynamo.reset()
    with builds.compiling_for_hopper():  # (a launch does nothing: only the traced graphs are checked)
        compiled = torch.compile(block, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
        compiled(x).sum().backward()
    torch._dynamo.reset()
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    calls = [node.kwargs for graph in graphs for node in graph.graph.nodes if node.target is wrapper]
    launched = [(sorted(name for name, value in call["kwargs"].items() if isinstance(value, torch.fx.Node)),
                 call["tensors_to_clone"]) for call in calls]
    # the forward kernel's arguments (Y, H) and the backward's (Y, DH, DY), each writing its output only
    assert launched == [(["H", "Y"], ["H"]), (["DH", "DY", "Y"], ["DY"])], launched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor launches the Triton operators on CUDA")
def test_compiled_kvffn_block_launches_the_paired_kernels():
    """Under torch.compile (inductor, one graph) the block's activation is these kernels, forward and backward, and
    the block computes what it computes in eager mode; with decoder_kernels='torch' inductor's own kernels run."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 64, 128, device="cuda")
    for kernels, expected in (("auto", True), ("torch", False)):
        torch.manual_seed(0)
        block = KVFeedForward(tiny_config("kvffn", decoder_kernels=kernels, hidden_size=128,
                                          intermediate_size=256)).cuda()
        eager_out = block(x)
        eager_out.square().sum().backward()
        eager_grads = [parameter.grad.clone() for parameter in block.parameters()]
        block.zero_grad()
        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True)
        compiled(x).square().sum().backward()  # compiles
        block.zero_grad()
        with profile(activities=[ProfilerActivity.CUDA]) as trace:
            out = compiled(x)
            out.square().sum().backward()
            torch.cuda.synchronize()
        names = {event.name for event in trace.events()}
        assert {"_paired_forward_kernel" in names, "_paired_backward_kernel" in names} == {expected}, kernels
        torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
        for (name, parameter), eager_grad in zip(block.named_parameters(), eager_grads):
            torch.testing.assert_close(parameter.grad, eager_grad, rtol=1e-4, atol=1e-5, msg=name)


def test_ffn_kernels_under_interpreter_in_subprocess():
    run_under_interpreter(
        __file__, "matches_float64 or matches_its_pytorch or rejects or compute_what or second_derivative "
        "or large_projection")
