"""The Gluon kernels (Hopper only): the output, dK, dU, dV and dq, dr against the float64 ground truth on the GPU, and
a compile for sm_90 on any machine (Gluon has no interpreter, so that is what CPU CI can check)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from hf_memffn import flash_mhf_gluon, flash_mhf_triton
from hf_memffn.flash_mhf_op import flash_mhf, flash_mhf_dense, flash_mhf_path

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
needs_hopper = pytest.mark.skipif(not (ON_HOPPER and flash_mhf_gluon.GLUON_AVAILABLE),
                                  reason="the Gluon kernel runs on Hopper GPUs only")
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
SHAPE_FIELDS = "batch,heads,seq_len,kv_heads,num_subnetworks,subnetwork_size,dtype"
SHAPES = [
    pytest.param(2, 2, 200, 2, 3, 64, torch.bfloat16, id="ragged_L-bf16"),
    pytest.param(1, 4, 129, 2, 2, 128, torch.float16, id="two_heads_per_group-L129-fp16"),
    pytest.param(3, 1, 1, 1, 1, 64, torch.bfloat16, id="L1-E1"),
    pytest.param(1, 2, 384, 1, 2, 384, torch.bfloat16, id="de384-one_group"),
]

# every kernel's test but the strided one also runs five sub-networks of 192 units
SHAPES_WITH_E5 = SHAPES + [pytest.param(2, 3, 70, 3, 5, 192, torch.float16, id="E5-de192-fp16")]


def relative_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def gradient_truth(q, k, u, v, r, grad_out):
    """(dq, dk, du, dv, dr) in float64."""
    leaves = [t.double().requires_grad_(True) for t in (q, k, u, v, r)]
    flash_mhf_dense(*leaves).backward(grad_out.double())
    return [leaf.grad for leaf in leaves]


def weight_gradient_truth(q, k, u, v, r, grad_out):
    return gradient_truth(q, k, u, v, r, grad_out)[1:4]


def gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_len, 128, generator=generator)
    k, u, v = (torch.randn(kv_heads, num_subnetworks, subnetwork_size, 128, generator=generator) * 128**-0.5
               for _ in range(3))
    r = torch.rand(batch, heads, seq_len, num_subnetworks, generator=generator)
    r = r / r.sum(-1, keepdim=True)
    grad_out = torch.randn(batch, heads, seq_len, 128, generator=generator)
    q, k, u, v, grad_out = (t.to("cuda", dtype) for t in (q, k, u, v, grad_out))
    return q, k, u, v, r.cuda(), grad_out


@needs_hopper
@pytest.mark.parametrize(SHAPE_FIELDS, SHAPES_WITH_E5)
def test_gluon_weight_gradients_match_float64(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size,
                                              dtype):
    q, k, u, v, r, grad_out = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype,
                                           seed=seq_len)
    grads = flash_mhf_gluon.gluon_weight_gradients(grad_out, q, k, u, v, r)[:3]
    expected = weight_gradient_truth(q, k, u, v, r, grad_out)
    errors = {name: relative_error(g, e) for name, g, e in zip(("dk", "du", "dv"), grads, expected)}
    assert all(g.dtype == dtype for g in grads)
    assert all(err < TOLERANCE[dtype] for err in errors.values()), errors


@needs_hopper
@pytest.mark.parametrize(
    SHAPE_FIELDS, SHAPES_WITH_E5)
def test_gluon_forward_matches_float64(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype):
    q, k, u, v, r, _ = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype,
                                    seed=seq_len + 2)
    out, _ = flash_mhf_gluon.gluon_forward(q, k, u, v, r)
    expected = flash_mhf_dense(*(t.double() for t in (q, k, u, v, r)))
    assert out.dtype == dtype and out.shape == q.shape
    assert relative_error(out, expected) < TOLERANCE[dtype]


def test_forward_splits_fill_the_last_round_of_programs():
    """(split_from, splits) for (row blocks, multiprocessors, column blocks): the presets' 688 row blocks on 132
    multiprocessors leave 28 for a sixth round, which becomes 112 programs of a quarter of the columns; whole rounds,
    and last rounds more than half full, are not split; each range keeps at least FORWARD_MIN_SPLIT_BLOCKS blocks."""
    assert flash_mhf_gluon.forward_splits(688, 132, 90) == (660, 4)
    assert flash_mhf_gluon.forward_splits(688, 132, 42) == (660, 4)
    assert flash_mhf_gluon.forward_splits(264, 132, 90) == (264, 1)
    assert flash_mhf_gluon.forward_splits(200, 132, 90) == (200, 1)
    assert flash_mhf_gluon.forward_splits(2, 132, 12) == (0, 12 // flash_mhf_gluon.FORWARD_MIN_SPLIT_BLOCKS)
    assert flash_mhf_gluon.forward_splits(2, 132, 7) == (2, 1)


def test_weight_splits_fill_the_last_round_of_programs():
    """(split_from, splits) for (tiles, multiprocessors, row blocks per tile): the 370M preset's 336 tiles on 132
    multiprocessors leave 72 for a third round, which becomes 216 programs of a third of the rows; whole rounds, and
    last rounds whose split would save less than a tenth (the 1.3B preset's and the paper's 1440 tiles: 120 in the
    last round), are not split. The ranges cover a tile's row blocks, start at multiples of 4 and keep 4 or more."""
    assert flash_mhf_gluon.weight_splits(336, 132, 128) == (264, 3)
    assert flash_mhf_gluon.weight_splits(1440, 132, 64) == (1440, 1)
    assert flash_mhf_gluon.weight_splits(1440, 132, 252) == (1440, 1)
    assert flash_mhf_gluon.weight_splits(264, 132, 128) == (264, 1)
    assert flash_mhf_gluon.weight_splits(6, 132, 16) == (0, 4)
    assert flash_mhf_gluon.weight_splits(6, 132, 7) == (6, 1)
    assert flash_mhf_gluon.weight_splits(336, 132, 128, splits=5) == (264, 5)
    assert flash_mhf_gluon.weight_splits(264, 132, 128, splits=5) == (264, 1)
    with pytest.raises(ValueError, match="splits=17: expected 1 to 16"):
        flash_mhf_gluon.weight_splits(336, 132, 128, splits=17)
    # every backward asks: counted once per shape (the count is tens of microseconds of Python)
    hits = flash_mhf_gluon.weight_splits.cache_info().hits
    assert flash_mhf_gluon.weight_splits(336, 132, 128) == (264, 3)
    assert flash_mhf_gluon.weight_splits.cache_info().hits == hits + 1
    for tiles, row_blocks in ((336, 128), (140, 8), (6, 1000), (500, 41), (7, 13)):
        split_from, splits = flash_mhf_gluon.weight_splits(tiles, 132, row_blocks)
        assert splits == 1 or (split_from == tiles - tiles % 132 and splits <= flash_mhf_gluon.WEIGHT_MAX_SPLITS)
        ranges = flash_mhf_gluon.weight_row_ranges(splits, row_blocks)
        assert ranges[0][0] == 0 and ranges[-1][1] == row_blocks and len(ranges) == splits
        assert all(first % 4 == 0 and end - first >= 4 for first, end in ranges) or splits == 1
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


