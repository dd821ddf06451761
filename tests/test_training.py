"""Training through the ecosystem: HF Trainer and PEFT LoRA, for every architecture."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_memffn
from hf_memffn import LORA_TARGET_MODULES
from hf_memffn.testing import tiny_config, train_losses

ARCHS = list(hf_memffn.ARCHITECTURES)


class PatternDataset(torch.utils.data.Dataset):
    """Short repeating token patterns: a tiny model learns them in a few dozen steps."""

    def __init__(self, size=64, length=16, seed=0):
        generator = torch.Generator().manual_seed(seed)
        patterns = torch.randint(3, 320, (4, 4), generator=generator)
        self.rows = [patterns[i % 4].repeat(length // 4) for i in range(size)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        ids = self.rows[index]
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_loss_falls(arch, tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        max_steps=30,
        learning_rate=1e-2,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=PatternDataset())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) >= 5
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_with_cuda_graphs_trains_every_architecture(arch, tmp_path):
    """`torch_compile_mode="reduce-overhead"` (the compiled step replayed from CUDA graphs, for small batches whose
    steps the host bounds): each architecture, with its Triton kernels (FlashMHFLlama's fused layer, the decoder's
    norms and rotations), trains through the Trainer as it does eagerly."""
    tf32 = torch.backends.cuda.matmul.allow_tf32  # (accelerate switches TF32 on for a compiled float32 model)
    try:
        losses = train_eager_and_with_cuda_graphs(tmp_path, arch)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    eager, graphs = losses["eager"], losses["reduce-overhead"]
    assert len(graphs) == len(eager) >= 5 and graphs[-1] < 0.5 * graphs[0], losses
    assert abs(graphs[0] - eager[0]) < 0.05 * eager[0], losses  # the first five steps, before updates compound


def train_eager_and_with_cuda_graphs(tmp_path, arch: str) -> dict:
    """The logged losses of the same tiny model trained eagerly and with CUDA graphs, by mode."""
    # FlashMHFLlama: heads of d_h 64 and a sub-network width the fused layer's kernels take
    overrides = dict(hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton") \
        if arch == "flash_mhf" else {}
    losses = {}
    for mode in ("eager", "reduce-overhead"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).cuda()
        compile_args = {} if mode == "eager" else {"torch_compile": True, "torch_compile_mode": mode}
        args = TrainingArguments(output_dir=str(tmp_path / mode), per_device_train_batch_size=8, max_steps=30,
                                 learning_rate=1e-2, warmup_steps=3, lr_scheduler_type="cosine", logging_steps=5,
                                 save_strategy="no", report_to=[], disable_tqdm=True, seed=0,
                                 tf32=False,  # (torch_compile would switch TF32 on for the whole process)
                                 **compile_args)
        trainer = Trainer(model=model, args=args, train_dataset=PatternDataset())
        trainer.train()
        losses[mode] = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        if arch == "flash_mhf":
            description = model.model.layers[0].mlp.path_description(torch.empty(8, 16, 128, device="cuda"))
            assert description.startswith("fused"), description
    return losses


@pytest.mark.parametrize("arch", ARCHS)
def test_training_twice_with_one_seed_is_bitwise_equal_under_deterministic_algorithms(arch, monkeypatch):
    """Under `torch.use_deterministic_algorithms`, two trainings from one seed end with bitwise equal losses and
    weights, on the CPU and on CUDA (with the kernels: a batch this small splits their loops otherwise, and the split
    programs add their partial sums atomically)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # FlashMHFLlama on CUDA: heads of d_h 64 and a sub-network width the kernels take
    overrides = dict(hidden_size=128, ffn_num_heads=2, intermediate_size=64, ffn_kernel="triton") \
        if arch == "flash_mhf" and device == "cuda" else {}
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (cuBLAS's deterministic setting, read per call)
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        runs = []
        for _ in range(2):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(device)
            data = PatternDataset(size=4)
            batch = torch.stack([data[i]["input_ids"] for i in range(4)]).to(device)
            losses = train_losses(model, batch, list(model.parameters()), lr=1e-2, steps=3)
            runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    (losses, weights), (losses_again, weights_again) = runs
    assert losses == losses_again
    assert all(torch.equal(w, again) for w, again in zip(weights, weights_again))


@pytest.mark.parametrize("arch", ARCHS)
def test_peft_lora_with_documented_targets(arch):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    linear_names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear)}
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGET_MODULES[arch], task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, lora)
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in peft_model.named_parameters()
               if ".lora_A" in name}
    assert adapted == set(LORA_TARGET_MODULES[arch]) & linear_names  # (a list may name another variant's layers)
    trainable = [name for name, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)

    data = PatternDataset(size=8)
    batch = torch.stack([data[i]["input_ids"] for i in range(8)])
    losses = train_losses(peft_model, batch, [p for p in peft_model.parameters() if p.requires_grad], lr=2e-2, steps=15)
    assert losses[-1] < losses[0]

    peft_model.eval()
    with torch.no_grad():
        adapted_logits = peft_model(input_ids=batch).logits
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=batch).logits, adapted_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["flash_mhf", "kvffn", "memoryllm"])
def test_a_saved_checkpoint_loads_back_through_load_state_dict(arch, tmp_path):
    """The HF Trainer resumes (and loads the best checkpoint at the end) with `model.load_state_dict` of the saved
    file, in the checkpoint's tensor names (FlashMHF's `key`/`up`/`value`, KV-FFN's `key_proj`/`value_proj`), not
    through `from_pretrained`: every weight must come back, none left at its initial value."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_config(tiny_config(arch))
    trained.save_pretrained(tmp_path)
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(tiny_config(arch))
    result = fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # (tied to the embedding, which is saved)
    for (name, expected), got in zip(trained.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)



@pytest.mark.parametrize("arch", ["flash_mhf", "kvffn"])
def test_a_sharded_checkpoint_loads_back_one_shard_at_a_time(arch, tmp_path):
    """The HF Trainer resumes from a sharded checkpoint with one `load_state_dict` per shard, and the tensors that
    one parameter is saved as (FlashMHF's `key`/`up`/`value`, KV-FFN's `key_proj`/`value_proj`) may sit in different
    shards: each fills its own rows (they were left at their initial values, with only a warning of unexpected keys).
    A part of the wrong shape is refused, as `load_state_dict` refuses any."""
    from safetensors.torch import load_file
    from transformers.trainer_utils import load_sharded_checkpoint

    torch.manual_seed(0)
    trained = AutoModelForCausalLM.from_config(tiny_config(arch))
    trained.save_pretrained(tmp_path / "whole")
    trained.save_pretrained(tmp_path / "sharded", max_shard_size="8KB")
    saved = load_file(tmp_path / "whole" / "model.safetensors")
    part, sibling = {"flash_mhf": ("up", "key"), "kvffn": ("value_proj.weight", "key_proj.weight")}[arch]
    part, sibling = f"model.layers.0.mlp.{part}", f"model.layers.0.mlp.{sibling}"
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    if arch == "kvffn":  # (transformers writes FlashMHF's three into one shard; other writers need not)
        assert index[part] != index[sibling]
    torch.manual_seed(1)
    one_at_a_time, by_shards = (AutoModelForCausalLM.from_config(tiny_config(arch)) for _ in range(2))
    for name, tensor in saved.items():  # (the finest sharding: a tensor per shard)
        one_at_a_time.load_state_dict({name: tensor}, strict=False)
    load_sharded_checkpoint(by_shards, tmp_path / "sharded", strict=False)
    for loaded in (one_at_a_time, by_shards):
        for (name, expected), got in zip(trained.state_dict().items(), loaded.state_dict().values()):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    with pytest.raises(RuntimeError, match=f"size mismatch for {re.escape(part)}: copying a param with shape"):
        one_at_a_time.load_state_dict({part: saved[part][:1]}, strict=False)


@pytest.mark.parametrize("arch", ["llama", *hf_memffn.ARCHITECTURES])
def test_trainer_label_smoothing_shifts_the_labels(arch, tmp_path):
    """`label_smoothing_factor`: the Trainer computes the loss itself and shifts the labels only for the causal LMs
    transformers lists, which `import hf_memffn` extends by the four architectures."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch)).eval()
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to=[])
    ids = torch.randint(3, 320, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": ids.clone()})
        logits = model(ids).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), label_smoothing=0.1)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", *hf_memffn.ARCHITECTURES])
