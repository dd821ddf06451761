"""The decoder's Triton RMSNorm and rotary kernels (`hf_memffn/decoder_triton.py`) against a float64 ground truth,
outputs and every gradient, and whole models on the kernels against the PyTorch operations.

The kernel tests run on CUDA in this process, and on CPU in a child pytest under TRITON_INTERPRET=1
(`test_decoder_kernels_under_interpreter_in_subprocess`).
"""

from __future__ import annotations

import pytest
import torch

from hf_memffn import decoder_triton
from hf_memffn.modeling_memffn import apply_rotary_pos_emb
from hf_memffn.rms_norm import MemFFNRMSNorm
from hf_memffn.testing import tiny_config
from triton_interpreter import DEVICE, needs_kernels, run_under_interpreter

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def randn(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale).to(DEVICE)


# ------------------------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 37, 64), (3, 100), (1, 5, 1024), (2, 3, 96), (3, 4100)], ids=str)
def test_rms_norm_matches_float64(shape, dtype):
    eps = 1e-5
    x, weight, grad_y = randn(*shape, seed=0), 1 + randn(shape[-1], seed=1, scale=0.2), randn(*shape, seed=2)
    x64, w64 = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    expected.backward(grad_y)
    x_k, w_k = x.to(dtype).requires_grad_(True), weight.to(dtype).requires_grad_(True)
    out = decoder_triton.rms_norm(x_k, w_k, eps)
    assert out.dtype == dtype and out.shape == x.shape
    out.backward(grad_y.to(dtype))
    errors = {"out": relative_error(out, expected), "x": relative_error(x_k.grad, x64.grad),
              "weight": relative_error(w_k.grad, w64.grad)}
    assert max(errors.values()) < TOLERANCE[dtype], errors
    with torch.no_grad():  # inference: one launch, no autograd node, the same values
        torch.testing.assert_close(decoder_triton.rms_norm(x_k, w_k, eps), out.detach(), rtol=0, atol=0)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_of_row_views_with_a_float32_weight_matches_float64(dtype):
    """16-bit rows that are a view with gaps (the first 64 of 128 columns) and a float32 weight (mixed precision):
    float32 output as PyTorch promotes it, the input's gradient only in the view's columns, the weight's in float32."""
    eps = 1e-5
    buffer, weight, grad_y = randn(2, 5, 128, seed=0), 1 + randn(64, seed=1, scale=0.2), randn(2, 5, 64, seed=2)
    x64, w64 = buffer[..., :64].clone().requires_grad_(True), weight.clone().requires_grad_(True)
    expected = w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    expected.backward(grad_y)
    buffer_k, w_k = buffer.to(dtype).requires_grad_(True), weight.float().requires_grad_(True)
    out = decoder_triton.rms_norm(buffer_k[..., :64], w_k, eps)
    assert out.dtype == torch.float32 and out.shape == x64.shape
    out.backward(grad_y.float())
    assert buffer_k.grad.dtype == dtype and w_k.grad.dtype == torch.float32
    assert torch.equal(buffer_k.grad[..., 64:], torch.zeros_like(buffer_k.grad[..., 64:]))
    errors = {"out": relative_error(out, expected), "x": relative_error(buffer_k.grad[..., :64], x64.grad),
              "weight": relative_error(w_k.grad, w64.grad)}
    assert max(errors.values()) < TOLERANCE[dtype], errors


