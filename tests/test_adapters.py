"""LoRA on every FFN weight (PEFT on the Linear layers, `hf_memffn.adapters` on the plain parameters, FlashMHF's 4-D
sub-network banks included) and weight-only int8 for the plain parameters."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_memffn
from hf_memffn import adapters
from hf_memffn.testing import enable_activation_checkpointing, tiny_config, train_losses

peft = pytest.importorskip("peft")
ARCHS = sorted(hf_memffn.ARCHITECTURES)


def tiny_model(arch):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch)).eval()


def ffn_weight_names(model) -> list[str]:
    """Every weight matrix of the FFNs (each layer's `mlp`, the model's `memory`): not norm weights, not biases."""
    return [name for name, _ in model.named_parameters()
            if (".mlp." in name or ".memory." in name) and "norm" not in name and not name.endswith(".bias")]


def adapted_weights(model, adapted_parameters: list[str]) -> set[str]:
    """The weights with an adapter: PEFT's on Linear layers (`<module>.weight`) and `adapters`' on parameters."""
    linear = {name.rsplit(".lora_A", 1)[0].replace("base_model.model.", "") + ".weight"
              for name, _ in model.named_parameters() if ".lora_A." in name}
    return linear | {name.replace("base_model.model.", "") for name in adapted_parameters}


@pytest.mark.parametrize("arch, ffn_variant", [("flash_mhf", "swiglu"), ("kvffn", "relu"), ("kvffn", "densenet")])
def test_lora_targets_cover_the_ffn_of_every_baseline(arch, ffn_variant):
    """`LORA_TARGET_MODULES[arch]` names the Linear layers of the architecture's baselines too: PEFT would leave a
    baseline's FFN frozen without a word where one name of the list matched elsewhere."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, ffn_variant=ffn_variant))
    ffn_weights = ffn_weight_names(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=hf_memffn.LORA_TARGET_MODULES[arch]))
    adapted = adapters.add_weight_lora(model, r=4, alpha=8, freeze_base=False)
    assert ffn_weights and set(ffn_weights) <= adapted_weights(model, adapted)


@pytest.mark.parametrize("arch, targets", [("kvffn", None), ("memoryllm", [])])
def test_add_weight_lora_with_nothing_to_adapt_is_refused_before_freezing_the_model(arch, targets):
    """KV-FFN's FFN is Linear layers (PEFT's LoRA adapts them), and `targets=[]` names nothing: with freeze_base the
    call froze every parameter and returned [], so nothing would train."""
    model = tiny_model(arch)
    with pytest.raises(ValueError, match="no FFN weight of this model is a plain parameter.*LORA_TARGET_MODULES"):
        adapters.add_weight_lora(model, r=2, targets=targets)
    assert all(param.requires_grad for param in model.parameters())


