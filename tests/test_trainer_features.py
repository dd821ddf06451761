"""HF Trainer features and PEFT methods beyond LoRA, each architecture against transformers' Llama or a hand
computation: gradient accumulation (causal LM and sequence classifier), NEFTune, padding-free packing, evaluation and
prediction, resuming, prefix tuning, prompt tuning, IA3, gradient checkpointing with LoRA."""

from __future__ import annotations

import importlib.metadata
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import hf_memffn
from hf_memffn import LORA_TARGET_MODULES
from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import (activation_checkpointing_arguments, is_activation_checkpointing, logged_records,
                               tiny_config)

ARCHS = list(hf_memffn.ARCHITECTURES)
WITH_LLAMA = ["llama", *ARCHS]


class VariedLengths(torch.utils.data.Dataset):
    """Token sequences of different lengths, padded by `pad_right`."""

    def __init__(self, lengths=(5, 12, 3, 9), seed=0):
        generator = torch.Generator().manual_seed(seed)
        self.rows = [torch.randint(3, 320, (length,), generator=generator).tolist() for length in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index]}


def pad_right(features):
    """input_ids padded with 0, labels -100 and attention_mask 0 on the padding."""
    width = max(len(feature["input_ids"]) for feature in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, feature in enumerate(features):
        ids[row, : len(feature["input_ids"])] = torch.tensor(feature["input_ids"])
        mask[row, : len(feature["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build(arch, **overrides):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))


def arguments(tmp_path, **overrides):
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1, learning_rate=1e-2,
                  optim="sgd", lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True,
                  disable_tqdm=True, seed=0)
    return TrainingArguments(**{**fields, **overrides})


def trainable_state(model):
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def assert_same_state(got, expected, atol=1e-7):
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("arch", WITH_LLAMA)
def test_gradient_accumulation_gives_the_update_of_one_batch(arch, tmp_path):
    """Four accumulated steps of one padded sequence each update the weights as one step on the four: the model
    divides its summed loss by the Trainer's `num_items_in_batch` (the label tokens of all four), not by each
    sequence's own count, which would weigh the short sequences up."""
    states = []
    for batch, accumulation in ((4, 1), (1, 4)):
        model = build(arch)
        args = arguments(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation)
        trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(), data_collator=pad_right)
        assert trainer.model_accepts_loss_kwargs
        trainer.train()
        states.append(trainable_state(model))
    assert_same_state(states[1], states[0], atol=1e-6)


class LabelledLengths(VariedLengths):
    """`VariedLengths` with a class label per sequence (`label`) or a score (`score`)."""

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "label": index % 3, "score": index / 4}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("problem_type", ["single_label_classification", "regression"])
def test_gradient_accumulation_of_a_sequence_classifier_gives_the_update_of_one_batch(arch, problem_type, tmp_path):
    """The sequence classifier's loss is each batch's mean, whatever `num_items_in_batch` says: the Trainer must
    divide it by the accumulation steps itself (transformers' Llama takes the count and drops it, and its four
    accumulated steps update the weights four times as much as one step on the four sequences)."""
    from transformers import AutoModelForSequenceClassification

    num_labels = 3 if problem_type == "single_label_classification" else 1

    def collate(features):
        batch = pad_right(features)
        key = "label" if num_labels > 1 else "score"
        batch["labels"] = torch.tensor([feature[key] for feature in features])
        return batch

    updates = []
    for batch, accumulation in ((4, 1), (1, 4)):
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(
            tiny_config(arch, num_labels=num_labels, problem_type=problem_type, pad_token_id=0))
        initial = trainable_state(model)
        args = arguments(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                         max_grad_norm=0.0, remove_unused_columns=False)
        Trainer(model=model, args=args, train_dataset=LabelledLengths(), data_collator=collate).train()
        updates.append({name: value - initial[name] for name, value in trainable_state(model).items()})
    assert_same_state(updates[1], updates[0], atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_accumulation_of_a_token_classifier_gives_the_update_of_one_batch(arch, tmp_path):
    """The token classifier's loss is summed over the labelled tokens and divided by the Trainer's
    `num_items_in_batch`, as the causal LM's is (transformers' Llama drops the count and takes each batch's mean,
    which the Trainer, having passed the count, does not divide by the accumulation steps)."""
    from transformers import AutoModelForTokenClassification

    def collate(features):
        batch = pad_right(features)
        batch["labels"] = batch["labels"].remainder(3).masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    updates, losses = [], []
    for batch, accumulation in ((4, 1), (1, 4)):
        torch.manual_seed(0)
        model = AutoModelForTokenClassification.from_config(
            tiny_config(arch, num_labels=3, pad_token_id=0, classifier_dropout=0.0))
        initial = trainable_state(model)
        args = arguments(tmp_path, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                         max_grad_norm=0.0, logging_steps=1)
        trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(), data_collator=collate)
        trainer.train()
        updates.append({name: value - initial[name] for name, value in trainable_state(model).items()})
        losses.append(next(record["loss"] for record in trainer.state.log_history if "loss" in record))
    assert_same_state(updates[1], updates[0], atol=1e-6)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)