@needs_kernels
def test_rms_norm_module_paths_agree():
    """The module on the kernels and on the PyTorch operations: the same values (bf16: the kernel rounds once, the
    operations after every step) and gradients; float32 weight with bf16 input promotes as PyTorch does."""
    grad = randn(4, 9, 256, seed=5)
    for weight_dtype in (torch.bfloat16, torch.float32):
        modules = {k: MemFFNRMSNorm(256, 1e-5, kernels=k).to(DEVICE, weight_dtype) for k in ("triton", "torch")}
        inputs = {k: randn(4, 9, 256, seed=3).to(torch.bfloat16).requires_grad_(True) for k in modules}
        with torch.no_grad():
            for module in modules.values():
                module.weight.copy_(1 + randn(256, seed=4, scale=0.2))
        outs = {k: m(inputs[k]) for k, m in modules.items()}
        assert outs["triton"].dtype == outs["torch"].dtype == torch.promote_types(weight_dtype, torch.bfloat16)
        assert relative_error(outs["triton"], outs["torch"]) < 1e-2
        for out in outs.values():
            out.backward(grad.to(out.dtype))
        assert relative_error(inputs["triton"].grad, inputs["torch"].grad) < 2e-2
        assert relative_error(modules["triton"].weight.grad, modules["torch"].weight.grad) < 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_pytorch_operations_equals_llamas(dtype):
    """The PyTorch path (what CPU runs and every path is compared against) normalizes in float32 whatever the input
    dtype, as transformers' LlamaRMSNorm does: the same weights give Llama's values bit for bit, 16-bit inputs too."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    ours, llama = MemFFNRMSNorm(64, 1e-5, kernels="torch"), LlamaRMSNorm(64, eps=1e-5)
    with torch.no_grad():
        for module in (ours, llama):
            module.weight.copy_(1 + randn(64, seed=1, scale=0.2).cpu())
    ours, llama = ours.to(dtype), llama.to(dtype)
    x = randn(3, 5, 64, seed=0, scale=30.0).cpu().to(dtype)
    assert torch.equal(ours(x), llama(x))


@needs_kernels
def test_rms_norm_of_no_rows():
    x = torch.empty(0, 5, 64, device=DEVICE, requires_grad=True)
    weight = torch.ones(64, device=DEVICE, requires_grad=True)
    out = decoder_triton.rms_norm(x, weight, 1e-5)
    out.sum().backward()
    assert out.shape == x.shape and x.grad.shape == x.shape and torch.equal(weight.grad, torch.zeros_like(weight))


# ------------------------------------------------------------------------------------------------------------
# Rotary embeddings
# ------------------------------------------------------------------------------------------------------------
def rotary_tables(batch: int, length: int, dim: int, seed: int, shared_halves: bool = True):
    """cos/sin [batch, L, D] in float64; `shared_halves` as RoPE builds them (both halves equal), else any values."""
    if shared_halves:
        angles = randn(batch, length, dim // 2, seed=seed, scale=3.0)
        angles = torch.cat((angles, angles), -1)
        return angles.cos(), angles.sin()
    return randn(batch, length, dim, seed=seed), randn(batch, length, dim, seed=seed + 1)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 37, 3, 64, 2, True), (1, 5, 4, 16, 1, True), (3, 40, 2, 12, 1, False),
                                  (2, 1, 2, 128, 2, True)], ids=["batch_tables", "short", "D12_any_tables", "L1"])
def test_rotary_matches_float64(case, dtype):
    """Output (a contiguous [B, H, L, D] tensor) and input gradient, with per-batch and batch-shared tables, a head
    size whose half is not a power of two, and tables whose halves differ (the adjoint must not assume equal halves)."""
    batch, length, heads, dim, table_batch, shared_halves = case
    x, grad_out = randn(batch, length, heads, dim, seed=0), randn(batch, heads, length, dim, seed=1)
    cos, sin = rotary_tables(table_batch, length, dim, seed=2, shared_halves=shared_halves)
    x64 = x.clone().requires_grad_(True)
    expected, _ = apply_rotary_pos_emb(x64.transpose(1, 2), x64.transpose(1, 2), cos, sin)
    expected.backward(grad_out)
    x_k = x.to(dtype).requires_grad_(True)
    out = decoder_triton.rotate(x_k, cos.to(dtype), sin.to(dtype))
    assert out.shape == (batch, heads, length, dim) and out.is_contiguous() and out.dtype == dtype
    out.backward(grad_out.to(dtype))
    errors = {"out": relative_error(out, expected), "x": relative_error(x_k.grad, x64.grad)}
    assert max(errors.values()) < TOLERANCE[dtype], errors


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 24 * 2**30,
                    reason="needs a CUDA device with 24 GiB")
def test_rotary_addresses_heads_past_two_to_the_31_elements():
    """A [B, H, L, D] tensor whose third head starts at element 2**31 (head stride L x D = 2**30, below 2**31, so
    a 32-bit integer): the head's offset must not wrap around. The input is one position broadcast over L = 2**23
    (stride 0), so only the rotated [1, 3, L, 128] output (6 GiB) is allocated; it is then rotated back in place
    by the backward's adjoint map, reading the heads-first tensor by the same offsets."""
    heads, dim, length = 3, 128, 2**23
    x = randn(1, 1, heads, dim, seed=0).to("cuda", torch.bfloat16)
    cos, sin = (t.to("cuda", torch.bfloat16) for t in rotary_tables(1, 1, dim, seed=1))
    expected, _ = apply_rotary_pos_emb(x.double().transpose(1, 2), x.double().transpose(1, 2), cos.double(),
                                       sin.double())  # [1, H, 1, D]
    wide_x = x.expand(1, length, heads, dim)
    wide_cos, wide_sin = cos.expand(1, length, dim), sin.expand(1, length, dim)
    out = decoder_triton._heads_first(wide_x, wide_x.dtype)
    assert out.stride(2) * (heads - 1) == 2**31
    decoder_triton.rotary(wide_x, wide_cos, wide_sin, out, transposed=False)
    torch.cuda.synchronize()
    for positions in (slice(0, 4), slice(length // 2, length // 2 + 4), slice(length - 4, length)):
        got = out[:, positions].transpose(1, 2)  # [1, H, 4, D]
        assert relative_error(got, expected.expand_as(got)) < TOLERANCE[torch.bfloat16], positions
    decoder_triton.rotary(out, wide_cos, wide_sin, out, transposed=True)  # the adjoint of a rotation: back to x
    torch.cuda.synchronize()
    for positions in (slice(0, 4), slice(length - 4, length)):
        got = out[:, positions]
        assert relative_error(got, x.expand_as(got)) < 2 * TOLERANCE[torch.bfloat16], positions


@needs_kernels
@pytest.mark.parametrize("layout", ["sin_sliced", "cos_sliced", "cos_expanded", "sin_transposed"])
def test_rotary_with_tables_of_other_strides_matches_float64(layout):
    """cos and sin laid out differently (one a view of a longer table, broadcast over the batch, or with its
    positions and batch transposed): each table read by its own strides, by `rotate` (output and gradient) and
    `rotate_pair`; the kernel reads both tables by one set of strides."""
    batch, length, heads, dim = 3, 5, 2, 16
    cos, sin = rotary_tables(batch, 9, dim, seed=2, shared_halves=False)
    cos, sin = cos.float(), sin.float()
    if layout == "sin_sliced":
        cos, sin = cos[:, :length].contiguous(), sin[:, :length]
    elif layout == "cos_sliced":
        cos, sin = cos[:, 2:2 + length], sin[:, 2:2 + length].contiguous()
    elif layout == "cos_expanded":
        cos, sin = cos[:1, :length].expand(batch, length, dim), sin[:, :length].contiguous()
    else:
        cos, sin = cos[:, :length].contiguous(), sin[:, :length].transpose(0, 1).contiguous().transpose(0, 1)
    assert decoder_triton._table_strides(cos) != decoder_triton._table_strides(sin)
    x, grad_out = randn(batch, length, heads, dim, seed=0), randn(batch, heads, length, dim, seed=1)
    x64 = x.clone().requires_grad_(True)
    expected, _ = apply_rotary_pos_emb(x64.transpose(1, 2), x64.transpose(1, 2), cos.double(), sin.double())
    expected.backward(grad_out)
    x_k = x.float().requires_grad_(True)
    out = decoder_triton.rotate(x_k, cos, sin)
    out.backward(grad_out.float())
    with torch.no_grad():
        query, key = decoder_triton.rotate_pair(x.float(), x[:, :, :1].float(), cos, sin)
    errors = {"out": relative_error(out, expected), "x": relative_error(x_k.grad, x64.grad),
              "query": relative_error(query, expected), "key": relative_error(key, expected[:, :1])}
    assert max(errors.values()) < TOLERANCE[torch.float32], errors


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", [(2, 37, 4, 2, 64, 2), (3, 1, 3, 1, 12, 1), (1, 9, 2, 2, 128, 1)],
                         ids=["grouped_batch_tables", "L1_D12", "equal_heads"])
def test_rotary_of_queries_and_keys_in_one_launch_matches_float64(case, dtype):
    """`rotate_pair` (inference: both in one launch) against float64, from views of one projection buffer (strided
    heads), and equal to `rotate` of each bitwise."""
    batch, length, heads, kv_heads, dim, table_batch = case
    projected = randn(batch, length, (heads + kv_heads) * dim, seed=3)
    query = projected[..., : heads * dim].view(batch, length, heads, dim)
    key = projected[..., heads * dim:].view(batch, length, kv_heads, dim)
    cos, sin = rotary_tables(table_batch, length, dim, seed=4, shared_halves=False)
    expected_q, expected_k = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    with torch.no_grad():
        q_k, k_k = decoder_triton.rotate_pair(query.to(dtype), key.to(dtype), cos.to(dtype), sin.to(dtype))
        singles = [decoder_triton.rotate(t.to(dtype), cos.to(dtype), sin.to(dtype)) for t in (query, key)]
    assert q_k.shape == (batch, heads, length, dim) and k_k.shape == (batch, kv_heads, length, dim)
    assert q_k.is_contiguous() and k_k.is_contiguous() and q_k.dtype == k_k.dtype == dtype
    errors = {"query": relative_error(q_k, expected_q), "key": relative_error(k_k, expected_k)}
    assert max(errors.values()) < TOLERANCE[dtype], errors
    torch.testing.assert_close(q_k, singles[0], rtol=0, atol=0)
    torch.testing.assert_close(k_k, singles[1], rtol=0, atol=0)


@needs_kernels
def test_kernels_refuse_a_second_derivative():
    """The norm's and the rotation's backward kernels are not differentiable again: a gradient of their gradient (a
    gradient penalty added to the loss) raises instead of leaving their share out of it."""
    x, weight = randn(3, 48, seed=0).float().requires_grad_(True), 1 + randn(48, seed=1, scale=0.2).float()
    cos, sin = (t.float() for t in rotary_tables(1, 5, 16, seed=2))
    heads = randn(2, 5, 3, 16, seed=3).float().requires_grad_(True)
    for leaf, run in ((x, lambda: decoder_triton.rms_norm(x, weight, 1e-5)),
                      (heads, lambda: decoder_triton.rotate(heads, cos, sin))):
        out = run()
        (grad,) = torch.autograd.grad(out.square().sum(), leaf, create_graph=True)
        penalty = grad.square().sum()
        assert penalty.requires_grad
        with pytest.raises(RuntimeError, match="differentiate twice"):
            (out.sum() + penalty).backward()


# ------------------------------------------------------------------------------------------------------------
# Whole models, and the choice of path
# ------------------------------------------------------------------------------------------------------------
@needs_kernels
@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn"])
def test_models_on_decoder_kernels_match_pytorch_operations(arch):
    """float32 logits, every parameter's gradient and greedy generation with the cache: the same on both paths."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    models = {}
    for kernels in ("triton", "torch"):
        torch.manual_seed(0)
        # (the tiny FlashMHF FFN has 16-wide heads, which its kernels do not take: its PyTorch op runs on both paths)
        ffn = {"ffn_kernel": "torch"} if arch == "flash_mhf" else {}
        config = tiny_config(arch, decoder_kernels=kernels, num_key_value_heads=2, **ffn)
        models[kernels] = AutoModelForCausalLM.from_config(config).to(DEVICE)
    models["torch"].load_state_dict(models["triton"].state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 24), device=DEVICE)
    outs = {k: m(ids, labels=ids) for k, m in models.items()}
    torch.testing.assert_close(outs["triton"].logits, outs["torch"].logits, rtol=1e-4, atol=1e-4)
    for out in outs.values():
        out.loss.backward()
    for (name, a), b in zip(models["triton"].named_parameters(), models["torch"].parameters()):
        if a.grad is not None or b.grad is not None:
            assert relative_error(a.grad, b.grad) < 1e-4, name
    prompt = ids[:1, :8]
    generated = {k: m.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0) for k, m in models.items()}
    assert torch.equal(generated["triton"], generated["torch"])
    assert models["triton"].model.decoder_path().startswith("Triton")
    assert models["torch"].model.decoder_path().startswith("PyTorch")


def test_decoder_kernels_field_is_checked():
    with pytest.raises(ValueError, match="decoder_kernels"):
        tiny_config("kvffn", decoder_kernels="cuda")


def test_auto_runs_pytorch_operations_where_kernels_cannot_run():
    x = torch.empty(2, 3)
    if DEVICE == "cpu" and not decoder_triton._INTERPRET:
        assert "need CUDA" in decoder_triton.decoder_kernels_path(x, "auto")
        with pytest.raises(RuntimeError, match="decoder_kernels='triton' cannot run here"):
            decoder_triton.decoder_kernels_unavailable(x, "triton")
    assert decoder_triton.decoder_kernels_path(x, "torch") == "PyTorch RMSNorm and rotary (decoder_kernels='torch')"


def test_float64_is_refused_by_the_kernels_by_name():
    """The kernels compute in float32: float64 tensors take the PyTorch operations under "auto", saying why, and
    "triton" refuses them naming the dtype (on every device, before any launch)."""
    x = torch.empty(2, 3, dtype=torch.float64, device=DEVICE)
    assert "dtype torch.float64 is not supported" in decoder_triton.decoder_kernels_path(x, "auto")
    with pytest.raises(RuntimeError, match=r"decoder_kernels='triton' cannot run here: dtype torch.float64 .*allowed: "
                                           r"float16, bfloat16, float32"):
        decoder_triton.decoder_kernels_unavailable(x, "triton")


def test_kernel_functions_called_with_float64_refuse_it_by_name():
    """Called directly, the kernels' functions ran float64 tensors (in the interpreter, or on CUDA) and returned
    float64 results of float32 precision; they refuse them before any launch, naming the function and argument."""
    x = torch.zeros(1, 4, 2, 16, dtype=torch.float64, device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in rotary_tables(1, 4, 16, seed=1))  # (float64)
    allowed = r"has dtype torch.float64, which the Triton kernels do not take .*allowed: float16, bfloat16, float32"
    with pytest.raises(ValueError, match="rms_norm: x " + allowed):
        decoder_triton.rms_norm(x, torch.ones(16, dtype=torch.float64, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="rotate: x " + allowed):
        decoder_triton.rotate(x, cos, sin)
    with pytest.raises(ValueError, match="rotate_pair: key " + allowed):
        decoder_triton.rotate_pair(x.float(), x, cos, sin)


@needs_kernels
def test_float64_model_runs_the_pytorch_operations_under_auto():
    """A float64 model under "auto" (KV-FFN: also its activation) gives exactly the logits of "torch", where the
    kernels would have rounded the norms, the rotation and the activation to float32."""
    from transformers import AutoModelForCausalLM

    models = {}
    for kernels in ("auto", "torch"):
        torch.manual_seed(0)
        config = tiny_config("kvffn", decoder_kernels=kernels)
        models[kernels] = AutoModelForCausalLM.from_config(config).to(DEVICE, torch.float64)
    ids = torch.randint(3, config.vocab_size, (2, 12), device=DEVICE)
    with torch.no_grad():
        assert torch.equal(models["auto"](ids).logits, models["torch"](ids).logits)
    assert "dtype torch.float64" in models["auto"].model.decoder_path()
    assert "dtype torch.float64" in models["auto"].model.layers[0].mlp.path_description()


def test_compiled_model_traces_pytorch_operations_under_auto():
    """Under torch.compile "auto" hands the norm and rotation to the compiler: one graph, no break, the eager result
    (meaningful where the kernels run eagerly: on CUDA, and in the interpreter run on CPU); "triton" refuses."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", decoder_kernels="auto")).to(DEVICE)
    ids = torch.randint(3, 100, (1, 12), device=DEVICE)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(model.model)(ids)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    compiled = torch.compile(model.model, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(ids).last_hidden_state, model.model(ids).last_hidden_state)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="decoder_kernels='triton' cannot run here"):
        torch.compile(MemFFNRMSNorm(16, kernels="triton").to(DEVICE), fullgraph=True, backend="eager")(
            torch.ones(2, 16, device=DEVICE))


