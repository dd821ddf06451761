"""The FlashMHF op: Triton kernels and the PyTorch reference against a float64 ground truth.

On a CUDA machine every test runs in this process. On CPU the Triton kernels run in Triton's interpreter, which
must be switched on before triton is first imported; since other test files import it earlier in the same
session, `test_kernels_under_interpreter_in_subprocess` re-runs this file's `triton` tests in a child pytest
with TRITON_INTERPRET=1 (in that child the kernels run in-process, on CPU tensors).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from hf_memffn import flash_mhf_op
from hf_memffn import flash_mhf_triton
from hf_memffn.flash_mhf_op import flash_mhf, flash_mhf_dense, flash_mhf_path, flash_mhf_reference
from triton_interpreter import DEVICE, ON_GPU, needs_kernels, run_under_interpreter

TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}

# (batch, heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, dtype)
KERNEL_CASES = [
    pytest.param(2, 4, 7, 64, 2, 3, 48, torch.float32, id="odd_L-de48-grouped-fp32"),
    pytest.param(3, 2, 1, 64, 2, 2, 32, torch.bfloat16, id="L1-decode-bf16"),
    pytest.param(1, 2, 33, 128, 1, 1, 64, torch.float16, id="E1-one_group-fp16"),
    pytest.param(2, 2, 19, 256, 2, 2, 32, torch.bfloat16, id="dh256-bf16"),
    pytest.param(1, 2, 13, 256, 1, 2, 32, torch.float32, id="dh256-fp32"),
    pytest.param(2, 4, 21, 64, 1, 2, 48, torch.bfloat16, id="four_heads_per_group-bf16"),
]
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# each case above in the two dtypes it does not name
OTHER_DTYPE_CASES = [
    pytest.param(*case.values[:-1], dtype, id=f"{case.id}-as_{name}")
    for case in KERNEL_CASES for dtype, name in DTYPE_NAMES.items() if dtype != case.values[-1]
]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def random_inputs(batch, heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, seed=0):
    """float64 leaves on DEVICE: q, k, u, v and normalised gates r."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, head_dim, generator=generator, dtype=torch.float64)
    weights = [
        torch.randn(kv_heads, num_subnetworks, subnetwork_size, head_dim, generator=generator, dtype=torch.float64)
        * head_dim**-0.5
        for _ in range(3)
    ]
    r = torch.rand(batch, heads, seq_len, num_subnetworks, generator=generator, dtype=torch.float64)
    r = r / r.sum(-1, keepdim=True)
    return [t.to(DEVICE) for t in (q, *weights, r)]