def add_weight_lora_beside_peft(model, **options) -> list[str]:
    """`adapters.add_weight_lora` on a PEFT model: where it adds adapters, it warns once that PEFT's save_pretrained
    leaves them out (and nothing else); the tests that combine both expect that warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        added = adapters.add_weight_lora(model, **options)
    assert [str(warning.message).split(":")[0] for warning in caught] == (
        ["add_weight_lora on a PEFT model"] if added else [])
    return added


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_every_ffn_weight_trains_merges_and_saves_in_the_original_format(arch, tmp_path):
    model = tiny_model(arch)
    original_keys = set(model.state_dict())
    ffn_weights = ffn_weight_names(model)
    ids = torch.randint(3, 320, (4, 16))
    with torch.no_grad():
        base_logits = model(ids).logits

    targets = hf_memffn.LORA_TARGET_MODULES[arch]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    adapted = add_weight_lora_beside_peft(model, r=4, alpha=8, freeze_base=False)
    # every FFN weight has an adapter, through PEFT or through adapters
    assert set(ffn_weights) <= adapted_weights(model, adapted), set(ffn_weights) - adapted_weights(model, adapted)

    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.numel() < 5000 for p in trainable)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    losses = train_losses(model, ids, trainable, lr=1e-2, steps=8)
    model.eval()
    assert losses[-1] < losses[0]
    for name, param in model.named_parameters():
        if name in frozen_before:
            torch.testing.assert_close(param, frozen_before[name])
    with torch.no_grad():
        adapted_logits = model(ids).logits
    assert (adapted_logits - base_logits).abs().max() > 1e-3

    merged = model.merge_and_unload()
    assert adapters.merge_weight_lora(merged) == len(adapted)
    assert set(merged.state_dict()) == original_keys
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted_logits, rtol=1e-4, atol=1e-5)
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, adapted_logits, rtol=1e-4, atol=1e-5)


def test_flash_mhf_banks_keep_their_shape_and_the_kernel_sees_the_adapted_weight():
    model = tiny_model("flash_mhf")
    mlp = model.model.layers[0].mlp
    shape = tuple(mlp.key_up_value.shape)
    assert len(shape) == 4 and tuple(mlp.key.shape) == (shape[0] // 3, *shape[1:])
    adapters.add_weight_lora(model, r=2, alpha=2, targets=["model.layers.0.mlp.key_up_value"])
    assert tuple(mlp.key_up_value.shape) == shape
    assert tuple(mlp.parametrizations.key_up_value.original.shape) == shape
    with torch.no_grad():
        mlp.parametrizations.key_up_value[0].lora_B.fill_(0.1)
        assert not torch.equal(mlp.key, mlp.parametrizations.key_up_value.original.chunk(3)[0])  # key reads the delta
    ids = torch.randint(3, 320, (1, 8))
    with torch.no_grad():
        adapted = model(ids).logits
    with pytest.raises(ValueError, match="not FFN parameter weights"):
        adapters.add_weight_lora(model, targets=["model.layers.0.mlp.in_proj.weight"])
    state = adapters.weight_lora_state_dict(model)
    assert set(state) == {f"model.layers.0.mlp.key_up_value.{part}" for part in ("lora_A", "lora_B", "lora_alpha")}
    fresh = tiny_model("flash_mhf")
    adapters.add_weight_lora(fresh, r=2, alpha=2, targets=["model.layers.0.mlp.key_up_value"])
    adapters.load_weight_lora(fresh, state)
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, adapted)
    # adapters saved when the banks were three parameters `key`, `up`, `value` (their thirds) load the same
    thirds = {f"model.layers.0.mlp.{bank}.{part}": third
              for part in ("lora_A", "lora_B")
              for bank, third in zip(("key", "up", "value"), state[f"model.layers.0.mlp.key_up_value.{part}"].chunk(3))}
    older = tiny_model("flash_mhf")
    adapters.add_weight_lora(older, r=2, alpha=2, targets=["model.layers.0.mlp.key_up_value"])
    adapters.load_weight_lora(older, thirds)
    with torch.no_grad():
        torch.testing.assert_close(older(ids).logits, adapted)
    with pytest.raises(ValueError, match="missing"):  # (two of the three thirds: nothing to join)
        adapters.load_weight_lora(older, {k: v for k, v in thirds.items() if ".value." not in k})


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_int8_weights_stay_close_and_take_lora_on_top(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, 320, (2, 12))
    with torch.no_grad():
        reference = model(ids).logits
    names = adapters.quantize_weights_int8(model)
    assert names
    stored = {n: p for n, p in model.named_parameters() if n.endswith(".original0")}
    assert stored and all(p.dtype == torch.int8 for p in stored.values())
    with torch.no_grad():
        quantized = model(ids).logits
    assert (quantized - reference).abs().max() < 0.05 * reference.abs().max()
    adapters.add_weight_lora(model, r=2, alpha=4)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None for g in lora_grads)
    assert adapters.merge_weight_lora(model) == len(names)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_keeps_the_rows_of_tiny_values_of_a_16_bit_weight(dtype):
    """The int8 scale is stored in the weight's dtype: in fp16 the scale of a row whose largest magnitude is below
    about 4e-6 underflowed to 0, and the row read back as zeros (a subnormal scale lost most of its bits). Each row
    reads back within 1% of its largest magnitude now, a row of fp16 subnormals exactly."""
    model = tiny_model("memoryllm").to(dtype)
    gate = model.model.memory.gate_proj
    with torch.no_grad():
        gate[0, 0] = torch.linspace(-3e-6, 2e-6, gate.shape[-1])
        gate[0, 1] *= 1e-4
    before = gate.detach().float().clone()
    adapters.quantize_weights_int8(model)
    after = model.model.memory.gate_proj.detach().float()
    assert bool(((after - before).abs().amax(-1) <= 0.01 * before.abs().amax(-1)).all())
    if dtype == torch.float16:
        assert torch.equal(after[0, 0], before[0, 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_int8_reads_back_finite_rows_at_the_top_of_the_dtype(dtype):
    """A row whose largest magnitude is near the dtype's largest value (in fp16 above about 65470) had its scale
    rounded up past max/127, so 127 x scale read back as inf; each such row reads back finite and within half a
    quantization step now, and an all-zero row reads back as zeros."""
    largest = torch.finfo(dtype).max
    weight = torch.tensor([[largest, 1.0, -0.5 * largest], [0.9996 * largest, 2.0, 3.0], [0.0, 0.0, 0.0]],
                          dtype=dtype)
    quantizer = adapters.Int8Weight()
    values, scale = quantizer.right_inverse(weight)
    read_back = quantizer(values, scale)
    assert bool(torch.isfinite(read_back).all())
    error = (read_back.double() - weight.double()).abs()
    assert bool((error <= scale.double() / 2 + 1e-6 * weight.double().abs()).all())
    assert torch.equal(read_back[2], weight[2])


def test_weight_lora_trains_under_activation_checkpointing():
    """The module logs its path once, inside its first forward; with LoRA on the FlashMHF weights (a
    parametrization) that must not record autograd work, or the checkpointed forward and its recomputation save
    different tensors."""
    torch.manual_seed(0)
    model = tiny_model("flash_mhf").train()
    adapters.add_weight_lora(model, r=2, alpha=4)
    enable_activation_checkpointing(model, {"use_reentrant": False})
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    assert any(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_add_weight_lora_after_get_peft_model_keeps_pefts_adapters_trainable():
    """README's order (PEFT on the Linear layers, then ours on the plain parameters), with `freeze_base` left at its
    default: PEFT's adapters stay trainable, the base weights (the adapted ones included) are frozen."""
    model = peft.get_peft_model(tiny_model("flash_mhf"),
                                peft.LoraConfig(r=4, target_modules=hf_memffn.LORA_TARGET_MODULES["flash_mhf"]))
    peft_trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert peft_trainable and all(".lora_" in name for name in peft_trainable)
    add_weight_lora_beside_peft(model, r=2)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    ours = {name for name in trainable if ".parametrizations." in name}
    assert trainable - ours == peft_trainable
    assert ours and all(name.endswith((".lora_A", ".lora_B")) for name in ours)
    # a second call on other weights keeps the first call's adapters trainable too
    model = tiny_model("flash_mhf")
    names = [name for name, _, _ in adapters.parameter_weights(model)]
    adapters.add_weight_lora(model, r=2, targets=names[:1])
    adapters.add_weight_lora(model, r=2, targets=names[1:])
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert len(trainable) == 2 * len(names) and all(name.endswith((".lora_A", ".lora_B")) for name in trainable)


def test_a_weight_with_an_adapter_is_refused_a_second_one():
    model = tiny_model("memoryllm")
    adapters.add_weight_lora(model, r=2)
    before = {name: param.requires_grad for name, param in model.named_parameters()}
    with pytest.raises(ValueError, match=r"model\.memory\.gate_proj.*LoRA adapter already.*merge_weight_lora"):
        adapters.add_weight_lora(model, r=2, freeze_base=False)
    assert {name: param.requires_grad for name, param in model.named_parameters()} == before  # nothing changed
    assert adapters.merge_weight_lora(model) == 3