def test_decoder_kernels_under_interpreter_in_subprocess():
    run_under_interpreter(
        __file__, "matches_float64 or paths_agree or match_pytorch_operations or rejects or no_rows or compiled_model "
        "or second_derivative or float64_model")


def test_rotary_rejects_tables_that_do_not_fit_the_heads():
    """Checked before any launch: the kernel would read past tables of another batch, take [L, D] tables' L as the
    batch, or leave the last column of an odd head width unwritten."""
    x = randn(3, 4, 2, 16, seed=0)
    cases = {"another width": rotary_tables(1, 4, 8, seed=1), "another batch": rotary_tables(2, 4, 16, seed=1),
             "[L, D]": tuple(t[0] for t in rotary_tables(1, 4, 16, seed=1))}
    for name, (cos, sin) in cases.items():
        with pytest.raises(ValueError, match="rotary tables of shape"):
            decoder_triton.rotate(x, cos, sin)
        with pytest.raises(ValueError, match="rotary tables of shape"):
            decoder_triton.rotate_pair(x, x, cos, sin)
    odd = randn(1, 4, 2, 15, seed=0)
    with pytest.raises(ValueError, match=r"D even"):
        decoder_triton.rotate(odd, *(t[..., :15] for t in rotary_tables(1, 4, 16, seed=1)))