def float64_truth(inputs, grad_out):
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    out = flash_mhf_dense(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def check_against_truth(run, inputs, dtype, gate_dtype=torch.float32, broadcast_dims=()):
    """run(leaves, grad) -> out; compares the output and all five gradients with the float64 ground truth. With
    `broadcast_dims` the output's gradient is one value expanded over those dimensions (stride 0 there, as the
    gradient of a sum over them arrives), in `dtype` as it reaches the op."""
    grad_shape = [1 if dim in broadcast_dims else size for dim, size in enumerate(inputs[0].shape)]
    grad_out = torch.randn(grad_shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected_out, expected_grads = float64_truth(inputs, grad_out.expand(inputs[0].shape))
    leaves = [t.to(dtype).requires_grad_(True) for t in inputs[:4]] + [inputs[4].to(gate_dtype).requires_grad_(True)]
    out = run(leaves, grad_out.to(dtype).expand(inputs[0].shape))
    assert out.dtype == dtype and out.shape == inputs[0].shape
    errors = {"out": relative_error(out, expected_out)}
    for name, leaf, expected in zip(("q", "k", "u", "v", "r"), leaves, expected_grads):
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype, name
        errors["d" + name] = relative_error(leaf.grad, expected)
    bad = {name: err for name, err in errors.items() if not err < TOLERANCE[dtype]}  # NaN fails too
    assert not bad, f"relative errors over {TOLERANCE[dtype]:.0e} for {dtype}: {bad} (all: {errors})"


def run_op(impl):
    def run(leaves, grad_out):
        out = flash_mhf(*leaves, impl=impl)
        out.backward(grad_out)
        return out

    return run


# ------------------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("batch,heads,seq_len,head_dim,kv_heads,num_subnetworks,subnetwork_size,dtype",
                         KERNEL_CASES + OTHER_DTYPE_CASES)
def test_triton_matches_float64(batch, heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, dtype):
    inputs = random_inputs(batch, heads, seq_len, head_dim, kv_heads, num_subnetworks, subnetwork_size, seed=seq_len)
    check_against_truth(run_op("triton"), inputs, dtype)


@needs_kernels
@pytest.mark.parametrize("descriptors", [True, False])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_split_loops_and_read_paths_match_float64(splits, descriptors):
    """The split variants (float32 partial sums added atomically) and both ways of reading the streamed tiles
    (tensor descriptors, per-thread pointers) compute the same function."""
    inputs = random_inputs(2, 2, 9, 64, 2, 2, 32, seed=splits)

    def run(leaves, grad_out):
        q, k, u, v, r = (t.detach() for t in leaves)
        out = flash_mhf_triton.triton_forward(q, k, u, v, r, splits=splits, descriptors=descriptors)
        grads = flash_mhf_triton.triton_backward(grad_out, q, k, u, v, r, splits=splits, descriptors=descriptors)
        for leaf, grad in zip(leaves, grads):
            leaf.grad = grad
        return out

    check_against_truth(run, inputs, torch.float32)


@pytest.fixture
def deterministic_algorithms():
    """`torch.use_deterministic_algorithms(True)` within the test, the global flags as they were after it."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def test_split_loops_are_off_under_deterministic_algorithms(deterministic_algorithms):
    """The split variants add float32 partial sums atomically, in an order that changes from run to run on a GPU:
    under `torch.use_deterministic_algorithms` a problem with few blocks runs its loop in one program."""
    assert flash_mhf_triton._auto_splits(1, 8, torch.device("cpu")) == 1
    torch.use_deterministic_algorithms(False)
    assert flash_mhf_triton._auto_splits(1, 8, torch.device("cpu")) > 1


@needs_kernels
def test_triton_deterministic_algorithms_launch_no_atomic_split(deterministic_algorithms, monkeypatch):
    """A problem with few row blocks (forward) and few column blocks (weight gradients): split into programs that add
    their partial sums atomically, except under `torch.use_deterministic_algorithms`, where each kernel runs unsplit
    (and still computes the function) and `flash_mhf_path` says so."""
    launches = []
    launch = flash_mhf_triton.launch

    def spy(kernel, grid, *args, **kwargs):
        launches.append((kernel.__name__, grid[2] if len(grid) > 2 else 1, kwargs.get("ACCUMULATE", False)))
        return launch(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(flash_mhf_triton, "launch", spy)
    # 80 rows (2 heads of 40 tokens on one weight group), 3 column blocks of 32, and 3 row blocks of 32 under the
    # interpreter or 2 of 64 on a GPU: the weight-gradient loop runs over the row blocks, and one would not split
    inputs = random_inputs(1, 2, 40, 64, 1, 3, 32, seed=4)
    q, k, u, v, r = (t.float() for t in inputs)
    description = flash_mhf_path(q, k, impl="triton")
    assert description.startswith("triton") and "deterministic: no atomic split loops" in description
    check_against_truth(run_op("triton"), inputs, torch.float32)
    assert launches and all(splits == 1 and not accumulate for _, splits, accumulate in launches), launches
    assert {name for name, _, _ in launches} >= {"_forward_kernel", "_backward_weights_kernel"}

    torch.use_deterministic_algorithms(False)
    launches.clear()
    check_against_truth(run_op("triton"), inputs, torch.float32)
    split = {name for name, splits, accumulate in launches if splits > 1 and accumulate}
    assert split == {"_forward_kernel", "_backward_weights_kernel"}, launches  # (the shape does split)
    assert "deterministic" not in flash_mhf_path(q, k, impl="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_small_problems_are_bitwise_reproducible_under_deterministic_algorithms(deterministic_algorithms,
                                                                                        dtype):
    """A decoding-sized and a short-sequence problem (few row blocks, few column blocks: the shapes whose loops split
    into atomic partial sums otherwise) give bitwise the same output and gradients on every run."""
    for shape in ((2, 4, 1, 128, 4, 4, 64), (1, 8, 40, 64, 2, 2, 64)):
        q, k, u, v, r = (t.to(dtype) for t in random_inputs(*shape, seed=9))
        grad_out = torch.randn_like(q)
        runs = []
        for _ in range(5):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, u, v, r)]
            out = flash_mhf(*leaves, impl="triton")
            out.backward(grad_out)
            runs.append([out.detach(), *(leaf.grad for leaf in leaves)])
        for again in runs[1:]:
            for name, first, other in zip(("out", "dq", "dk", "du", "dv", "dr"), runs[0], again):
                assert torch.equal(first, other), (shape, name)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_takes_gates_in_the_queries_dtype(dtype):
    """Gates r in 16 bits (any float dtype is accepted): read as they are, dr returned in their dtype."""
    inputs = random_inputs(2, 4, 11, 64, 2, 3, 32, seed=6)
    check_against_truth(run_op("triton"), inputs, dtype, gate_dtype=dtype)


@pytest.mark.skipif(not (ON_GPU and flash_mhf_triton.TRITON_AVAILABLE), reason="autotuned launches run on CUDA only")
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (128, torch.float32), (128, torch.float16),
                                            (256, torch.bfloat16)])
def test_triton_autotuned_launches_match_float64(head_dim, dtype):
    """Problems above the autotuning threshold take the tuned launches (tensor-descriptor block shapes set per
    configuration by the autotuner's pre-hook); the small cases above take the fixed configuration. The first launch
    of each kernel goes through the autotuner, the second straight to the kernel with the configuration it picked
    (and the block shapes that the pre-hook would set): both are checked."""
    inputs = random_inputs(2, 4, 2048, head_dim, 4, 4, 128, seed=head_dim)
    assert flash_mhf_triton._autotuned(flash_mhf_triton._problem(inputs[0], inputs[1]))
    check_against_truth(run_op("triton"), inputs, dtype)
    assert any(key[0] == "forward" and key[1] == head_dim and key[4] == dtype for key in flash_mhf_triton._PICKED)
    check_against_truth(run_op("triton"), inputs, dtype)


def test_autotuned_launches_keep_their_own_pick_when_two_threads_tune_at_once():
    """Two threads launching an autotuned kernel for the first time at once (two models served side by side, or two
    size classes): each key keeps the configuration the autotuner picked for its own launch, not the other's (the
    autotuner's `best_config` is that of its latest launch). A stand-in autotuner picks a block from the launch's
    argument, then runs a while, during which the other thread may launch."""
    import threading
    import types

    inside, second_started, second_picked = threading.Event(), threading.Event(), threading.Event()

    class StandInAutotuner:
        arg_names = ["X"]

        def __getitem__(self, grid):
            def run(block, **kwargs):
                self.best_config = types.SimpleNamespace(all_kwargs=lambda: {"BLOCK": block}, pre_hook=None)
                if block == 64:
                    inside.set()
                    # the second thread's start may take long on a loaded machine, its launch from there a moment
                    # (unless a lock holds it until this one returns): a short wait from its start, not from now
                    second_started.wait(timeout=60)
                    second_picked.wait(timeout=1.0)  # (the launch of block 128 while this one runs)
                else:
                    second_picked.set()

            return run

    tuned, keys = StandInAutotuner(), [("stand-in", 64), ("stand-in", 128)]

    def first_launch(block):
        if block == 128:
            second_started.set()
        flash_mhf_triton._launch_tuned(tuned, ("stand-in", block), lambda meta: (1,), block)

    try:
        first = threading.Thread(target=first_launch, args=(64,))
        first.start()
        assert inside.wait(timeout=5)
        second = threading.Thread(target=first_launch, args=(128,))
        second.start()
        first.join()
        second.join()
        assert [flash_mhf_triton._PICKED[key][0] for key in keys] == [{"BLOCK": 64}, {"BLOCK": 128}]
    finally:
        for key in keys:
            flash_mhf_triton._PICKED.pop(key, None)


@needs_kernels
@pytest.mark.parametrize("broadcast_dims", [(2,), (1,), (0, 1, 2), (3,)],
                         ids=["over_positions", "over_heads", "over_all_but_features", "over_features"])
def test_triton_takes_an_output_gradient_of_stride_zero(broadcast_dims):
    """The gradient of a sum over positions (or heads, ...) reaches the backward expanded, stride 0 in those
    dimensions: the row kernels and the tensor descriptors of the weight kernel read it as it is (a stride of 0 is a
    multiple of 16 bytes) or through a copy, and either way compute the gradient of the expanded values."""
    inputs = random_inputs(2, 4, 37, 64, 2, 3, 32, seed=8)
    check_against_truth(run_op("triton"), inputs, torch.bfloat16, broadcast_dims=broadcast_dims)


@needs_kernels
def test_triton_reads_queries_unaligned_for_tensor_descriptors():
    """q whose first element is not 16-byte aligned (a view one element into a buffer) is copied for the bulk
    copies, not misread."""
    inputs = random_inputs(2, 2, 7, 64, 1, 2, 32, seed=5)

    def run(leaves, grad_out):
        buffer = torch.zeros(leaves[0].numel() + 1, dtype=leaves[0].dtype, device=leaves[0].device)
        view = buffer[1:].view(leaves[0].shape).copy_(leaves[0].detach()).requires_grad_(True)
        assert view.data_ptr() % 16
        view.retain_grad()  # not a leaf
        out = flash_mhf(view, *leaves[1:], impl="triton")
        out.backward(grad_out)
        leaves[0].grad = view.grad
        return out

    check_against_truth(run, inputs, torch.float32)


@needs_kernels
def test_triton_reads_strided_queries_and_writes_their_layout():
    """The FFN module passes q as a transposed view of [B, L, H, d_h]; no copy is needed and o keeps that layout."""
    inputs = random_inputs(2, 4, 5, 64, 2, 2, 32, seed=3)
    q = inputs[0].transpose(1, 2).contiguous().transpose(1, 2)

    def run(leaves, grad_out):
        view = leaves[0].detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)
        out = flash_mhf(view, *leaves[1:], impl="triton")
        assert out.stride() == view.stride()
        out.backward(grad_out)
        leaves[0].grad = view.grad
        return out

    check_against_truth(run, [q, *inputs[1:]], torch.float32)


@needs_kernels
@pytest.mark.parametrize("view", ["slice_of_a_longer_buffer", "every_other_position"])
def test_triton_takes_query_views_with_gaps(view):
    """A query view whose rows leave gaps in its storage (not dense: `empty_like` gives it a contiguous layout): the
    gradient is not written through the view's strides into a buffer of another layout."""
    inputs = random_inputs(2, 2, 9, 64, 1, 2, 32, seed=4)

    def run(leaves, grad_out):
        if view == "slice_of_a_longer_buffer":
            buffer = torch.zeros(2, 2, 16, 64, dtype=leaves[0].dtype, device=DEVICE)
            buffer[:, :, :9] = leaves[0].detach()
            gapped = buffer[:, :, :9]
        else:
            buffer = torch.zeros(2, 2, 18, 64, dtype=leaves[0].dtype, device=DEVICE)
            buffer[:, :, ::2] = leaves[0].detach()
            gapped = buffer[:, :, ::2]
        gapped.requires_grad_(True)
        out = flash_mhf(gapped, *leaves[1:], impl="triton")
        out.backward(grad_out)
        leaves[0].grad = gapped.grad
        return out

    check_against_truth(run, inputs, torch.float32)


@needs_kernels
def test_triton_opcheck():
    # Under the interpreter the (slow) aot_dispatch check is left to test_reference_opcheck: registrations are shared.
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    if ON_GPU:
        checks += ("test_aot_dispatch_dynamic",)
    q, k, u, v, r = (t.float().requires_grad_(True) for t in random_inputs(1, 2, 5, 64, 1, 2, 16))
    torch.library.opcheck(flash_mhf_op._forward_op.default, (q, k, u, v, r, "triton"), test_utils=checks)
    grad_out = torch.randn_like(q)
    backward_args = (grad_out, q.detach(), k.detach(), u.detach(), v.detach(), r.detach(), "triton")
    torch.library.opcheck(flash_mhf_op._backward_op.default, backward_args, test_utils=checks)


def test_kernels_under_interpreter_in_subprocess():
    run_under_interpreter(__file__, "triton")


# ------------------------------------------------------------------------------------------------------------
# PyTorch reference path
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64(dtype, monkeypatch):
    # small column chunks so that one sub-network spans several chunks
    monkeypatch.setattr(flash_mhf_op, "REFERENCE_CHUNK_COLUMNS", 16)
    inputs = random_inputs(2, 4, 7, 64, 2, 3, 48, seed=5)
    check_against_truth(run_op("torch"), inputs, dtype)


def test_reference_keeps_no_activations_for_backward():
    """Only the five inputs are saved for the backward pass; each chunk is recomputed there."""
    leaves = [t.float().requires_grad_(True) for t in random_inputs(2, 2, 16, 64, 2, 4, 64)]
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = flash_mhf_reference(*leaves)
    assert sum(saved) <= sum(t.numel() for t in leaves)
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


def test_reference_opcheck():
    q, k, u, v, r = (t.float().requires_grad_(True) for t in random_inputs(2, 4, 3, 64, 2, 2, 16))
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True)  # strided, as the module passes it
    torch.library.opcheck(flash_mhf_op._forward_op.default, (q, k, u, v, r, "torch"))
    grad_out = torch.randn_like(q)
    backward_args = (grad_out, q.detach(), k.detach(), u.detach(), v.detach(), r.detach(), "torch")
    torch.library.opcheck(flash_mhf_op._backward_op.default, backward_args)


def test_compile_fullgraph_forward_and_backward():
    """torch.compile traces the op without a graph break (reference path with aot_eager on CPU, Triton on CUDA)."""
    impl, backend = ("triton", "inductor") if ON_GPU else ("torch", "aot_eager")
    inputs = random_inputs(2, 4, 6, 64, 2, 2, 32, seed=7)

    def ffn_core(q, k, u, v, r):
        return flash_mhf(torch.nn.functional.rms_norm(q, (q.shape[-1],)), k, u, v, r, impl=impl).square().mean()

    compiled = torch.compile(ffn_core, backend=backend, fullgraph=True)
    eager_leaves = [t.float().requires_grad_(True) for t in inputs]
    compiled_leaves = [t.float().requires_grad_(True) for t in inputs]
    ffn_core(*eager_leaves).backward()
    loss = compiled(*compiled_leaves)
    loss.backward()
    for eager, compiled_leaf in zip(eager_leaves, compiled_leaves):
        assert relative_error(compiled_leaf.grad, eager.grad) < 1e-4


def test_reference_computes_in_float32_under_autocast_as_compiled():
    """Under autocast (Trainer(bf16=True)) the reference keeps its float32 products, in eager mode as in a compiled
    graph (which runs with autocast off): the same output, forward and backward, as without autocast."""
    q, k, u, v, r = (t.float() for t in random_inputs(2, 4, 9, 64, 2, 2, 32, seed=3))
    q, k, u, v = (t.bfloat16().requires_grad_(True) for t in (q, k, u, v))
    r = r.requires_grad_(True)
    leaves = (q, k, u, v, r)

    def run(autocast: bool, compiled: bool):
        fn = lambda *args: flash_mhf(*args, impl="torch")  # noqa: E731
        fn = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = fn(*leaves)
        grads = torch.autograd.grad(out.float().square().sum(), leaves)
        return out, grads

    expected, expected_grads = run(autocast=False, compiled=False)
    for compiled in (False, True):
        out, grads = run(autocast=True, compiled=compiled)
        assert torch.equal(out, expected), compiled
        for grad, expected_grad in zip(grads, expected_grads):
            assert torch.equal(grad, expected_grad), compiled


def test_second_copy_of_the_op_file_reuses_the_registration(tmp_path):
    """transformers imports remote code as another module (transformers_modules.*); that copy must not fail."""
    package = tmp_path / "copied_checkpoint_code"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name in ("flash_mhf_op.py", "flash_mhf_triton.py", "flash_mhf_gluon.py", "triton_launch.py"):
        shutil.copy(Path(flash_mhf_op.__file__).with_name(name), package / name)
    sys.path.insert(0, str(tmp_path))
    try:
        import copied_checkpoint_code.flash_mhf_op as copy  # noqa: PLC0415
    finally:
        sys.path.remove(str(tmp_path))
    assert copy._forward_op is flash_mhf_op._forward_op
    inputs = [t.float() for t in random_inputs(1, 2, 3, 64, 1, 1, 16)]
    torch.testing.assert_close(copy.flash_mhf(*inputs, impl="torch"), flash_mhf(*inputs, impl="torch"))


# ------------------------------------------------------------------------------------------------------------
# Choosing the path and rejecting bad input
# ------------------------------------------------------------------------------------------------------------
def test_auto_path_is_explicit():
    q = torch.zeros(1, 1, 1, 64, device=DEVICE)
    described = flash_mhf_path(q)
    assert described.startswith("triton" if ON_GPU else "torch reference")
    odd_heads = torch.zeros(1, 1, 1, 48, device=DEVICE)  # a head size the kernels do not take
    if ON_GPU:  # (auto chose the kernels, which cannot run: said as auto's choice, not as a request)
        assert flash_mhf_path(odd_heads).startswith("unavailable: auto chose triton for cuda tensors but head_dim=48")
    assert flash_mhf_path(odd_heads, impl="triton").startswith("unavailable: triton requested but")


@pytest.mark.skipif(ON_GPU or flash_mhf_triton.triton_interpreting(), reason="CPU without the interpreter only")
def test_triton_on_cpu_fails_loudly():
    inputs = [t.float() for t in random_inputs(1, 2, 3, 64, 1, 1, 16)]
    with pytest.raises(ValueError, match="cannot use the Triton kernels.*ffn_kernel='torch'"):
        flash_mhf(*inputs, impl="triton")


@pytest.mark.skipif(not ON_GPU, reason="ffn_kernel='auto' picks the Triton kernels on CUDA only")
def test_a_model_whose_head_width_the_kernels_lack_fails_loudly_under_auto():
    """`ffn_kernel='auto'` (the default) on CUDA with FFN heads of 16 (tiny_config's): the error names the setting
    the user has, 'auto', and the one that runs the model, ffn_kernel='torch'."""
    from transformers import AutoModelForCausalLM

    from hf_memffn.testing import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf")).to(DEVICE)
    ids = torch.randint(3, 320, (1, 8), device=DEVICE)
    with pytest.raises(ValueError, match=r"impl='auto'\) cannot use the Triton kernels: head_dim=16.*ffn_kernel='tor"):
        model(ids)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_kernel="torch")).to(DEVICE)
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda q, k, u, v, r: (q[0], k, u, v, r), "q must be"),
        (lambda q, k, u, v, r: (q, k, u[:, :, :8], v, r), "k, u, v must have one shape"),
        (lambda q, k, u, v, r: (q, *(torch.cat([w, w[:1]]) for w in (k, u, v)), r), "kv_heads=3 must divide"),
        (lambda q, k, u, v, r: (q, k, u, v, r[..., :1]), "r must be"),
        (lambda q, k, u, v, r: (q[..., :32], k, u, v, r), "head_dim"),
    ],
)
def test_bad_shapes_raise_value_error(change, match):
    inputs = [t.float() for t in random_inputs(1, 4, 3, 64, 2, 2, 16)]
    with pytest.raises(ValueError, match=match):
        flash_mhf(*change(*inputs))