def test_the_trainer_decays_no_norm_weight_and_no_bias(arch, tmp_path):
    """`weight_decay`: the Trainer's optimizer leaves norm weights and biases out by name, MemoryLLM's RMSNorm
    weights of the FFNs on X0 among them (decayed, they would shrink towards 0 where they start at 1). Checkpoints
    keep those weights under their name `memory.norm_weight`."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    args = TrainingArguments(output_dir=str(tmp_path), weight_decay=0.1, use_cpu=True, report_to=[])
    optimizer = Trainer(model=model, args=args).create_optimizer()
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    decayed = {names[id(parameter)] for group in optimizer.param_groups if group["weight_decay"]
               for parameter in group["params"]}
    assert decayed and not {name for name in decayed if "norm" in name or "bias" in name}
    if arch in ("memoryllm", "flex_memoryllm"):
        model.save_pretrained(tmp_path / "saved")
        saved = load_file(tmp_path / "saved" / "model.safetensors")
        assert "model.memory.norm_weight" in saved and not any("rmsnorm_weight" in name for name in saved)


@pytest.mark.parametrize("arch", ["llama", *ARCHS])
def test_trainer_with_bf16_autocast_trains_every_architecture_on_cpu(arch, tmp_path):
    """`TrainingArguments(bf16=True)` on the CPU (bf16 autocast over float32 weights): each architecture trains as
    transformers' Llama does, its loss falling and its weights staying float32."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12, learning_rate=1e-2,
                             logging_steps=3, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                             bf16=True)
    trainer = Trainer(model=model, args=args, train_dataset=PatternDataset())
    assert trainer.accelerator.mixed_precision == "bf16"
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses
    assert {param.dtype for param in model.parameters()} == {torch.float32}