def test_rms_norm_rejects_a_weight_of_another_width():
    with pytest.raises(ValueError, match=r"weight of shape \(24,\) does not match rows of width 48"):
        decoder_triton.rms_norm(randn(2, 48, seed=0), randn(24, seed=1), 1e-5)


def test_kernel_functions_refuse_tensors_elsewhere_and_shapes_without_rows_by_name():
    """Checked before any launch, which reads every tensor through the device of the first: a weight, rotary tables or
    keys on another device (on CUDA, host memory or another GPU's) failed inside Triton's launch or read through the
    wrong device; a 0-d x failed while formatting its error, and keys of three dimensions while unpacking their
    shape."""
    x, heads = randn(2, 48, seed=0).float(), randn(3, 4, 2, 16, seed=0).float()
    cos, sin = (table.float() for table in rotary_tables(1, 4, 16, seed=1))
    with pytest.raises(ValueError, match="weight is on meta but x is on "):
        decoder_triton.rms_norm(x, torch.ones(48, device="meta"), 1e-5)
    with pytest.raises(ValueError, match=r"x of shape \(\) has no rows to normalize"):
        decoder_triton.rms_norm(x[0, 0], torch.ones(1, device=DEVICE), 1e-5)
    with pytest.raises(ValueError, match="rotary tables on meta / meta but heads on "):
        decoder_triton.rotate(heads, cos.to("meta"), sin.to("meta"))
    with pytest.raises(ValueError, match="rotary tables on meta / meta but heads on "):
        decoder_triton.rotate_pair(heads, heads, cos.to("meta"), sin.to("meta"))
    with pytest.raises(ValueError, match="keys on meta but queries on "):
        decoder_triton.rotate_pair(heads, heads.to("meta"), cos, sin)
    with pytest.raises(ValueError, match=r"keys of shape \(3, 4, 16\) do not match queries of shape \(3, 4, 2, 16\)"):
        decoder_triton.rotate_pair(heads, heads[:, :, 0], cos, sin)


