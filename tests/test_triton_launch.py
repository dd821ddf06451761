"""`hf_memffn.triton_launch`: which launches go through Triton and which launch the kept compiled kernel, with a
stand-in kernel on any machine; on a CUDA machine, our kernels give the same outputs either way (bitwise), also for
inputs whose addresses Triton specialises differently."""

from __future__ import annotations

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


def test_the_grid_arithmetic_agrees_with_tritons():
    triton = pytest.importorskip("triton")
    for n in range(0, 600):
        assert triton_launch.next_power_of_2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 32, 128):
            assert triton_launch.cdiv(n, d) == triton.cdiv(n, d)


# ----------------------------------------------------------------------------------------------------------------
# On the GPU: our kernels, through the kept compiled kernel and through Triton's launch
# ----------------------------------------------------------------------------------------------------------------
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
        triton_launch.CACHED = False
        try:
            plain = call()
        finally:
            triton_launch.CACHED = True
    # (every program writes its own outputs; the decode kernel's column splits are added in a fixed order)
    assert torch.equal(second, first) and torch.equal(plain, first)


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
