"""`hf_memffn.triton_launch`: which launches go through Triton and which launch the kept compiled kernel, with a
stand-in kernel on any machine; on a CUDA machine, our kernels give the same outputs either way (bitwise), also for
inputs whose addresses Triton specialises differently."""

from __future__ import annotations

import dataclasses
import threading
import time
import types

import pytest
import torch

from hf_memffn import triton_launch

ON_GPU = torch.cuda.is_available()


class StandInKernel:
    """A `triton.jit` function's surface that `launch` uses: `arg_names`, `__name__` and `kernel[grid](...)`, which
    records the call and returns a compiled kernel whose `[grid](...)` records the direct launches."""

    __name__ = "stand_in_kernel"
    arg_names = ["X", "Y", "n", "eps", "BLOCK"]

    def __init__(self):
        self.through_triton, self.direct = [], []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.through_triton.append((grid, args, kwargs))
            return StandInCompiled(self)

        return run


class StandInCompiled:
    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        return lambda *args: self.kernel.direct.append((grid, args))


@pytest.fixture
def stand_in(monkeypatch):
    """A fresh stand-in kernel, launches not interpreted, device 0 current, the kept kernels forgotten after."""
    monkeypatch.setattr(triton_launch, "INTERPRET_REQUESTED", False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    triton_launch.clear()
    yield StandInKernel()
    triton_launch.clear()


def test_the_second_launch_of_a_signature_runs_the_kept_kernel_with_every_argument_in_order(stand_in):
    x, y = torch.zeros(8), torch.zeros(8)
    triton_launch.launch(stand_in, (4,), x, y, 8, 1e-6, BLOCK=128, num_warps=4)
    assert len(stand_in.through_triton) == 1 and not stand_in.direct
    triton_launch.launch(stand_in, (4,), x, y, 8, 1e-6, BLOCK=128, num_warps=4)
    triton_launch.launch(stand_in, (2, 3), torch.ones(8), y, 8, 1e-6, BLOCK=128, num_warps=4)  # other data, grid
    assert len(stand_in.through_triton) == 1
    (grid, args), (grid2, _) = stand_in.direct
    assert grid == (4, 1, 1) and grid2 == (2, 3, 1)  # (the compiled kernel's launcher takes three grid sizes)
    assert args == (x, y, 8, 1e-6, 128)  # the keyword parameters in the kernel's order, launch options left out


@pytest.mark.parametrize("change", ["integer", "alignment", "dtype", "constexpr", "option", "float", "none"])
def test_a_launch_that_triton_could_specialise_differently_goes_through_triton(stand_in, change):
    """Every argument property Triton specialises on (and more: every integer's value) is in the signature."""
    data = torch.zeros(16, dtype=torch.float16)
    base = dict(args=(data[:8], data[:8], 8, 1e-6), BLOCK=128, num_warps=4)
    changed = {
        "integer": dict(base, args=(data[:8], data[:8], 1, 1e-6)),
        "alignment": dict(base, args=(data[1:9], data[:8], 8, 1e-6)),  # 2 bytes past a 16-byte boundary
        "dtype": dict(base, args=(data[:8].float(), data[:8], 8, 1e-6)),
        "constexpr": dict(base, BLOCK=256),
        "option": dict(base, num_warps=8),
        "float": dict(base, args=(data[:8], data[:8], 8, 1e-5)),
        "none": dict(base, args=(data[:8], None, 8, 1e-6)),
    }[change]
    for call in (base, changed, changed):
        triton_launch.launch(stand_in, (1,), *call["args"], BLOCK=call["BLOCK"], num_warps=call["num_warps"])
    assert len(stand_in.through_triton) == 2 and len(stand_in.direct) == 1


def test_switched_off_or_interpreted_every_launch_goes_through_triton(stand_in, monkeypatch):
    x = torch.zeros(8)
    monkeypatch.setattr(triton_launch, "CACHED", False)
    for _ in range(3):
        triton_launch.launch(stand_in, (1,), x, x, 8, 1e-6, BLOCK=128)
    monkeypatch.setattr(triton_launch, "CACHED", True)
    monkeypatch.setattr(triton_launch, "INTERPRET_REQUESTED", True)
    for _ in range(2):
        triton_launch.launch(stand_in, (1,), x, x, 8, 1e-6, BLOCK=128)
    assert len(stand_in.through_triton) == 5 and not stand_in.direct


def test_interpreted_launches_from_several_threads_run_one_at_a_time(monkeypatch):
    """Triton's interpreter keeps the running kernel's grid in process-wide state: forwards of one model from several
    threads under TRITON_INTERPRET=1 failed in it ("y >= grid_dim[1]") until its launches were serialised."""
    monkeypatch.setattr(triton_launch, "INTERPRET_REQUESTED", True)
    running, most_at_once, lock = [0], [0], threading.Lock()

    class SlowKernel(StandInKernel):
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                with lock:
                    running[0] += 1
                    most_at_once[0] = max(most_at_once[0], running[0])
                time.sleep(0.2)  # (long enough for the other thread to enter, were launches not serialised)
                with lock:
                    running[0] -= 1

            return run

    kernel, start = SlowKernel(), threading.Barrier(3)
    x = torch.zeros(8)

    def launch_once():
        start.wait()
        triton_launch.launch(kernel, (1,), x, x, 8, 1e-6, BLOCK=128)

    threads = [threading.Thread(target=launch_once) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most_at_once[0] == 1


def test_a_launch_runs_on_the_device_of_its_tensors(stand_in, monkeypatch):
    """A model split over GPUs calls a layer on cuda:1 while cuda:0 is current: the launch, through Triton and
    direct, runs with the tensors' device current, and the current device is put back after."""
    current = [0]
    seen = []

    class Guard:  # torch.cuda.device's surface: makes `index` current inside the block
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            self.previous, current[0] = current[0], self.index

        def __exit__(self, *exc):
            current[0] = self.previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", Guard)
    monkeypatch.setattr(triton_launch, "_device_index", lambda args: 1)
    run_through_triton = StandInKernel.__getitem__
    monkeypatch.setattr(StandInKernel, "__getitem__",
                        lambda self, grid: seen.append(current[0]) or run_through_triton(self, grid))
    monkeypatch.setattr(StandInCompiled, "__getitem__",
                        lambda self, grid: seen.append(current[0]) or (lambda *args: self.kernel.direct.append(args)))
    x = torch.zeros(8)
    for _ in range(2):
        triton_launch.launch(stand_in, (1,), x, x, 8, 1e-6, BLOCK=128)
    assert len(stand_in.through_triton) == 1 and len(stand_in.direct) == 1
    assert seen == [1, 1] and current == [0]
    assert all(key[1] == 1 for key in triton_launch._compiled)  # kept per device


def test_the_device_of_a_launch_is_its_first_tensor_or_descriptor_base():
    x = torch.zeros(8)
    assert triton_launch._device_index((3, None, x)) == -1  # a host tensor (Triton refuses it itself)
    assert triton_launch._device_index((2, StandInDescriptor(x, [8], [1], [8]))) == -1
    with pytest.raises(TypeError, match="no tensor among the arguments"):
        triton_launch._device_index((1, 2.0))


def test_a_parameter_left_to_its_default_is_refused(stand_in):
    with pytest.raises(TypeError, match=r"parameters \['BLOCK'\] must be given"):
        triton_launch.launch(stand_in, (1,), torch.zeros(8), torch.zeros(8), 8, 1e-6)
    assert not stand_in.through_triton


def test_the_kept_kernels_are_bounded(stand_in, monkeypatch):
    monkeypatch.setattr(triton_launch, "MAX_SIGNATURES", 3)
    x = torch.zeros(8)
    for n in range(5):
        triton_launch.launch(stand_in, (1,), x, x, n + 2, 1e-6, BLOCK=128)
    assert len(triton_launch._compiled) <= 3


@dataclasses.dataclass
class StandInDescriptor:
    """A tensor descriptor's surface (Gluon's and Triton's host descriptors are dataclasses like this)."""

    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: str = "swizzled"
    padding: str = "zero"


@pytest.mark.parametrize("change", ["shape", "strides", "block_shape", "layout", "padding", "dtype", "alignment"])
def test_a_descriptor_is_in_the_signature_with_every_field_but_its_base(stand_in, change):
    """A descriptor of other data with the same fields launches the kept kernel; any other field (or the base's dtype
    or alignment) goes through Triton."""
    data = torch.zeros(64 * 64 + 8, dtype=torch.float16)

    def descriptor(base=None, **fields):
        base = data[:64 * 64].view(64, 64) if base is None else base
        return StandInDescriptor(base, **{**dict(shape=[64, 64], strides=[64, 1], block_shape=[16, 64]), **fields})

    changed = {
        "shape": descriptor(shape=[32, 64]), "strides": descriptor(strides=[128, 1]),
        "block_shape": descriptor(block_shape=[32, 64]), "layout": descriptor(layout="other"),
        "padding": descriptor(padding="nan"), "dtype": descriptor(base=data[:64 * 64].float().view(64, 64)),
        "alignment": descriptor(base=data[1:64 * 64 + 1].view(64, 64)),
    }[change]
    for desc in (descriptor(), descriptor(base=torch.ones(64, 64, dtype=torch.float16)), changed, changed):
        triton_launch.launch(stand_in, (1,), desc, desc, 8, 1e-6, BLOCK=128)
    assert len(stand_in.through_triton) == 2 and len(stand_in.direct) == 2


def test_a_descriptor_that_names_its_launch_key_is_keyed_by_it(stand_in):
    """`flash_mhf_gluon.tensor_descriptor`'s descriptors carry the key they were checked under (their fields'
    source), which the signature takes instead of reading every field."""
    base = torch.zeros(64, 64)
    desc = StandInDescriptor(base, [64, 64], [64, 1], [16, 64])
    desc.launch_key = ("a",)
    assert triton_launch._argument_key(desc) == ("a",)
    other = StandInDescriptor(base, [64, 64], [64, 1], [16, 64])
    other.launch_key = ("b",)
    for d in (desc, desc, other):
        triton_launch.launch(stand_in, (1,), d, d, 8, 1e-6, BLOCK=128)
    assert len(stand_in.through_triton) == 2 and len(stand_in.direct) == 1


def test_an_unspecialised_integer_is_keyed_by_its_type_only(stand_in):
    """The integers of a build that leaves them unspecialised (`any_size`) change nothing Triton compiles but their
    type: another value launches the kept kernel, a value past 32 bits goes through Triton (a 64-bit parameter)."""
    stand_in.params = [types.SimpleNamespace(num=index, do_not_specialize=name == "n")
                       for index, name in enumerate(stand_in.arg_names)]
    x = torch.zeros(8)
    for n in (8, 1, 17, 2**31, 2**32):
        triton_launch.launch(stand_in, (1,), x, x, n, 1e-6, BLOCK=128)
    assert len(stand_in.through_triton) == 2 and len(stand_in.direct) == 3
    assert [triton_launch._integer_type(n) for n in (0, -2**31, 2**31 - 1, 2**31, -2**31 - 1, 2**63)] == [
        "i32", "i32", "i32", "i64", "i64", "u64"]


def test_the_integer_types_are_tritons():
    """`_integer_type` is how Triton types an integer it does not specialise (its launch would compile another
    kernel for another type)."""
    jit = pytest.importorskip("triton.runtime.jit")
    from triton.backends.compiler import BaseBackend

    specialize = getattr(jit, "native_specialize_impl", None)
    if specialize is None:
        pytest.skip("this Triton has no native_specialize_impl")
    for value in (0, 1, 16, 17, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64 - 1):
        assert specialize(BaseBackend, value, False, False, True)[0] == triton_launch._integer_type(value), value


def test_the_grid_arithmetic_agrees_with_tritons():
    triton = pytest.importorskip("triton")
    for n in range(0, 600):
        assert triton_launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 32, 128):
            assert triton_launch.cdiv(n, d) == triton.cdiv(n, d)


# ----------------------------------------------------------------------------------------------------------------
# On the GPU: our kernels, through the kept compiled kernel and through Triton's launch
# ----------------------------------------------------------------------------------------------------------------
def through_triton(call):
    """``call()`` with every launch through Triton's own launch (`CACHED` off)."""
    triton_launch.CACHED = False
    try:
        return call()
    finally:
        triton_launch.CACHED = True


def _gpu_calls() -> dict:
    from hf_memffn.decoder_triton import rms_norm, rotate
    from hf_memffn.ffn_triton import paired_forward
    from hf_memffn.flash_mhf_op import flash_mhf_layer

    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    # one element past the start of a buffer: an address that is not a multiple of 16 bytes
    unaligned_rows, row_weight = randn(3 * 96 + 1)[1:].view(3, 96), randn(96) + 1
    queries, angles = randn(2, 3, 4, 64), randn(1, 3, 64)
    pairs = randn(2, 1, 2 * 64)
    p, norm_weight, router = randn(2, 1, 4 * 64), randn(64) + 1, randn(4, 64, 3)
    weights = randn(3 * 2, 3, 32, 64) * 0.1
    return {
        "rms_norm, unaligned rows": lambda: rms_norm(unaligned_rows, row_weight, 1e-6),
        "rotary": lambda: rotate(queries, angles.cos(), angles.sin()),
        "KV-FFN activation": lambda: paired_forward(pairs, "silu", True),
        "FlashMHF decode kernel": lambda: flash_mhf_layer(p, norm_weight, router, weights, eps=1e-6, gate_eps=1e-6),
    }


@pytest.mark.skipif(not ON_GPU, reason="launches real kernels on CUDA")
@pytest.mark.parametrize("name", ["rms_norm, unaligned rows", "rotary", "KV-FFN activation", "FlashMHF decode kernel"])
def test_our_kernels_give_the_same_outputs_through_the_kept_kernel(name):
    torch.manual_seed(0)
    triton_launch.clear()
    with torch.no_grad():
        call = _gpu_calls()[name]
        first = call()  # through Triton, which compiles
        kept = len(triton_launch._compiled)
        assert kept >= 1
        second = call()  # the kept kernel
        assert len(triton_launch._compiled) == kept  # no new signature: the direct launch ran
        plain = through_triton(call)
    # (every program writes its own outputs; the decode kernel's column splits are added in a fixed order)
    assert torch.equal(second, first) and torch.equal(plain, first)


ON_HOPPER = ON_GPU and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not ON_HOPPER, reason="launches the Gluon kernels on a Hopper GPU")
def test_the_gluon_kernels_give_the_same_outputs_through_the_kept_kernel():
    """The Gluon forward, dq/dr and dK/dU/dV kernels, at a shape whose forward row blocks and weight tiles are all
    split (so the two splits' sums run too), through Triton, through the kept kernels and with `CACHED` off: equal
    to the bit."""
    from hf_memffn import flash_mhf_gluon

    if not flash_mhf_gluon.GLUON_AVAILABLE:
        pytest.skip(f"no Gluon API: {flash_mhf_gluon.GLUON_IMPORT_ERROR}")
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, grad_out = (torch.randn(2, 4, 300, 128, device="cuda", generator=generator).bfloat16() for _ in range(2))
    k, u, v = (torch.randn(2, 3, 192, 128, device="cuda", generator=generator).bfloat16() * 0.1 for _ in range(3))
    r = torch.rand(2, 4, 300, 3, device="cuda", generator=generator)

    def call():
        return [*flash_mhf_gluon.gluon_forward(q, k, u, v, r)[:1], *flash_mhf_gluon.gluon_rows_gradients(
            grad_out, q, k, u, v, r)[:2], *flash_mhf_gluon.gluon_weight_gradients(grad_out, q, k, u, v, r)[:3]]

    triton_launch.clear()
    first = call()
    kept = len(triton_launch._compiled)
    assert kept >= 5  # the three kernels and the two splits' sums
    second = call()
    assert len(triton_launch._compiled) == kept
    plain = through_triton(call)
    for a, b, c in zip(first, second, plain):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.skipif(not ON_GPU, reason="launches real kernels on CUDA")