def test_evaluate_and_predict(tmp_path):
    """`evaluate` with `prediction_loss_only` and `predict` with logits: the loss is the mean of the batches' losses
    (as for Llama), the predictions the logits padded across batches, without the cache."""
    model = build("memoryllm").eval()
    data = VariedLengths(lengths=(5, 12, 3, 9, 7))
    with torch.no_grad():
        batches = [pad_right([data[i] for i in range(start, min(start + 2, len(data)))]) for start in (0, 2, 4)]
        losses = [model(**batch).loss * len(batch["input_ids"]) for batch in batches]
        logits = model(**batches[0]).logits
    expected = (sum(losses) / len(data)).item()
    args = arguments(tmp_path, per_device_eval_batch_size=2, prediction_loss_only=True)
    metrics = Trainer(model=model, args=args, data_collator=pad_right).evaluate(data)
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)
    output = Trainer(model=model, args=arguments(tmp_path, per_device_eval_batch_size=2),
                     data_collator=pad_right).predict(data)
    assert output.metrics["test_loss"] == pytest.approx(expected, rel=1e-5)
    assert output.predictions.shape == (5, 12, 320)
    torch.testing.assert_close(torch.from_numpy(output.predictions[:2, :12]), logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ["memoryllm", "flex_memoryllm"])
def test_neftune_noise_reaches_the_ffns_on_x0(arch, tmp_path):
    """NEFTune (`neftune_noise_alpha`) adds its noise to the output of `get_input_embeddings()`: that noisy X0 is
    what both the residual stream and the FFNs on the token embeddings read in training; evaluation is noise-free.
    The Trainer removes its hook after training, and counts the non-padding input tokens it saw."""
    from transformers.integrations.neftune import activate_neftune, deactivate_neftune

    model = build(arch).train()
    ids = torch.randint(3, 320, (2, 8), generator=torch.Generator().manual_seed(1))
    seen = {}
    model.model.memory.register_forward_pre_hook(lambda module, args: seen.__setitem__("x0", args[0]))
    model.model.layers[0].register_forward_pre_hook(lambda module, args: seen.__setitem__("stream", args[0]))
    with torch.no_grad():
        clean = model(ids).logits
        handle = activate_neftune(model, 5.0)
        noisy = model(ids).logits
        assert seen["x0"] is seen["stream"]
        assert not torch.equal(seen["x0"], model.get_input_embeddings().weight[ids])
        model.eval()
        torch.testing.assert_close(model(ids).logits, clean, rtol=0, atol=0)
        deactivate_neftune(model, handle)
    assert not torch.allclose(noisy, clean, atol=1e-3)

    model.train()
    args = arguments(tmp_path, neftune_noise_alpha=5.0, max_steps=2, include_num_input_tokens_seen="non_padding")
    trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(), data_collator=pad_right)
    trainer.train()
    assert trainer.state.num_input_tokens_seen == 5 + 12 + 3 + 9
    assert not model.get_input_embeddings()._forward_hooks


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_sequences_stay_apart_in_training(arch):
    """`DataCollatorWithFlattening` packs sequences into one row whose `position_ids` restart at 0, with no
    attention mask. In a training step (the config's `use_cache=True`, as the Trainer given `use_cache=True` runs it)
    each sequence must attend to itself only: the logits and the loss are those of the sequences run one by one."""
    from transformers import DataCollatorWithFlattening

    model = build(arch).train()
    data = VariedLengths()
    packed = DataCollatorWithFlattening()([data[i] for i in range(len(data))])
    with torch.no_grad():
        output = model(**packed)
        alone = [model(input_ids=torch.tensor([data[i]["input_ids"]])) for i in range(len(data))]
        per_sequence = [model(input_ids=torch.tensor([row["input_ids"]]), labels=torch.tensor([row["input_ids"]]))
                        for row in data]
    torch.testing.assert_close(output.logits[0], torch.cat([out.logits[0] for out in alone]), rtol=1e-5, atol=1e-5)
    label_counts = [len(row["input_ids"]) - 1 for row in data]
    expected = sum(out.loss * count for out, count in zip(per_sequence, label_counts)) / sum(label_counts)
    torch.testing.assert_close(output.loss, expected, rtol=1e-5, atol=1e-6)