@pytest.mark.parametrize("attach", ["lora", "int8"])
def test_a_checkpoint_saved_with_adapters_attached_is_refused_by_from_pretrained(attach, tmp_path):
    """Saved with adapters or int8 attached (a Trainer checkpoint of such a model), the FFN weights are stored as
    parametrizations that a loaded model lacks. `from_pretrained` refuses the folder instead of starting those
    weights at random; the model it was saved from loads it back with `load_state_dict`, as the Trainer resumes."""
    from safetensors.torch import load_file

    model = tiny_model("memoryllm")
    attach_adapters = adapters.quantize_weights_int8 if attach == "int8" else (
        lambda m: adapters.add_weight_lora(m, r=2))
    attach_adapters(model)
    if attach == "lora":
        with torch.no_grad():
            for _, _, _, item in adapters._lora_parametrizations(model):
                item.lora_B.normal_()
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model\.memory\.down_proj, model\.memory\.gate_proj.*adapters or int8"):
        AutoModelForCausalLM.from_pretrained(tmp_path)

    resumed = tiny_model("memoryllm")
    torch.manual_seed(1)
    attach_adapters(resumed)
    resumed.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    ids = torch.randint(3, 320, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(resumed(ids).logits, model(ids).logits, rtol=0, atol=0)
        if attach == "lora":
            adapters.merge_weight_lora(model)
            model.save_pretrained(tmp_path / "merged")
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
            torch.testing.assert_close(loaded(ids).logits, resumed(ids).logits)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("embedding_adapter", [dict(target_modules=["q_proj", "embed_tokens"]),
                                               dict(target_modules=["q_proj"], trainable_token_indices=[5, 6])],
                         ids=["lora", "trainable_tokens"])
def test_adapters_on_the_token_embedding_train_and_generate(arch, embedding_adapter):
    """PEFT replaces `embed_tokens` with a wrapper that is not an `nn.Embedding`: the token-id check reads the rows
    of its weight, as Llama's forward needs nothing of it."""
    model = peft.get_peft_model(tiny_model(arch), peft.LoraConfig(task_type="CAUSAL_LM", r=4, **embedding_adapter))
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert any(param.grad is not None for name, param in model.named_parameters() if "embed_tokens" in name)
    model.eval()
    generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
    assert generated.shape == (2, 9)
    with pytest.raises(ValueError, match=f"allowed ids are 0..{model.config.vocab_size - 1}"):
        model(input_ids=ids + model.config.vocab_size)


def test_merging_gives_float_weights_back_for_int8_weights_without_an_adapter_too(tmp_path):
    model = tiny_model("memoryllm")
    ids = torch.randint(3, 320, (2, 9))
    adapters.quantize_weights_int8(model)
    targets = ["model.memory.down_proj"]
    assert adapters.add_weight_lora(model, r=4, alpha=8, targets=targets) == targets
    with torch.no_grad():
        logits = model(ids).logits
    assert adapters.merge_weight_lora(model) == 1
    assert not any("parametrizations" in name for name in model.state_dict())
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits, logits)


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_weights_merged_under_inference_mode_train_afterwards(arch):
    """`merge_weight_lora` called under `torch.inference_mode()` (merging for serving): the merged weights were
    inference tensors, so a later training step failed ("Inference tensors cannot be saved for backward", or
    `requires_grad_(True)` refused them), where PEFT's `merge_and_unload` leaves its weights trainable."""
    model = tiny_model(arch)
    ids = torch.randint(3, 320, (2, 9))
    adapted = adapters.add_weight_lora(model, r=4, alpha=8, freeze_base=False)
    with torch.inference_mode():
        logits = model(ids).logits
        assert adapters.merge_weight_lora(model) == len(adapted)
    assert not any(param.is_inference() for param in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits)
    model.requires_grad_(True).train()
    model(ids, labels=ids).loss.backward()
    assert all(param.grad is not None for name, param in model.named_parameters() if name in adapted)


def test_adapters_saved_with_another_alpha_are_refused_and_states_without_alpha_still_load():
    """The state held A and B only: adapters added with another alpha took them and scaled the delta by another
    alpha / r without a word."""
    saved = tiny_model("memoryllm")
    adapters.add_weight_lora(saved, r=2, alpha=2)
    with torch.no_grad():
        for _, _, _, item in adapters._lora_parametrizations(saved):
            item.lora_B.normal_()
    state = adapters.weight_lora_state_dict(saved)
    assert state["model.memory.gate_proj.lora_alpha"].dtype == torch.float64
    model = tiny_model("memoryllm")
    adapters.add_weight_lora(model, r=2, alpha=4)
    before = adapters.weight_lora_state_dict(model)
    with pytest.raises(ValueError, match=r"lora_alpha'\] is 2\.0, this model's adapter has alpha=4\.0"):
        adapters.load_weight_lora(model, state)
    for key, value in adapters.weight_lora_state_dict(model).items():  # nothing was copied
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)
    ids = torch.randint(3, 320, (1, 8))
    same = tiny_model("memoryllm")
    adapters.add_weight_lora(same, r=2, alpha=2)
    adapters.load_weight_lora(same, state)
    with torch.no_grad():
        torch.testing.assert_close(same(ids).logits, saved(ids).logits)
    without_alpha = {key: value for key, value in state.items() if not key.endswith(".lora_alpha")}
    adapters.load_weight_lora(model, without_alpha)  # (an earlier version's state: taken as it is)
    torch.testing.assert_close(model.model.memory.parametrizations.gate_proj[0].lora_B,
                               saved.model.memory.parametrizations.gate_proj[0].lora_B)


def test_adapters_saved_with_another_rank_are_refused_before_any_is_loaded():
    """Adapters of rank 1 broadcast into rank-2 ones without an error; other ranks failed with a RuntimeError that
    named no weight."""
    saved = tiny_model("memoryllm")
    adapters.add_weight_lora(saved, r=1, alpha=2)
    state = adapters.weight_lora_state_dict(saved)
    model = tiny_model("memoryllm")
    adapters.add_weight_lora(model, r=2, alpha=4)
    before = adapters.weight_lora_state_dict(model)
    with pytest.raises(ValueError, match=r"model\.memory\.gate_proj\.lora_A'\] has shape \(2, 1, 64\).*\(2, 2, 64\)"):
        adapters.load_weight_lora(model, state)
    same_shapes = {**state, "model.memory.gate_proj.lora_A": before["model.memory.gate_proj.lora_A"] + 1}
    with pytest.raises(ValueError, match="has shape"):  # (another entry is refused: nothing was copied)
        adapters.load_weight_lora(model, same_shapes)
    for key, value in adapters.weight_lora_state_dict(model).items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_quantize_weights_int8_refused_changes_nothing_and_names_why():
    """Refused for one weight with an adapter, it had quantized the weights before that one; called twice, it
    blamed adapters the model did not have."""
    model = tiny_model("memoryllm")
    adapters.add_weight_lora(model, r=2, targets=["model.memory.up_proj"])
    with pytest.raises(ValueError, match=r"\['model\.memory\.up_proj'\] have adapters"):
        adapters.quantize_weights_int8(model)
    assert not any(param.dtype == torch.int8 for param in model.parameters())
    model = tiny_model("memoryllm")
    adapters.quantize_weights_int8(model)
    with pytest.raises(ValueError, match=r"model\.memory\.gate_proj.*are int8 already"):
        adapters.quantize_weights_int8(model)


