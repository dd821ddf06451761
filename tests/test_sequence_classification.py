"""Sequence classification: every architecture has a `*ForSequenceClassification` class behind
`AutoModelForSequenceClassification`, which scores each sequence at its last token as transformers' Llama does, loads
the decoder of a causal LM's checkpoint, round-trips through `save_pretrained`, and trains in the HF Trainer and with
PEFT's LoRA. (Loading it through remote code without the package: `tests/test_remote_code.py`.)"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    Trainer,
    TrainingArguments,
    pipeline,
)

import hf_memffn
from hf_memffn.testing import left_padded, tiny_config, tiny_tokenizer

ARCHS = sorted(hf_memffn.ARCHITECTURES)


def classifier(arch: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(arch, **{"num_labels": 3, "pad_token_id": 0, **overrides})
    return AutoModelForSequenceClassification.from_config(config).eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_each_row_is_scored_at_its_last_token_whatever_the_padding(arch):
    model = classifier(arch)
    assert type(model).__name__ == type(model.model).__name__.replace("Model", "ForSequenceClassification")
    rows = [torch.randint(3, 320, (n,)) for n in (5, 9, 1)]
    with torch.no_grad():
        alone = torch.cat([model(row[None]).logits for row in rows])
        ids, mask = left_padded(rows)
        by_mask = model(ids, attention_mask=mask).logits
        # right padding, found by the pad token alone (no mask: the padding is attended, after the real tokens)
        right = torch.stack([torch.cat([row, torch.zeros(9 - len(row), dtype=torch.long)]) for row in rows])
        by_pad_token = model(right).logits
    assert alone.shape == (3, 3)
    torch.testing.assert_close(by_mask, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_pad_token, alone, rtol=1e-5, atol=1e-5)


def test_a_batch_without_mask_or_pad_token_is_refused():
    model = classifier("kvffn", pad_token_id=None)
    with pytest.raises(ValueError, match="attention_mask.*pad_token_id"):
        model(torch.randint(3, 320, (2, 6)))
    assert model(torch.randint(3, 320, (1, 6))).logits.shape == (1, 3)  # one sequence: its last position


@pytest.mark.parametrize("problem_type, labels, loss", [
    ("single_label_classification", torch.tensor([0, 2]), torch.nn.functional.cross_entropy),
    ("multi_label_classification", torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]),
     torch.nn.functional.binary_cross_entropy_with_logits),
])
def test_the_loss_follows_the_problem_type(problem_type, labels, loss):
    model = classifier("flash_mhf", problem_type=problem_type)
    ids = torch.randint(3, 320, (2, 6))
    output = model(ids, labels=labels)
    torch.testing.assert_close(output.loss, loss(output.logits, labels))


def test_regression_with_one_label():
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(tiny_config("memoryllm", num_labels=1, pad_token_id=0))
    output = model(torch.randint(3, 320, (2, 6)), labels=torch.tensor([0.5, -1.0]))
    assert model.config.problem_type == "regression"
    torch.testing.assert_close(output.loss, torch.nn.functional.mse_loss(output.logits[:, 0], torch.tensor([0.5, -1.0])))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_causal_lms_checkpoint_loads_as_a_classifier_and_round_trips(arch, tmp_path):
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config(arch, pad_token_id=0)).eval()
    lm.save_pretrained(tmp_path / "lm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    ids = torch.randint(3, 320, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids).last_hidden_state, lm.model(ids).last_hidden_state,
                                   rtol=0, atol=0)
        logits = model(ids).logits
    model.save_pretrained(tmp_path / "classifier")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "classifier").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, logits, rtol=0, atol=0)


def _task(count: int = 32, length: int = 8):
    """Sequences labelled by the range their first token falls in (three ranges): learnable in a few steps."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 320, (count, length), generator=generator)
    labels = (ids[:, 0] - 3) * 3 // 317
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels)]


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_trainer_and_lora_train_the_classifier(arch, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = classifier(arch)
    peft_model = get_peft_model(model, LoraConfig(task_type="SEQ_CLS", r=4,
                                                  target_modules=hf_memffn.LORA_TARGET_MODULES[arch]))
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert any("score" in name for name in trainable) and any("lora_" in name for name in trainable)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-2, num_train_epochs=4,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    trainer = Trainer(model=peft_model, args=args, train_dataset=_task())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-4:]) < sum(losses[:4]), losses


def test_text_classification_pipeline(tmp_path):
    tokenizer = tiny_tokenizer()
    model = classifier("kvffn", pad_token_id=tokenizer.pad_token_id)
    classify = pipeline("text-classification", model=model, tokenizer=tokenizer)
    results = classify(["the memory reads", "a key and a value"])
    assert [sorted(result) for result in results] == [["label", "score"]] * 2
    assert {result["label"] for result in results} <= {"LABEL_0", "LABEL_1", "LABEL_2"}


@pytest.mark.parametrize("arch", ["memoryllm", "flex_memoryllm"])
def test_token_lookup_tables_serve_the_classifier(arch, tmp_path):
    """A table exported from the causal LM replaces the classifier's FFNs on X0: the same scores."""
    from hf_memffn.conversion import export_tols

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(arch, pad_token_id=0)).save_pretrained(tmp_path / "lm")
    export_tols(str(tmp_path / "lm"), tmp_path / "table", format="fp32", progress=False)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    ids = torch.randint(3, 320, (2, 7))
    with torch.no_grad():
        computed = model(ids).logits
        model.load_tols(tmp_path / "table", placement="cpu")
        assert model.model.token_lookup is not None
        looked_up = model(ids).logits
    torch.testing.assert_close(looked_up, computed, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mhf_classifier_on_the_fused_layer_matches_the_reference():
    """On a GPU the FlashMHF classifier runs the fused Triton layer; its scores, loss and every gradient match the
    PyTorch reference's (`ffn_kernel="torch"`) on a left-padded batch."""
    from hf_memffn.flash_mhf_op import flash_mhf_path

    assert flash_mhf_path(torch.empty(1, 4, 1, 64, device="cuda")).startswith("triton")
    fields = dict(hidden_size=256, num_attention_heads=4, ffn_num_heads=4, ffn_num_kv_heads=2, intermediate_size=128,
                  ffn_num_subnetworks=2, initializer_range=0.1)
    generator = torch.Generator().manual_seed(1)
    ids, mask = left_padded([torch.randint(3, 320, (n,), generator=generator) for n in (5, 9, 1)])
    labels = torch.tensor([0, 2, 1])
    runs = {}
    for kernel in ("auto", "torch"):
        model = classifier("flash_mhf", ffn_kernel=kernel, **fields).cuda().train()
        output = model(ids.cuda(), attention_mask=mask.cuda(), labels=labels.cuda())
        output.loss.backward()
        runs[kernel] = output, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    (fused, fused_grads), (reference, reference_grads) = runs["auto"], runs["torch"]
    torch.testing.assert_close(fused.logits, reference.logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(fused.loss, reference.loss, rtol=1e-3, atol=1e-3)
    assert fused_grads.keys() == reference_grads.keys() and any("mlp" in name for name in fused_grads)
    for name, grad in fused_grads.items():
        error = (grad - reference_grads[name]).norm() / reference_grads[name].norm().clamp_min(1e-12)
        assert error < 1e-2, (name, error.item())