def test_resume_from_checkpoint_gives_the_uninterrupted_weights(tmp_path):
    """Trainer(resume_from_checkpoint=...) from the middle of a run ends on the weights of the run left alone
    (AdamW, warmup and cosine, shuffled batches, gradient accumulation, dropout in the FFN and the attention)."""
    states = []
    for resume in (None, str(tmp_path / "checkpoint-2")):
        model = build("kvffn", kvffn_dropout=0.2, attention_dropout=0.1)
        args = arguments(tmp_path, max_steps=4, optim="adamw_torch", lr_scheduler_type="cosine", warmup_steps=1,
                         gradient_accumulation_steps=2, save_strategy="steps", save_steps=2)
        data = VariedLengths((5, 12, 3, 9) * 4)
        trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=pad_right)
        trainer.train(resume_from_checkpoint=resume)
        states.append(trainable_state(model))
    assert_same_state(states[1], states[0], atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_resume_from_a_sharded_checkpoint_gives_the_uninterrupted_weights(arch, tmp_path):
    """Resuming from a sharded checkpoint (the Trainer's own past 50GB, here resaved in small shards) loads every
    weight shard by shard, the parts of a joined weight in different shards included: the run ends on the weights of
    the run left alone. transformers logs the joined weights missing and their checkpoint tensors unexpected (it
    compares names without the checkpoint conversions, see the README): nothing else is logged missing or unexpected."""

    def run(resume):
        model = build(arch)
        args = arguments(tmp_path, max_steps=4, optim="adamw_torch", save_strategy="steps", save_steps=2)
        trainer = Trainer(model=model, args=args, train_dataset=VariedLengths((5, 12, 3, 9) * 4),
                          data_collator=pad_right)
        trainer.train(resume_from_checkpoint=resume)
        return trainable_state(model)

    uninterrupted = run(None)
    checkpoint = tmp_path / "checkpoint-2"
    saved = AutoModelForCausalLM.from_pretrained(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    saved.save_pretrained(checkpoint, max_shard_size="20KB")
    assert len(list(checkpoint.glob("model-*.safetensors"))) > 2
    with logged_records() as records:
        resumed = run(str(checkpoint))
    assert_same_state(resumed, uninterrupted, atol=0)
    joined = r"mlp\.key_up_value|mlp\.key_value_proj\.(weight|bias)|memory\.rmsnorm_weight"
    parts = r"mlp\.(key|up|value)|mlp\.(key|value)_proj\.(weight|bias)|memory\.norm_weight"
    for record in records:
        message = record.getMessage()
        for kind, allowed in (("missing", joined), ("unexpected", parts)):
            if f"There were {kind} keys" in message:
                names = re.findall(r"'([^']+)'", message)
                assert names and all(re.fullmatch(rf"model\.(layers\.\d+\.)?({allowed})", name) for name in names), (
                    message)


@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_checkpointing_with_lora_in_the_trainer(arch, tmp_path):
    """`gradient_checkpointing=True` (reentrant checkpoints, which need `enable_input_require_grads`, which PEFT
    calls) with a LoRA model gives the update of a run without checkpointing, every adapter trained."""
    peft = pytest.importorskip("peft")
    states = []
    for checkpointing in (False, True):
        model = build(arch)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGET_MODULES[arch], task_type="CAUSAL_LM",
                               init_lora_weights=False)
        peft_model = peft.get_peft_model(model, lora)
        initial = trainable_state(peft_model)
        args = arguments(tmp_path, per_device_train_batch_size=4,
                         **activation_checkpointing_arguments(checkpointing, {"use_reentrant": True}))
        Trainer(model=peft_model, args=args, train_dataset=VariedLengths(), data_collator=pad_right).train()
        assert is_activation_checkpointing(model) == checkpointing
        states.append(trainable_state(peft_model))
        assert not [name for name in initial if torch.equal(initial[name], states[-1][name])]
    assert_same_state(states[1], states[0], atol=1e-6)


def peft_passes_generates_cache() -> bool:
    """PEFT 0.22 and later give prefix tuning's prefix and prompt tuning's virtual tokens to generate() under the
    cache argument transformers has (`cache` from 5.24); earlier ones under `past_key_values` only."""
    from packaging.version import Version

    return Version(importlib.metadata.version("peft")) >= Version("0.22")


def greedy_by_forward(model, ids, steps):
    """Greedy continuation of `ids`, each step one forward of the whole sequence (no cache)."""
    with torch.no_grad():
        for _ in range(steps):
            next_token = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, -1].argmax(-1)
            ids = torch.cat([ids, next_token[:, None]], dim=1)
    return ids