@needs_kernels
def test_rms_norm_matches_float64_with_a_strided_weight():
    x, wide = randn(3, 48, seed=0), 1 + randn(96, seed=1, scale=0.2)
    weight = wide[::2]
    expected = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert relative_error(decoder_triton.rms_norm(x.float(), weight.float(), 1e-5), expected) < 1e-5


def test_the_modules_keep_the_setting_they_were_built_with_and_the_path_says_so():
    """`decoder_kernels` is taken when the model is built (the norms, the rotation in attention, KV-FFN's activation
    alike); set on the config afterwards it changes none of them, where the rotation used to read the config at each
    call while the norms kept theirs, and `decoder_path` reported the config's value. It reports what the modules run
    and names the later setting."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", decoder_kernels="torch"))
    model.config.decoder_kernels = "auto"
    layer = model.model.layers[0]
    assert (layer.self_attn.decoder_kernels, layer.input_layernorm.kernels, layer.mlp.kernels) == ("torch",) * 3
    path = model.model.decoder_path()
    assert path.startswith("PyTorch RMSNorm and rotary (decoder_kernels='torch')"), path
    assert "config.decoder_kernels='auto' was set after the model was built with 'torch'" in path
    model.model.norm = torch.nn.Identity()  # (a pipeline stage holds stand-ins for the modules of the others)
    assert model.model.decoder_path() == path


@needs_kernels
@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn"])
def test_models_on_the_kernels_under_bf16_autocast_match_pytorch_operations(arch):
    """float32 weights under bf16 autocast (as `Trainer(bf16=True)`): the Triton kernels (the decoder's norms and
    rotations, KV-FFN's activation, FlashMHF's fused layer) give a float32 loss and float32 gradients for every
    parameter, within bf16's rounding of the PyTorch operations' (loss 1e-2, each gradient 5% relative in norm)."""
    from transformers import AutoModelForCausalLM

    device_type = torch.device(DEVICE).type
    models = {}
    for kernels in ("triton", "torch"):
        torch.manual_seed(0)
        # (FlashMHF with heads of d_h 64 and sub-networks of 32 columns, which its kernels take)
        ffn = dict(hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel=kernels) \
            if arch == "flash_mhf" else {}
        config = tiny_config(arch, decoder_kernels=kernels, **ffn)
        models[kernels] = AutoModelForCausalLM.from_config(config).to(DEVICE).train()
    models["torch"].load_state_dict(models["triton"].state_dict())
    ids = torch.randint(3, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    losses = {}
    for kernels, model in models.items():
        with torch.autocast(device_type, dtype=torch.bfloat16):
            losses[kernels] = model(ids, labels=ids).loss
        losses[kernels].backward()
        assert losses[kernels].dtype == torch.float32
    assert abs(losses["triton"].item() - losses["torch"].item()) < 1e-2
    for (name, a), b in zip(models["triton"].named_parameters(), models["torch"].parameters()):
        assert a.grad is not None and a.grad.dtype == torch.float32, name
        assert relative_error(a.grad, b.grad) < 0.05, name
    assert models["triton"].model.decoder_path().startswith("Triton")
    if arch == "flash_mhf":
        mlp = models["triton"].model.layers[0].mlp
        assert mlp.path_description(torch.empty(2, 24, 128, device=DEVICE, dtype=torch.bfloat16)).startswith("fused")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_of_16_bit_heads_with_float32_tables_matches_float64(dtype):
    """Under autocast the projections give 16-bit heads and the tables are float32 (computed for the float32 hidden
    states): the PyTorch rotation (Llama's) returns float32 there, and the kernels now do too, with and without
    gradients (they returned the heads' dtype, so the keys a cache takes differed between the paths: an eager prefill
    on the kernels and a compiled decoding step on the PyTorch operations wrote float32 keys into a bf16 static
    cache, which index_copy_ refused). The input gradient keeps the heads' dtype."""
    batch, length, heads, kv_heads, dim = 2, 9, 4, 2, 16
    query, key = randn(batch, length, heads, dim, seed=0), randn(batch, length, kv_heads, dim, seed=1)
    cos, sin = rotary_tables(1, length, dim, seed=2, shared_halves=True)
    grad_out = randn(batch, heads, length, dim, seed=3)
    query64 = query.clone().requires_grad_(True)
    expected_query, expected_key = apply_rotary_pos_emb(query64.transpose(1, 2), key.transpose(1, 2), cos, sin)
    expected_query.backward(grad_out)
    query_k = query.to(dtype).requires_grad_(True)
    out = decoder_triton.rotate(query_k, cos.float(), sin.float())
    assert out.dtype == torch.float32
    out.backward(grad_out.float())
    assert query_k.grad.dtype == dtype
    with torch.no_grad():
        pair = decoder_triton.rotate_pair(query.to(dtype), key.to(dtype), cos.float(), sin.float())
    assert [tensor.dtype for tensor in pair] == [torch.float32, torch.float32]
    errors = {"out": relative_error(out, expected_query), "x": relative_error(query_k.grad, query64.grad),
              "query": relative_error(pair[0], expected_query), "key": relative_error(pair[1], expected_key)}
    assert max(errors.values()) < TOLERANCE[dtype], errors


@needs_kernels
def test_static_cache_generation_under_bf16_autocast_with_compiled_steps_match_pytorch_operations():
    """`generate()` with a static cache compiles its decoding steps (transformers does so on GPUs; here asked for with
    `compile_config`) while the prefill runs eagerly: under `decoder_kernels="auto"` the prefill rotates on the
    kernels and the compiled steps on the PyTorch operations. Under bf16 autocast the two gave keys of different
    dtypes and the first decoding step stopped at index_copy_ (bf16 cache, float32 keys); it generates the tokens of
    the PyTorch operations."""
    from transformers import AutoModelForCausalLM
    from transformers.cache_utils import StaticLayer
    from transformers.generation import CompileConfig

    probe = StaticLayer(max_cache_len=1)
    probe.lazy_initialization(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2, dtype=torch.bfloat16))
    if probe.values.dtype != torch.bfloat16:
        pytest.skip("this transformers' static cache keeps the values in the keys' dtype: under autocast (float32 "
                    "keys, bf16 values) its Llama stops at index_copy_ too")
    compile_config = CompileConfig(fullgraph=False, backend="eager")
    compile_config._compile_all_devices = True  # (transformers compiles on GPUs only unless told)
    device_type = torch.device(DEVICE).type
    generated = {}
    for kernels in ("auto", "torch"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("kvffn", decoder_kernels=kernels)).to(DEVICE).eval()
        ids = torch.randint(3, 320, (2, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        torch._dynamo.reset()
        try:
            with torch.no_grad(), torch.autocast(device_type, dtype=torch.bfloat16):
                generated[kernels] = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                                    cache_implementation="static", compile_config=compile_config)
        finally:
            torch._dynamo.reset()
    assert torch.equal(generated["auto"], generated["torch"])