@pytest.mark.parametrize("arch, pruned", [("flash_mhf", "model.layers.1.mlp.key_up_value"),
                                           ("memoryllm", "model.memory.down_proj")])
def test_weights_pruned_without_prune_remove_are_refused_adapters_and_int8_naming_the_way_out(arch, pruned):
    """`torch.nn.utils.prune` keeps the weight as `<name>_orig` and a mask until `prune.remove`: int8 crashed with
    "you can only change requires_grad flags of leaf variables" after quantizing the weights before that one, and
    LoRA froze the model and attached adapters before its "does not have a parameter" error. Made permanent with
    `prune.remove`, both take the pruned weights and keep their zeros."""
    from torch.nn.utils import prune

    model = tiny_model(arch)
    module_name, _, name = pruned.rpartition(".")
    prune.l1_unstructured(model.get_submodule(module_name), name, amount=0.5)
    for function in (adapters.quantize_weights_int8, adapters.add_weight_lora):
        with pytest.raises(ValueError, match=rf"{function.__name__}: \['{pruned}'\] are pruned.*prune\.remove"):
            function(model)
    assert not any(".parametrizations." in key for key, _ in model.named_parameters())
    assert all(param.requires_grad for param in model.parameters())
    prune.remove(model.get_submodule(module_name), name)
    assert pruned in adapters.quantize_weights_int8(model)
    assert (model.get_submodule(module_name).parametrizations[name].original0 == 0).float().mean() >= 0.5


@pytest.mark.parametrize("kwargs, message", [
    (dict(alpha=None), "alpha=None is invalid"), (dict(alpha=float("inf")), "alpha=inf is invalid"),
    (dict(alpha="16"), "alpha='16' is invalid"), (dict(r=True), "r=True is invalid"),
    (dict(targets="model.memory.up_proj"), r"targets='model\.memory\.up_proj' is invalid: must be a list"),
])
def test_add_weight_lora_refuses_bad_arguments_naming_them(kwargs, message):
    model = tiny_model("memoryllm")
    with pytest.raises(ValueError, match=message):
        adapters.add_weight_lora(model, **kwargs)
    assert not any(".parametrizations." in name for name, _ in model.named_parameters())


def test_add_weight_lora_takes_numpy_numbers():
    """A rank from a NumPy sweep (`np.int64`) was refused as "not a positive integer", where NumPy's floats were
    taken for alpha."""
    np = pytest.importorskip("numpy")
    model = tiny_model("memoryllm")
    assert adapters.add_weight_lora(model, r=np.int64(4), alpha=np.float32(8), targets=["model.memory.up_proj"])
    (_, _, _, item), = adapters._lora_parametrizations(model)
    assert item.lora_A.shape == (2, 4, 64) and item.scaling == 2.0 and type(item.scaling) is float


def test_add_weight_lora_on_a_peft_model_warns_that_pefts_checkpoints_leave_its_adapters_out(tmp_path):
    """PEFT's save_pretrained (the Trainer's checkpoints of a PEFT model) keeps PEFT's adapters only."""
    from safetensors.torch import load_file

    model = peft.get_peft_model(tiny_model("memoryllm"),
                                peft.LoraConfig(r=2, target_modules=hf_memffn.LORA_TARGET_MODULES["memoryllm"]))
    with pytest.warns(UserWarning, match="weight_lora_state_dict"):
        adapters.add_weight_lora(model, r=2)
    model.save_pretrained(tmp_path)
    assert not any(".parametrizations." in key for key in load_file(tmp_path / "adapter_model.safetensors"))


def checkpoints_own_model(folder):
    """The model of `folder` built from the code saved with it (`transformers_modules.<...>`), as
    `from_pretrained(folder, trust_remote_code=True)` builds it where hf_memffn was not imported first."""
    import json

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    model_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(folder))
    assert model_class.__module__.startswith("transformers_modules.")
    return model_class.from_pretrained(folder).eval()


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_adapters_and_int8_find_the_weights_of_a_model_running_its_checkpoints_code(arch, tmp_path):
    """A model loaded with `trust_remote_code` before hf_memffn is imported runs the code saved with its checkpoint,
    whose FFN classes are not the package's: `add_weight_lora` said the model had no FFN weight that is a plain
    parameter, and `quantize_weights_int8` returned [] having quantized nothing."""
    tiny_model(arch).save_pretrained(tmp_path / "saved")
    package_model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()
    expected = [name for name, _, _ in adapters.parameter_weights(package_model)]
    assert expected
    ids = torch.randint(3, 320, (2, 9))

    model = checkpoints_own_model(tmp_path / "saved")
    assert adapters.add_weight_lora(model, r=2, alpha=4) == expected
    with torch.no_grad():
        for _, _, _, item in adapters._lora_parametrizations(model):
            item.lora_B.normal_()
        adapted = model(ids).logits
    assert adapters.merge_weight_lora(model) == len(expected)
    model.save_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits,
                                   adapted)

    model = checkpoints_own_model(tmp_path / "saved")
    assert adapters.quantize_weights_int8(model) == expected
    assert any(param.dtype == torch.int8 for param in model.parameters())


def test_add_weight_lora_takes_targets_from_a_generator():
    """`targets` was read twice (the unknown names, then the selection): a generator was empty the second time, so
    the call adapted nothing and returned [] (or, with freeze_base, said the model had nothing to adapt)."""
    model = tiny_model("flash_mhf")
    first_layer = [name for name, _, _ in adapters.parameter_weights(model) if ".layers.0." in name]
    assert adapters.add_weight_lora(model, r=2, targets=(name for name in first_layer)) == first_layer
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert len(trainable) == 2 * len(first_layer) and all(".layers.0." in name for name in trainable)