def test_the_layers_triton_kernels_give_the_same_outputs_through_the_kept_kernel():
    """The FlashMHF layer's Triton kernels (where the Gluon ones do not apply): inference's forward with its fixed
    configuration (200 tokens) and its autotuned one (8192 tokens), and a training step of 2 x 496 tokens (the Triton
    dq/dr and dK/dU/dV kernels), through Triton, through the kept kernels and with `CACHED` off. Where a problem has
    fewer programs than the GPU has multiprocessors these kernels split their loops and add float32 shares
    atomically, so the outputs agree to rounding rather than to the bit."""
    from hf_memffn import flash_mhf_op

    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).bfloat16()

    norm, router, weights = 1 + randn(128, scale=0.1), randn(2, 128, 2, scale=0.1), randn(6, 2, 128, 128, scale=0.1)
    settings = (norm, router, weights, 128, 1e-6, 1e-6)

    def step(p):
        saved = flash_mhf_op._layer_forward_keeping_queries(p, *settings)
        gradients = flash_mhf_op._layer_backward_impl(p, p, *settings, saved=saved[1:])
        return [saved[0], *(g for g in gradients if g is not None)]

    calls = {"forward, 200 tokens": lambda p=randn(1, 200, 256): [flash_mhf_op._layer_forward_impl(p, *settings)],
             "forward, 8192 tokens": lambda p=randn(1, 8192, 256): [flash_mhf_op._layer_forward_impl(p, *settings)],
             "training step, 2 x 496 tokens": lambda p=randn(2, 496, 256): step(p)}
    with torch.no_grad():
        for name, call in calls.items():
            call()  # (the autotuned forward's first call is the autotuner's, which keeps nothing)
            triton_launch.clear()
            first = call()
            kept = len(triton_launch._compiled)
            second = call()
            assert len(triton_launch._compiled) == kept, name
            plain = through_triton(call)
            for a, b, c in zip(first, second, plain):
                assert torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-3), name
                assert torch.allclose(a.float(), c.float(), rtol=1e-2, atol=1e-3), name


def test_any_size_builds_the_same_function_with_only_the_named_sizes_unspecialised():
    """`any_size`: inference's build of a kernel leaves exactly the named arguments unspecialised, keeps the function,
    and refuses a name that is not a parameter (Triton would ignore it and specialise the argument after all)."""
    triton = pytest.importorskip("triton")
    from hf_memffn import decoder_triton

    kernel = decoder_triton._rms_norm_forward_kernel
    build = triton_launch.any_size(kernel, "num_rows")
    assert build.fn is kernel.fn and type(build) is type(kernel)
    if isinstance(kernel, triton.runtime.jit.JITFunction):  # not under the interpreter
        assert [p.name for p in build.params if p.do_not_specialize] == ["num_rows"]
        assert not any(p.do_not_specialize for p in kernel.params)
    with pytest.raises(ValueError, match="num_row"):
        triton_launch.any_size(kernel, "num_row")