@pytest.mark.parametrize("arch", WITH_LLAMA)
def test_prefix_tuning(arch):
    """PEFT prefix tuning hands the model its prefix as a key/value cache (`past_key_values`). A prefix holding the
    keys and values of a real prompt gives the logits of that prompt followed by the input; training reaches the
    prefix. In generate(), transformers 5.24 passes its own `cache` beside it, which PEFT does not know: our models
    refuse the two caches with an error that names the case (transformers' Llama drops the prefix silently)."""
    peft = pytest.importorskip("peft")
    model = build(arch).eval()
    generator = torch.Generator().manual_seed(1)
    prompt, ids = torch.randint(3, 320, (1, 4), generator=generator), torch.randint(3, 320, (2, 6), generator=generator)
    with torch.no_grad():
        expected = model(torch.cat([prompt.expand(2, -1), ids], dim=1)).logits[:, 4:]
        cache = getattr(model(prompt, use_cache=True), CACHE_KWARG)
    peft_model = peft.get_peft_model(model, peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    layers = [tensor[0] for index in range(model.config.num_hidden_layers)
              for tensor in (cache.layers[index].keys, cache.layers[index].values)]  # each [H_kv, 4, D]
    embedding = peft_model.prompt_encoder["default"].embedding.weight
    with torch.no_grad():
        embedding.copy_(torch.stack(layers).permute(2, 0, 1, 3).reshape(4, -1))
        got = peft_model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    peft_model.train()
    peft_model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss.backward()
    assert embedding.grad is not None and embedding.grad.abs().sum() > 0

    peft_model.eval()
    if CACHE_KWARG == "past_key_values" or peft_passes_generates_cache():  # the prefix is generate()'s cache
        generated = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                        do_sample=False)
        assert torch.equal(generated, greedy_by_forward(peft_model, ids, 3))
    elif arch != "llama":
        with pytest.raises(ValueError, match="prefix tuning"):
            peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3)


@pytest.mark.parametrize("arch", WITH_LLAMA)
@pytest.mark.parametrize("method", ["prompt_tuning", "ia3"])
def test_prompt_tuning_and_ia3(arch, method):
    """Prompt tuning (the model gets `inputs_embeds`: learned virtual tokens, then the embedded input; MemoryLLM's
    FFNs on X0 read those embeddings) and IA3 (scales of linear layers): a forward, a training step that reaches
    the adapter, and generate(), as for Llama. (On transformers 5.24 PEFT's prompt tuning prepends its virtual
    tokens again at each decoding step, for Llama too, so its generate() is only run here.)"""
    peft = pytest.importorskip("peft")
    model = build(arch)
    if method == "ia3":
        feedforward = {"llama": "down_proj", "flex_memoryllm": "down_proj", "memoryllm": "o_proj"}.get(arch, "out_proj")
        config = peft.IA3Config(task_type="CAUSAL_LM", target_modules=["k_proj", "v_proj", feedforward],
                                feedforward_modules=[feedforward])
    else:
        config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
    peft_model = peft.get_peft_model(model, config)
    if method == "ia3":
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if parameter.requires_grad:
                    parameter.uniform_(0.5, 1.5)
    batch = pad_right([VariedLengths()[i] for i in range(4)])
    peft_model.train()
    peft_model(**batch).loss.backward()
    grads = [p.grad for p in peft_model.parameters() if p.requires_grad]
    assert grads and all(grad is not None and grad.abs().sum() > 0 for grad in grads)

    peft_model.eval()
    ids = batch["input_ids"][1:2]  # the longest row, unpadded
    generated = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                    do_sample=False, min_new_tokens=3)
    assert generated.shape == (1, ids.shape[1] + 3)
    if method == "ia3":
        assert torch.equal(generated, greedy_by_forward(peft_model, ids, 3))