def test_pefts_target_parameters_lora_with_chunked_recompute_is_refused_and_ours_trains():
    """PEFT's `target_parameters` LoRA attaches its delta to the router for its wrapper's forward only: the token
    chunks recomputed in the backward pass (`ffn_recompute_chunk_tokens`) read the router without it, so its adapter
    got no gradient and the other gradients were those of the unadapted router, without an error."""
    ids = torch.randint(3, 320, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=4)).train()
    model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["router"]))
    with pytest.raises(ValueError, match=r"chunk_tokens=4: the FFN weights \['router'\].*add_weight_lora"):
        model(input_ids=ids, labels=ids)
    with torch.no_grad():  # (no backward pass, nothing recomputed)
        model(input_ids=ids)
    # the package's adapters are parametrizations the module holds: the recompute gives the gradients of a plain run
    grads = []
    for chunk_tokens in (0, 4):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=chunk_tokens))
        adapters.add_weight_lora(model.train(), r=2, targets=["model.layers.0.mlp.router"])
        with torch.no_grad():
            model.model.layers[0].mlp.parametrizations.router[0].lora_B.normal_()
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters() if param.requires_grad})
    assert grads[0].keys() == grads[1].keys() and all(grad is not None for grad in grads[1].values())
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-6)


def test_a_trainable_adapter_left_inactive_gets_no_gradient_under_chunked_recompute(tmp_path):
    """A second PEFT adapter loaded trainable (`load_adapter(..., is_trainable=True)`) while the first stays active
    requires gradients that the forward never uses. The token chunks recomputed in the backward pass
    (`ffn_recompute_chunk_tokens`) asked autograd for those too and stopped with "appears to not have been used in
    the graph"; like the plain module, the recompute leaves the inactive adapter without a gradient and gives the
    active one the plain gradients."""
    ids = torch.randint(3, 320, (2, 9), generator=torch.Generator().manual_seed(0))
    config = peft.LoraConfig(r=2, target_modules=hf_memffn.LORA_TARGET_MODULES["flash_mhf"], init_lora_weights=False)
    grads = []
    for chunk_tokens in (0, 4):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=chunk_tokens))
        model = peft.get_peft_model(model, config)
        model.save_pretrained(tmp_path / f"adapter{chunk_tokens}")
        model.load_adapter(tmp_path / f"adapter{chunk_tokens}", adapter_name="other", is_trainable=True)
        assert model.active_adapter == "default"
        assert any(param.requires_grad for name, param in model.named_parameters() if ".other." in name)
        model.train()(input_ids=ids, labels=ids).loss.backward()
        grads.append({name: param.grad for name, param in model.named_parameters() if param.grad is not None})
    plain, recomputed = grads
    assert recomputed.keys() == plain.keys() and plain and not any(".other." in name for name in plain)
    for name in plain:
        torch.testing.assert_close(recomputed[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_peft_integration_adds_switches_saves_and_loads_adapters(arch, tmp_path):
    """transformers' own PEFT integration (`add_adapter`, `disable_adapters`, `load_adapter`), as on its Llama: the
    adapter changes the logits and switches off, trains alone, and a fresh model loading the saved adapter gives the
    adapted logits. The saved folder holds the adapter, no config or weights, so no card of a whole checkpoint."""
    model, ids = tiny_model(arch), torch.randint(3, 300, (2, 9))
    with torch.no_grad():
        base = model(ids).logits
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    try:
        model.add_adapter(config, adapter_name="probe")
    except ValueError as error:  # (transformers from 5.24 asks for a newer PEFT than some installs have)
        if "version of PEFT" not in str(error):
            raise
        pytest.skip(str(error))
    with torch.no_grad():
        adapted = model(ids).logits
        model.disable_adapters()
        switched_off = model(ids).logits
        model.enable_adapters()
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(switched_off, base)
    model.train()
    model(ids, labels=ids).loss.backward()
    trained = {name for name, parameter in model.named_parameters() if parameter.grad is not None}
    assert trained and all(".lora_" in name for name in trained), trained
    model.save_pretrained(tmp_path)
    names = {path.name for path in tmp_path.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and not names & {"config.json", "README.md"}
    fresh = tiny_model(arch)
    fresh.load_adapter(str(tmp_path), adapter_name="probe")
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, adapted)


@pytest.mark.parametrize("arch, target_parameters",
                         [("flash_mhf", ["router"]), ("memoryllm", ["gate_proj", "up_proj"])])
def test_weights_with_pefts_target_parameters_lora_are_refused_ours_and_int8(arch, target_parameters):
    """PEFT's `target_parameters` LoRA registers its delta on the weight for each forward and removes it afterwards;
    on top of this module's LoRA it stayed registered, so every forward added PEFT's delta once more and the logits
    drifted from call to call without an error. Int8 under it failed in the forward with an AttributeError."""
    ids = torch.randint(3, 320, (2, 8), generator=torch.Generator().manual_seed(0))
    config = peft.LoraConfig(r=2, target_modules=["q_proj"], target_parameters=target_parameters,
                             init_lora_weights=False)
    model = peft.get_peft_model(tiny_model(arch), config)
    names = [name for name, _, _ in adapters.parameter_weights(model)]
    pefts = [name for name in names if name.rpartition(".")[2] in target_parameters]
    with pytest.raises(ValueError, match=r"have PEFT's target_parameters LoRA already; pass targets= without them"):
        adapters.add_weight_lora(model, r=2, targets=pefts[:1])
    with pytest.raises(ValueError, match=r"have PEFT's target_parameters LoRA, which int8 weights do not take"):
        adapters.quantize_weights_int8(model)
    assert not any(".parametrizations." in name for name, _ in model.named_parameters())  # nothing changed
    others = [name for name in names if name not in pefts]
    assert add_weight_lora_beside_peft(model, r=2, targets=others) == others
    with torch.no_grad():
        for _, _, _, item in adapters._lora_parametrizations(model):
            item.lora_B.normal_()
        first = model(ids).logits
        torch.testing.assert_close(model(ids).logits, first, rtol=0, atol=0)


@pytest.mark.parametrize("arch, offloaded", [("flash_mhf", "model.layers.1"), ("memoryllm", "model.memory")])
def test_weights_offloaded_by_a_device_map_are_refused_adapters_and_int8(arch, offloaded, tmp_path):
    """A device map with "disk" (or, beside a GPU, "cpu") entries keeps the weights it offloads on the meta device
    between forwards: int8 was computed from the empty meta tensor and replaced it, LoRA built meta adapters, and the
    next forward failed with "Cannot copy out of meta tensor" or a device mismatch inside the FFN."""
    model = tiny_model(arch)
    model.save_pretrained(tmp_path / "model")
    device_map = {name: "cpu" for name in ("model.embed_tokens", "model.rotary_emb", "model.layers.0",
                                           "model.layers.1", "model.norm", "lm_head")}
    if arch == "memoryllm":
        device_map["model.memory"] = "cpu"
    device_map[offloaded] = "disk"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                  offload_folder=tmp_path / "offload").eval()
    ids = torch.randint(3, 320, (2, 8))
    names = [name for name, _, _ in adapters.parameter_weights(loaded) if name.startswith(offloaded)]
    with pytest.raises(ValueError, match=rf"add_weight_lora: \['{names[0]}'.*are on the meta device.*device map"):
        adapters.add_weight_lora(loaded, r=2)
    with pytest.raises(ValueError, match=rf"quantize_weights_int8: \['{names[0]}'.*are on the meta device"):
        adapters.quantize_weights_int8(loaded)
    assert not any(".parametrizations." in name for name, _ in loaded.named_parameters())
    with torch.no_grad():  # (nothing changed: the offloaded weights still load for the forward)
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_adapters_saved_from_a_peft_model_load_into_the_model_it_wraps_and_back(tmp_path):
    """README's order saves `weight_lora_state_dict` of a PEFT model beside PEFT's adapters: its names carry PEFT's
    `base_model.model.` prefix, and loading it into the merged model (`merge_and_unload`) said the state was missing
    every adapter, "add the same adapters with add_weight_lora first", though they had been added."""
    ids = torch.randint(3, 320, (2, 8))
    targets = hf_memffn.LORA_TARGET_MODULES["flash_mhf"]
    model = peft.get_peft_model(tiny_model("flash_mhf"), peft.LoraConfig(r=2, target_modules=targets,
                                                                         init_lora_weights=False))
    add_weight_lora_beside_peft(model, r=2, alpha=4)
    with torch.no_grad():
        for _, _, _, item in adapters._lora_parametrizations(model):
            item.lora_B.normal_()
        adapted = model(ids).logits
    model.save_pretrained(tmp_path)
    state = adapters.weight_lora_state_dict(model)
    assert all(key.startswith("base_model.model.") for key in state)

    merged = peft.PeftModel.from_pretrained(tiny_model("flash_mhf"), tmp_path).merge_and_unload()
    adapters.add_weight_lora(merged, r=2, alpha=4)
    adapters.load_weight_lora(merged, state)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted)
    # and the reverse: adapters saved from the plain model load into a PEFT model of it
    wrapped = peft.PeftModel.from_pretrained(tiny_model("flash_mhf"), tmp_path)
    add_weight_lora_beside_peft(wrapped, r=2, alpha=4)
    adapters.load_weight_lora(wrapped, adapters.weight_lora_state_dict(merged))
    with torch.no_grad():
        torch.testing.assert_close(wrapped(ids).logits, adapted)