def test_bad_impl_raises_value_error():
    q, k, u, v, r = (t.float() for t in random_inputs(1, 2, 3, 64, 1, 1, 16))
    with pytest.raises(ValueError, match="impl='cuda' is not supported"):
        flash_mhf(q, k, u, v, r, impl="cuda")


@needs_kernels  # (on a CPU in the interpreter subprocess test, whose selection takes the tests named triton)
def test_triton_rejects_shapes_the_kernels_lack():
    q, k, u, v, r = (t.float() for t in random_inputs(1, 2, 3, 64, 1, 1, 16))
    odd = [w[:, :, :12] for w in (k, u, v)]
    with pytest.raises(ValueError, match="subnetwork_size=12 must be a multiple of 16"):
        flash_mhf(q, *odd, r, impl="triton")
    with pytest.raises(ValueError, match="head_dim=32 is not supported"):
        flash_mhf(q[..., :32], *(w[..., :32] for w in (k, u, v)), r, impl="triton")


@needs_kernels
@pytest.mark.parametrize("empty", ["no_subnetworks", "subnetworks_of_no_units"])
def test_triton_rejects_empty_subnetwork_weights_by_name(empty):
    """Weights with no sub-network, or sub-networks of no units, leave the kernels' column loops and tensor
    descriptors nothing to read: the Triton path refuses them by name (it had failed inside Triton with an assertion
    or a division by zero), and the reference, which computes any size, returns zeros."""
    q, k, u, v, r = (t.float() for t in random_inputs(1, 2, 3, 64, 1, 2, 16))
    if empty == "no_subnetworks":
        k, u, v, r = k[:, :0], u[:, :0], v[:, :0], r[..., :0]
    else:
        k, u, v = (w[:, :, :0] for w in (k, u, v))
    with pytest.raises(ValueError, match=r"num_subnetworks=\d+, subnetwork_size=\d+: the kernels need at least one"):
        flash_mhf(q, k, u, v, r, impl="triton")
    assert flash_mhf_path(q, k, impl="triton").startswith("unavailable: triton requested but num_subnetworks=")
    assert torch.equal(flash_mhf(q, k, u, v, r, impl="torch"), torch.zeros_like(q))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs CUDA")
def test_triton_matches_reference_at_paper_width():
    """One batch of the paper's shape (E=15, d_e=384, d_h=128) against the reference path, bf16."""
    inputs = random_inputs(1, 4, 300, 128, 4, 15, 384, seed=11)
    check_against_truth(run_op("triton"), inputs, torch.bfloat16)