@pytest.mark.skipif(CACHE_KWARG == "past_key_values", reason="before transformers 5.24 PEFT finds generate()'s cache")
@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_tunings_cached_generate_with_a_padding_mask_names_the_case_and_its_way_out(arch):
    """On transformers 5.24 PEFT before 0.22 looks for generate()'s cache under `past_key_values`, and its prompt
    tuning prepends its virtual tokens again at each decoding step. With a padding mask our models refuse that step's
    mask; the error said to extend the mask in a decoding loop, which a generate() call has not. It names the case,
    and generate(use_cache=False), which decodes as forwards of the whole sequence do. PEFT 0.22 finds the cache:
    the cached generate() decodes as those forwards too."""
    peft = pytest.importorskip("peft")
    peft_model = peft.get_peft_model(build(arch), peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                          num_virtual_tokens=3)).eval()
    ids = torch.randint(3, 320, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    expected, grown_mask = ids, mask
    with torch.no_grad():
        for _ in range(3):
            logits = peft_model(input_ids=expected, attention_mask=grown_mask).logits
            expected = torch.cat([expected, logits[:, -1].argmax(-1)[:, None]], dim=1)
            grown_mask = torch.cat([grown_mask, torch.ones_like(grown_mask[:, :1])], dim=1)
    greedy = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert torch.equal(peft_model.generate(input_ids=ids, use_cache=False, **greedy), expected)
    if peft_passes_generates_cache():
        assert torch.equal(peft_model.generate(input_ids=ids, **greedy), expected)
    else:
        with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 10\).*PEFT's prompt tuning before 0.22 "
                                             r"gives such a mask in generate\(\) on transformers >= 5.24.*"
                                             r"peft>=0.22, or generate with use_cache=False"):
            peft_model.generate(input_ids=ids, **greedy)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_packed_sequences_marked_by_flash_attention_kwargs_alone_stay_apart(arch, implementation):
    """`DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)` marks the sequences of a
    packed row by `cu_seq_lens_q` alone, which only flash attention reads: sdpa and eager attention let the sequences
    attend to each other, silently (transformers' Llama too). The decoder takes positions restarting at each start that
    `cu_seq_lens_q` marks, so every attention keeps the sequences apart: the logits and the loss are those of the
    sequences run one by one, as with the collator's `position_ids`. Boundaries that do not cover the row are refused
    naming them."""
    from transformers import DataCollatorWithFlattening

    model = build(arch).eval()
    model.set_attn_implementation(implementation)
    features = [VariedLengths()[i] for i in range(len(VariedLengths()))]
    kwargs_alone = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)(features)
    assert "position_ids" not in kwargs_alone
    with torch.no_grad():
        expected = model(**DataCollatorWithFlattening()(features))
        alone = torch.cat([model(input_ids=torch.tensor([row["input_ids"]])).logits[0] for row in features])
        output = model(**kwargs_alone)
        torch.testing.assert_close(expected.logits[0], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(output.logits[0], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(output.loss, expected.loss, rtol=1e-6, atol=1e-6)
        for bounds in ([0, 5, 17, 20], [1, 5, 17, 29]):
            with pytest.raises(ValueError, match=rf"cu_seq_lens_q is {re.escape(str(bounds))}: .*from 0 to the 29 "
                                                 r"tokens"):
                model(**{**kwargs_alone, "cu_seq_lens_q": torch.tensor(bounds, dtype=torch.int32)})


@pytest.mark.parametrize("arch", ARCHS)
def test_trainer_steps_on_flattened_batches_give_the_updates_of_padded_batches(arch, tmp_path):
    """The Trainer with `DataCollatorWithFlattening` (each batch one row of packed sequences, `position_ids`
    restarting at 0, labels -100 at each sequence start) takes the steps it takes on the same batches padded: the
    sequences stay apart and the loss is divided by the same label tokens. `use_cache=True`, which transformers 5.25's
    Trainer sets on the config (False by default), leaves it so (its Llama then lets the sequences attend to each
    other)."""
    from transformers import DataCollatorWithFlattening

    states = []
    for collator in (pad_right, DataCollatorWithFlattening()):
        model = build(arch)
        args = arguments(tmp_path, max_steps=2, use_cache=True)
        trainer = Trainer(model=model, args=args, train_dataset=VariedLengths(), data_collator=collator)
        trainer.train()
        assert model.config.use_cache
        states.append(trainable_state(model))
    assert_same_state(states[1], states[0], atol=1e-6)