def add_memory_adapter(model, how: str):
    """`model` (a MemoryLLM) with an adapter on its FFNs on X0 (`model.model.memory`) that changes their output."""
    if how == "add_weight_lora":
        adapters.add_weight_lora(model, r=2, alpha=4, targets=["model.memory.gate_proj"])
        with torch.no_grad():
            for _, _, _, item in adapters._lora_parametrizations(model):
                item.lora_B.normal_()
        return model
    config = (peft.LoraConfig(r=2, target_parameters=["memory.gate_proj", "memory.down_proj"], init_lora_weights=False)
              if how == "target_parameters" else
              peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["memory"]))
    model = peft.get_peft_model(model, config).eval()
    if how == "modules_to_save":
        with torch.no_grad():
            model.base_model.model.model.memory.modules_to_save["default"].down_proj.mul_(2.0)
    return model


@pytest.mark.parametrize("how", ["target_parameters", "modules_to_save", "add_weight_lora"])
def test_an_adapter_put_on_the_ffns_on_x0_after_load_tols_is_refused_at_inference(how, tmp_path):
    """A token lookup table holds the FFNs on X0 of the weights it was exported from. An adapter put on those FFNs once
    the table is loaded (PEFT's `target_parameters` LoRA or `modules_to_save`, as `PeftModel.from_pretrained` adds
    them; this package's LoRA) was left out without a word: the forward read the table, and its logits were those of
    the model without the adapter; `drop_memory_ffn` dropped it with the FFNs. Both are refused, naming the way back
    to computing the FFNs."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.token_lookup import TokenLookupError

    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    export_tols(tiny_model("memoryllm"), tmp_path, format="fp32", progress=False)
    loaded = tiny_model("memoryllm")
    loaded.load_tols(tmp_path, placement="cpu")
    adapted = add_memory_adapter(loaded, how)
    refused = r"FFNs on X0 \(memory\) have other parameters than when the table was loaded.*unload_tols\(\)"
    with torch.no_grad(), pytest.raises(TokenLookupError, match=refused):
        adapted(input_ids=ids)
    with pytest.raises(TokenLookupError, match=refused):  # (it would go with the FFNs, unseen)
        adapted.drop_memory_ffn()
    adapted.unload_tols()
    with torch.no_grad():
        computed = adapted(input_ids=ids).logits
        assert not torch.allclose(computed, tiny_model("memoryllm")(input_ids=ids).logits)


def test_merging_an_adapter_the_table_was_exported_through_keeps_the_table(tmp_path):
    """A table exported through this package's LoRA on the FFNs on X0 holds the adapted FFNs; `merge_weight_lora`
    then folds those same values into the weights. The forward after the merge was refused as if an adapter had been
    put on the FFNs after `load_tols`; it now reads the table and gives the merged model's logits. Weights other than
    those the table holds (the adapter's parametrization removed without merging) are still refused."""
    from torch.nn.utils import parametrize

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.token_lookup import TokenLookupError

    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    refused = r"FFNs on X0 \(memory\) have other parameters than when the table was loaded"
    for merge in (True, False):
        model = add_memory_adapter(tiny_model("memoryllm"), "add_weight_lora")
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        export_tols(model, tmp_path / str(merge), format="fp32", progress=False)
        model.load_tols(tmp_path / str(merge), placement="cpu")
        if not merge:
            parametrize.remove_parametrizations(model.model.memory, "gate_proj", leave_parametrized=False)
            with torch.no_grad(), pytest.raises(TokenLookupError, match=refused):
                model(input_ids=ids)
            continue
        assert adapters.merge_weight_lora(model) == 1
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected)
        model.drop_memory_ffn()
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, expected)