# (batch, heads, seq_len, kv_heads, subnetworks, subnetwork_size): tiles of the weight kernel split into row ranges,
# all of them (fewer than the SMs; ragged sequences and grouped heads) and those of a last round (1 x 1024 rows of a
# head with 140 column blocks on 132 SMs, 8 split)
WEIGHT_SPLIT_SHAPES = [
    pytest.param(2, 2, 1000, 2, 3, 64, id="all_split"),
    pytest.param(2, 4, 300, 2, 3, 192, id="all_split-ragged-grouped"),
    pytest.param(1, 1, 1024, 1, 5, 1792, id="last_round_split"),
]


@needs_hopper
@pytest.mark.parametrize("batch,heads,seq_len,kv_heads,num_subnetworks,subnetwork_size", WEIGHT_SPLIT_SHAPES)
def test_gluon_weight_gradients_split_tiles_match_float64(batch, heads, seq_len, kv_heads, num_subnetworks,
                                                          subnetwork_size):
    q, k, u, v, r, grad_out = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size,
                                           torch.bfloat16, seed=seq_len + 7)
    tiles = num_subnetworks * subnetwork_size // 64 * kv_heads
    row_blocks = batch * (heads // kv_heads) * -(-seq_len // flash_mhf_gluon.BLOCK_L)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split_from, splits = flash_mhf_gluon.weight_splits(tiles, sms, row_blocks)
    assert split_from < tiles and splits > 1
    names = ("dk", "du", "dv")
    assert_split_matches_whole(
        lambda split: dict(zip(names, flash_mhf_gluon.gluon_weight_gradients(grad_out, q, k, u, v, r, split=split))),
        dict(zip(names, weight_gradient_truth(q, k, u, v, r, grad_out))))


def assert_split_matches_whole(launch, expected: dict):
    """The outputs {name: tensor} of ``launch(split)`` with split programs and without, against float64: both within
    tolerance, close to each other (the same products; the shares' float32 sums round differently), and the split
    ones equal to the bit from one call to the next (the shares are added in a fixed order)."""
    split, whole, again = launch(True), launch(False), launch(True)
    for name, truth in expected.items():
        assert relative_error(split[name], truth) < TOLERANCE[torch.bfloat16], name
        assert relative_error(whole[name], truth) < TOLERANCE[torch.bfloat16], name
        assert relative_error(split[name], whole[name]) < 1e-2, name
        assert torch.equal(split[name], again[name]), name


# (batch, heads, seq_len, kv_heads, subnetworks, subnetwork_size): every row block split (fewer than the SMs, a ragged
# last block, grouped heads), and more row blocks than SMs (1 x 26880 rows: 140 blocks of 192 on 132 SMs, 8 split)
SPLIT_SHAPES = [
    pytest.param(2, 4, 300, 2, 3, 192, id="all_split-ragged-grouped"),
    pytest.param(1, 1, 26880, 1, 4, 128, id="last_round_split"),
]


@needs_hopper
@pytest.mark.parametrize("batch,heads,seq_len,kv_heads,num_subnetworks,subnetwork_size", SPLIT_SHAPES)
def test_gluon_forward_split_row_blocks_match_float64(batch, heads, seq_len, kv_heads, num_subnetworks,
                                                      subnetwork_size):
    q, k, u, v, r, _ = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, torch.bfloat16,
                                    seed=seq_len + 5)
    rows = batch * (heads // kv_heads) * seq_len
    tiles = -(-rows // flash_mhf_gluon.FORWARD_BLOCK_L) * kv_heads
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    split_from, splits = flash_mhf_gluon.forward_splits(tiles, sms, num_subnetworks * subnetwork_size // 64)
    assert split_from < tiles and splits > 1
    assert_split_matches_whole(lambda split: {"out": flash_mhf_gluon.gluon_forward(q, k, u, v, r, split=split)[0]},
                               {"out": flash_mhf_dense(*(t.double() for t in (q, k, u, v, r)))})


@needs_hopper
@pytest.mark.parametrize(
    SHAPE_FIELDS, SHAPES_WITH_E5)
def test_gluon_row_gradients_match_float64(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype):
    q, k, u, v, r, grad_out = gluon_inputs(batch, heads, seq_len, kv_heads, num_subnetworks, subnetwork_size, dtype,
                                           seed=seq_len + 1)
    grad_q, grad_r, _ = flash_mhf_gluon.gluon_rows_gradients(grad_out, q, k, u, v, r)
    truth = gradient_truth(q, k, u, v, r, grad_out)
    errors = {"dq": relative_error(grad_q, truth[0]), "dr": relative_error(grad_r, truth[4])}
    assert grad_q.dtype == dtype and grad_r.dtype == r.dtype
    assert all(err < TOLERANCE[dtype] for err in errors.values()), errors


@needs_hopper
def test_gluon_kernel_reads_strided_queries():
    """q as the module makes it (a transposed view of [B, L, H, d_h]) and an unaligned grad_out copy."""
    q, k, u, v, r, grad_out = gluon_inputs(2, 2, 100, 2, 2, 64, torch.bfloat16, seed=3)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    grads = flash_mhf_gluon.gluon_weight_gradients(grad_out, q_strided, k, u, v, r)[:3]
    grad_q, grad_r, _ = flash_mhf_gluon.gluon_rows_gradients(grad_out, q_strided, k, u, v, r)
    out, _ = flash_mhf_gluon.gluon_forward(q_strided, k, u, v, r)
    assert out.stride() == q_strided.stride()
    assert relative_error(out, flash_mhf_dense(*(t.double() for t in (q, k, u, v, r)))) < 3e-2
    truth = gradient_truth(q, k, u, v, r, grad_out)
    assert all(relative_error(g, e) < 3e-2 for g, e in zip(grads, truth[1:4]))
    assert grad_q.stride() == q_strided.stride()
    assert relative_error(grad_q, truth[0]) < 3e-2 and relative_error(grad_r, truth[4]) < 3e-2


@needs_hopper
def test_op_uses_the_gluon_kernel_where_it_applies_and_says_so():
    generator = torch.Generator().manual_seed(0)
    # 8 weight groups x 32 row blocks of 128 and x 24 column blocks of 64: more programs than SMs, and enough rows
    # to autotune
    q = torch.randn(1, 8, 4096, 128, generator=generator).cuda().bfloat16()
    k = (torch.randn(8, 4, 384, 128, generator=generator) * 128**-0.5).cuda().bfloat16()
    assert "the output, dq/dr and dK/dU/dV by the Gluon" in flash_mhf_path(q, k)
    for choose in (flash_mhf_triton.forward_kernel, flash_mhf_triton.row_gradient_kernel,
                   flash_mhf_triton.weight_gradient_kernel):
        assert choose(q, k) == "gluon"
        assert choose(q.float(), k.float()) == "triton"
        assert choose(q[:, :, :16], k) == "triton"  # too small to autotune
    # 8 x 16 row blocks: fewer programs than SMs, so the Triton forward splits its column loop instead
    assert flash_mhf_triton.forward_kernel(q[:, :, :2048], k) == "triton"
    assert flash_mhf_triton.row_gradient_kernel(q[:, :, :2048], k) == "gluon"
    with flash_mhf_triton.gluon_kernels("rows", "weights"):  # (what benchmarks time the Triton forward with)
        assert flash_mhf_triton.forward_kernel(q, k) == "triton"
        assert "; dq/dr and dK/dU/dV by the Gluon" in flash_mhf_path(q, k)
    assert flash_mhf_triton.forward_kernel(q, k) == "gluon"
    leaves = [t.clone().requires_grad_(True) for t in (q, k, k * 0.5, k * 0.25)]
    r = torch.rand(1, 8, 4096, 4, device="cuda").requires_grad_(True)
    # the op builds the weights' tensor descriptors once for both kernels; each kernel alone builds its own
    outputs = [flash_mhf(*leaves, r) for _ in range(2)]  # the second forward skips the autotuner (its pick is kept)
    assert torch.equal(outputs[0], outputs[1])
    grad = torch.randn_like(outputs[0])
    outputs[0].backward(grad)
    assert all(torch.isfinite(t.grad).all() for t in leaves)
    detached = [t.detach() for t in (*leaves, r)]
    assert torch.equal(outputs[0], flash_mhf_gluon.gluon_forward(*detached)[0])
    grad_q, grad_r, _ = flash_mhf_gluon.gluon_rows_gradients(grad, *detached)
    grad_k, grad_u, grad_v, _ = flash_mhf_gluon.gluon_weight_gradients(grad, *detached)
    for leaf, alone in zip((*leaves, r), (grad_q, grad_k, grad_u, grad_v, grad_r)):
        assert torch.equal(leaf.grad, alone.to(leaf.dtype))


@pytest.mark.skipif(not flash_mhf_gluon.GLUON_AVAILABLE, reason="needs triton's Gluon API")
def test_tensor_descriptors_are_copies_of_one_checked_descriptor_per_shape(monkeypatch):
    """`tensor_descriptor`: the same fields as a descriptor Gluon builds and checks itself, on the tensor given; the
    checked one it keeps holds no tensor; a new dtype, shape, strides, block shape or alignment is checked anew (a
    misaligned base fails Gluon's check), and one shape is checked once."""
    monkeypatch.setattr(flash_mhf_gluon, "_DESCRIPTORS", {})
    rows = torch.randn(3 * 64, 128).bfloat16()
    block = (64, 128)
    built = flash_mhf_gluon.tensor_descriptor(rows, block)
    again = flash_mhf_gluon.tensor_descriptor(rows.clone(), block)
    reference = flash_mhf_gluon.GluonTensorDescriptor(rows, list(rows.shape), list(rows.stride()), list(block),
                                                      flash_mhf_gluon._shared_layout(block, rows.dtype))
    for descriptor, base in ((built, rows), (again, None)):
        assert descriptor.base is base or base is None
        assert {k: v for k, v in vars(descriptor).items() if k not in ("base", "launch_key")} == {
            k: v for k, v in vars(reference).items() if k != "base"}
    assert again.base is not rows and again.launch_key == built.launch_key
    assert len(flash_mhf_gluon._DESCRIPTORS) == 1
    assert all(kept.base is None for kept in flash_mhf_gluon._DESCRIPTORS.values())
    for other in (rows.half(), rows[:64], torch.randn(64, 256).bfloat16()[:, :128]):
        assert flash_mhf_gluon.tensor_descriptor(other, block).launch_key != built.launch_key
    assert flash_mhf_gluon.tensor_descriptor(rows, (32, 128)).launch_key != built.launch_key
    misaligned = torch.randn(3 * 64 * 128 + 1).bfloat16()[1:].view(3 * 64, 128)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        flash_mhf_gluon.tensor_descriptor(misaligned, block)


def _ptxas() -> str | None:
    """The ptxas that triton itself uses for sm_90 (triton 3.6 and 3.9 ship different ones)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except (ImportError, AttributeError, RuntimeError):
        return None
    return path if path and os.path.exists(path) else None


def _ptxas_available() -> bool:
    return _ptxas() is not None


@pytest.mark.skipif(not (flash_mhf_gluon.GLUON_AVAILABLE and _ptxas_available()),
                    reason="needs triton's Gluon API and ptxas")
def test_gluon_kernel_compiles_for_hopper():
    """Compiled for sm_90 without a GPU: the three schedules build and fit in shared memory. The weight kernel issues
    32 wgmmas per row block and warp group (4 products of 8 k-steps: [gate | up], dO V^T, dV, [dK | dU]); the dq/dr
    kernel 24 per column block in each of its two computing partitions ([gate | up] and dO V^T with 8 k-steps, dq
    from dM and from dN with 4 each), and 9 more in each with the fused layer's norm/gate backward after its loop (the
    router's gradient with 4 k-steps for each 64-row half of d_h, dq's share through the gates with 1); the forward
    12 in each of its three ([gate | up] with 8 k-steps, the output with 4); the kernels that add up the weight
    kernel's split tiles and the forward's split row blocks none."""
    for kernel, wgmmas, fused_gates in (("weights", 32, False), ("add_weight_splits", 0, False), ("rows", 48, False),
                                        ("rows", 66, True), ("forward", 36, False), ("add_forward_splits", 0, False)):
        report = flash_mhf_gluon.compile_for_hopper(kernel, torch.bfloat16, subnetwork_size=384,
                                                    fused_gates=fused_gates)
        assert report["shared_memory"] <= 227 * 1024, (kernel, report)
        assert report["wgmma"] == wgmmas, (kernel, report)
        # ptxas serialises every wgmma of a kernel (and says so) when non-wgmma code may touch the registers of an
        # unfinished product: the schedule would still be right, but no product would overlap anything
        with tempfile.TemporaryDirectory() as folder:
            ptx = os.path.join(folder, "kernel.ptx")
            with open(ptx, "w") as handle:
                handle.write(report["compiled"].asm["ptx"])
            result = subprocess.run([_ptxas(), "-arch=sm_90a", "-v", ptx, "-o", os.path.join(folder, "kernel.cubin")],
                                    capture_output=True, text=True, check=True)
        assert "serialized" not in result.stderr, (kernel, result.stderr)