def test_a_table_kept_through_a_merge_is_not_staged_with_the_merged_weights(tmp_path):
    """The table kept through `merge_weight_lora` records the fingerprint of the adapted weights (base weights and
    adapter tensors), which the merged ones do not have: staged beside them, it was copied into the checkpoint, whose
    `load_tols` then refused it ("computed from other weights"). Refused before anything is written, naming the
    remedy; without the table the merged model stages, and a table exported from it loads with the checkpoint."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.hub import stage_checkpoint
    from hf_memffn.token_lookup import TokenLookupError

    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    model = add_memory_adapter(tiny_model("memoryllm"), "add_weight_lora")
    export_tols(model, tmp_path / "table", format="fp32", progress=False)
    model.load_tols(tmp_path / "table", placement="cpu")
    adapters.merge_weight_lora(model)
    with pytest.raises(TokenLookupError, match=r"would not load with the saved weights.*include_token_lookup=False"):
        stage_checkpoint(model, tmp_path / "staged")
    assert not (tmp_path / "staged").exists()
    stage_checkpoint(model, tmp_path / "staged", include_token_lookup=False)
    model.unload_tols()
    export_tols(model, tmp_path / "staged", format="fp32", progress=False)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "staged").eval()
    loaded.load_tols(tmp_path / "staged", placement="cpu")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def assert_an_exported_table_gives_the_logits(model, folder, ids) -> None:
    """`model`'s table, exported to `folder` and loaded, gives the logits the model computes (it stays loaded)."""
    from hf_memffn.conversion.export import export_tols

    with torch.no_grad():
        expected = model(input_ids=ids).logits
    export_tols(model, folder, format="fp32", progress=False)
    model.load_tols(folder, placement="cpu")
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, expected)


@pytest.mark.parametrize("how", ["target_parameters", "modules_to_save"])
def test_a_peft_adapter_on_the_ffns_on_x0_is_refused_by_export_and_load_tols(how, tmp_path):
    """A PEFT adapter on the FFNs on X0 can be switched off or swapped (`disable_adapter`, `set_adapter`) while a table
    holds one adapter's values, and its `target_parameters` wrapper hides `TokenMemory.forward_layers`, which an export
    that drops layers calls (it stopped with an AttributeError). Export and `load_tols` refuse it, naming the adapter
    and `merge_and_unload`, before anything is written; the merged model exports a table that gives its logits."""
    from hf_memffn.conversion.export import export_tols
    from hf_memffn.token_lookup import TokenLookupError

    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    adapted = add_memory_adapter(tiny_model("memoryllm"), how)
    for drop_layers in ([], [1]):
        with pytest.raises(ValueError, match=r"FFNs on X0 \(memory\) carry parameters that are not their weights "
                                             r"\((base_layer|original_module).*merge_and_unload"):
            export_tols(adapted, tmp_path / "adapted", format="fp32", drop_layers=drop_layers, progress=False)
        assert not (tmp_path / "adapted").exists()
    export_tols(tiny_model("memoryllm"), tmp_path / "base", format="fp32", progress=False)
    with pytest.raises(TokenLookupError, match=r"carry parameters that are not their weights.*merge_and_unload"):
        adapted.get_base_model().load_tols(tmp_path / "base", placement="cpu")
    assert adapted.get_base_model().model.token_lookup is None

    assert_an_exported_table_gives_the_logits(adapted.merge_and_unload(), tmp_path / "merged", ids)


def test_ffns_on_x0_pruned_without_prune_remove_are_refused_by_export_load_tols_and_lookup_naming_the_way_out(
        tmp_path):
    """`torch.nn.utils.prune` leaves `<name>_orig` and a mask on the FFNs on X0 until `prune.remove`: export and
    `load_tols` blamed a PEFT adapter and told to `merge_and_unload`, which a model without PEFT does not have, and a
    prune after `load_tols` was called an adapter. Each names the pruned weight and `prune.remove`; made permanent,
    the pruned model exports a table that gives its logits."""
    from torch.nn.utils import prune

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.token_lookup import TokenLookupError

    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    model = tiny_model("memoryllm")
    export_tols(model, tmp_path / "base", format="fp32", progress=False)
    prune.l1_unstructured(model.model.memory, "gate_proj", amount=0.5)
    refused = r"FFNs on X0 \(memory\) are pruned by torch\.nn\.utils\.prune \(\['gate_proj'\]\).*prune\.remove"
    with pytest.raises(TokenLookupError, match=refused):
        export_tols(model, tmp_path / "pruned", format="fp32", progress=False)
    assert not (tmp_path / "pruned").exists()
    with pytest.raises(TokenLookupError, match=refused):
        model.load_tols(tmp_path / "base", placement="cpu")
    prune.remove(model.model.memory, "gate_proj")
    assert_an_exported_table_gives_the_logits(model, tmp_path / "pruned", ids)
    prune.l1_unstructured(model.model.memory, "up_proj", amount=0.5)
    refused = r"are pruned by torch\.nn\.utils\.prune \(\['up_proj'\]\).*unload_tols"
    with pytest.raises(TokenLookupError, match=refused):
        model(input_ids=ids)
    # prune.remove registers the weight again, last among the parameters, its values set through `.data` (no version
    # bump): the same names in another order stopped the check of the table's sources with an IndexError
    prune.remove(model.model.memory, "up_proj")
    with pytest.raises(TokenLookupError, match=r"a weight registered again, as prune\.remove does.*unload_tols"):
        model(input_ids=ids)
    model.unload_tols()
    with pytest.raises(TokenLookupError, match="computed from other weights"):
        model.load_tols(tmp_path / "pruned", placement="cpu")


PEFT_TUNERS_ON_LINEAR_LAYERS = {
    "dora": lambda targets: peft.LoraConfig(r=2, use_dora=True, target_modules=targets, init_lora_weights=False),
    "loha": lambda targets: peft.LoHaConfig(r=2, target_modules=targets, init_weights=False),
    "lokr": lambda targets: peft.LoKrConfig(r=2, target_modules=targets, init_weights=False),
    "vera": lambda targets: peft.VeraConfig(r=2, target_modules=["q_proj", "v_proj"], init_weights=False),
    "adalora": lambda targets: peft.AdaLoraConfig(init_r=2, target_r=1, total_step=10, target_modules=targets,
                                                  init_lora_weights=False),
}


@pytest.mark.parametrize("tuner", sorted(PEFT_TUNERS_ON_LINEAR_LAYERS))
@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_pefts_other_tuners_on_the_linear_layers_save_load_and_merge_as_on_llama(arch, tuner, tmp_path):
    """README: DoRA, LoHa, LoKr, VeRA and AdaLoRA on `LORA_TARGET_MODULES` change the logits, train, and give the same
    logits loaded back from PEFT's folder and merged (`merge_and_unload`), as transformers' Llama does."""
    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    config = PEFT_TUNERS_ON_LINEAR_LAYERS[tuner](hf_memffn.LORA_TARGET_MODULES[arch])
    with torch.no_grad():
        base = tiny_model(arch)(input_ids=ids).logits
    model = peft.get_peft_model(tiny_model(arch), config)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(param.grad is not None for param in model.parameters() if param.requires_grad)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    assert not torch.allclose(adapted, base)
    model.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_model(arch), tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, adapted, rtol=0, atol=0)
        # (to float32 rounding: the random adapters change the weights by far more than trained ones would)
        torch.testing.assert_close(loaded.merge_and_unload()(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_tuning_on_the_sequence_classifier_reads_each_rows_last_token(arch):
    """README: prefix tuning works with the task heads (PEFT refuses it for Llama's). PEFT extends the padding mask by
    the prefix's columns; the classifier reads each row at its last token among the input's columns, so a padded row
    scores as it does alone."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config(arch, num_labels=3, pad_token_id=0))
    model = peft.get_peft_model(model, peft.PrefixTuningConfig(num_virtual_tokens=3, task_type="SEQ_CLS")).eval()
    with torch.no_grad():
        model.prompt_encoder["default"].embedding.weight.normal_()
    ids = torch.randint(3, 320, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        batch = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, :4], attention_mask=mask[1:, :4]).logits
    torch.testing.assert_close(batch[1:], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_tokens", [0, 4])
def test_pefts_layernorm_tuning_of_flash_mhfs_query_norm_trains_and_merges(chunk_tokens):
    """PEFT's LN tuning (`LNTuningConfig`) replaces FlashMHF's `query_norm` by a layer that runs a trained copy of it;
    the FFN read the norm's weight and epsilon off the module for its fused layer, and stopped with "'LNTuningLayer'
    object has no attribute 'variance_epsilon'". The replaced norm runs as its module: the trained copy gets
    gradients (also recomputed in token chunks) and gives the logits of the merged model."""
    ids = torch.randint(3, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=chunk_tokens))
    with torch.no_grad():
        base = model.eval()(input_ids=ids).logits
    model = peft.get_peft_model(model, peft.LNTuningConfig(target_modules=["query_norm"]))
    tuned = [param for name, param in model.named_parameters() if param.requires_grad]
    assert tuned and all(".query_norm." in name for name, param in model.named_parameters() if param.requires_grad)
    with torch.no_grad():
        for param in tuned:
            param.uniform_(0.5, 1.5)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in tuned)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    assert not torch.allclose(adapted, base)
    torch.testing.assert_close(adapted, merged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["PeftModel.from_pretrained", "load_adapter"])
@pytest.mark.parametrize("variant", ["kvffn", "glu"])
def test_a_peft_adapter_saved_on_kvffns_former_key_and_value_layers_is_refused_naming_the_way_out(how, variant,
                                                                                                    tmp_path):
    """KV-FFN's key and value projections were two Linear layers, `key_proj` and `value_proj`, before they became one,
    `key_value_proj`. A PEFT LoRA adapter saved on them then (the README's targets named both) found no layer of
    those names here: PEFT loaded the rest of it without a word and the model ran without the key/value adapters.
    Refused, naming the key and the way to a checkpoint that loads; the baselines with keys only keep `key_proj`."""
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_config(tiny_config("kvffn", ffn_variant=variant)).eval()
    config = peft.LoraConfig(r=2, target_modules=["q_proj", "key_proj", "value_proj", "out_proj"])
    config.save_pretrained(tmp_path)  # (the layout of an adapter saved by those versions)
    hidden, width = model.config.hidden_size, model.config.intermediate_size
    state = {}
    for layer in range(model.config.num_hidden_layers):
        for module, rows in (("self_attn.q_proj", hidden), ("mlp.key_proj", width), ("mlp.value_proj", width),
                             ("mlp.out_proj", hidden)):
            name = f"base_model.model.model.layers.{layer}.{module}"
            state[f"{name}.lora_A.weight"] = torch.randn(2, hidden if module != "mlp.out_proj" else width)
            state[f"{name}.lora_B.weight"] = torch.randn(rows, 2)
    save_file(state, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"mlp\.(key|value)_proj\.lora_A.*`key_proj` and `value_proj`.*key_value_proj.*"
                                         r"merge_and_unload"):
        if how == "load_adapter":
            model.load_adapter(str(tmp_path))
        else:
            peft.PeftModel.from_pretrained(model, tmp_path)
    # the ReLU and DenseNet baselines still hold `key_proj`: their adapters on it load as they were saved
    relu = AutoModelForCausalLM.from_config(tiny_config("kvffn", ffn_variant="relu")).eval()
    relu.save_pretrained(tmp_path / "relu")
    adapted = peft.get_peft_model(relu, peft.LoraConfig(r=2, target_modules=["key_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "relu_adapter")
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "relu"),
                                            tmp_path / "relu_adapter")
    ids = torch.arange(3, 11).view(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(ids).logits, adapted.eval()(ids).logits)


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_the_adapted_weight_is_the_same_under_autocast_and_merges_exactly_there(arch):
    """Under `torch.autocast` (bf16, float32 weights) the adapter's `B @ A` ran as a bfloat16 matmul, so the weight
    read inside the context, and the one `merge_weight_lora` folded in there (a training loop's context), carried a
    rounded delta: the merged model's logits differed from the adapted model's. The delta is computed in float32
    (its consumers cast the weight to the autocast dtype themselves), so the adapted weight does not depend on the
    caller's autocast."""
    model = tiny_model(arch)
    names = adapters.add_weight_lora(model, r=4)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    module_name, attribute = names[0].rsplit(".", 1)
    module = model.get_submodule(module_name)
    ids = torch.randint(0, 320, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted, expected = getattr(module, attribute).clone(), model(ids).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(getattr(module, attribute), adapted)
            adapters.merge_weight_lora(model)
        assert torch.equal(getattr(module, attribute), adapted)
        torch.testing.assert_close(model(ids).logits, expected, rtol=0, atol=0)
