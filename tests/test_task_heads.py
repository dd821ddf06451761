"""The task heads beside the causal LM, as transformers' Llama has them: every architecture has a
`*ForSequenceClassification`, a `*ForTokenClassification` and a `*ForQuestionAnswering` class behind their Auto classes.
Each loads the decoder of a causal LM's checkpoint, round-trips through `save_pretrained`, gives each row of a padded
batch what the row alone gets, trains in the HF Trainer and with PEFT's LoRA, and runs in its pipeline. (Loading them
through remote code without the package: `tests/test_remote_code.py`.)"""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Trainer,
    TrainingArguments,
    pipeline,
)

import hf_memffn
from hf_memffn.modeling_memffn import CACHE_KWARG
from hf_memffn.testing import left_padded, logged_records, tiny_config, tiny_tokenizer

ARCHS = sorted(hf_memffn.ARCHITECTURES)
HEADS = [AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoModelForQuestionAnswering]


def head_model(auto_class, arch: str, **overrides):
    torch.manual_seed(0)
    config = tiny_config(arch, **{"num_labels": 3, "pad_token_id": 0, **overrides})
    return auto_class.from_config(config).eval()


def classifier(arch: str, **overrides):
    return head_model(AutoModelForSequenceClassification, arch, **overrides)


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
    with pytest.raises(ValueError, match="attention_mask.*pad_token_id"):  # as Llama's, for embeddings too
        model(inputs_embeds=torch.randn(2, 6, model.config.hidden_size))


def test_a_4d_mask_that_cannot_show_the_padding_is_named_in_the_refusal_and_the_warning():
    """A 4-D mask says which keys each query attends to, not which tokens are padding, so the last token of each row
    is found as without a mask. The refusal told the caller, who had passed `attention_mask`, to pass
    `attention_mask`; it now asks for a 2-D one and says that the 4-D one marks no padding, as the warning for
    embeddings does."""
    model = classifier("kvffn", pad_token_id=None)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    with pytest.raises(ValueError, match=r"needs a 2-D `attention_mask`.*pad_token_id.*4-D `attention_mask` marks no"):
        model(torch.randint(3, 320, (2, 6)), attention_mask=causal)
    model = classifier("kvffn")
    with logged_records() as records:
        model(inputs_embeds=torch.randn(2, 6, model.config.hidden_size), attention_mask=causal)
    assert len(records) == 1 and "4-D `attention_mask` marks no padding" in records[0].getMessage()


def test_a_batch_of_embeddings_without_mask_warns_that_padding_goes_unseen():
    """A batch of embeddings without `attention_mask` is scored at its last position: `config.pad_token_id` cannot
    find padding in embeddings. Llama warns about this; these models scored padded rows at a padding token silently.
    The warning comes once per model, and not with a mask or for a single sequence."""
    model = classifier("kvffn")
    embeds = torch.randn(2, 6, model.config.hidden_size)
    with logged_records() as records:
        model(inputs_embeds=embeds[:1])
        model(inputs_embeds=embeds, attention_mask=torch.ones(2, 6, dtype=torch.long))
        assert not records
        model(inputs_embeds=embeds)
        model(inputs_embeds=embeds)
    assert len(records) == 1 and records[0].levelname == "WARNING"
    assert re.search(r"inputs_embeds.*attention_mask", records[0].getMessage())


def test_a_row_continued_from_a_cache_is_scored_as_in_one_forward():
    """With a key/value cache the 2-D mask covers the cached tokens too; the new tokens are its last columns."""
    model = classifier("kvffn")
    ids = torch.randint(3, 320, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        whole = model(ids, attention_mask=mask).logits
        first = model(ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        continued = model(ids[:, 4:], attention_mask=mask, **{CACHE_KWARG: getattr(first, CACHE_KWARG)}).logits
    torch.testing.assert_close(continued, whole, rtol=1e-5, atol=1e-5)


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
def test_each_token_is_labelled_and_each_answer_span_scored_as_in_its_row_alone(arch):
    """The token classifier and the question-answering model score every token: in a left-padded batch each row's
    tokens get what the row alone gets."""
    rows = [torch.randint(3, 320, (n,)) for n in (5, 9, 1)]
    ids, mask = left_padded(rows)
    for auto_class in (AutoModelForTokenClassification, AutoModelForQuestionAnswering):
        model = head_model(auto_class, arch)
        assert type(model).__name__ == type(model.model).__name__.replace("Model", auto_class.__name__[9:])
        with torch.no_grad():
            batch = model(ids, attention_mask=mask).to_tuple()  # (logits,) or (start_logits, end_logits)
            assert [tuple(scores.shape) for scores in batch] in ([(3, 9, 3)], [(3, 9), (3, 9)])
            for index, row in enumerate(rows):
                for batched, alone in zip(batch, model(row[None]).to_tuple()):
                    torch.testing.assert_close(batched[index, -len(row):], alone[0], rtol=1e-5, atol=1e-5)


def test_token_labels_of_minus_100_are_left_out_of_the_loss():
    """Cross-entropy over the labelled tokens; dropout before the head, `config.classifier_dropout` (0.1 unset)."""
    model = head_model(AutoModelForTokenClassification, "kvffn")
    assert model.dropout.p == 0.1
    assert head_model(AutoModelForTokenClassification, "kvffn", classifier_dropout=0.0).dropout.p == 0.0
    ids, labels = torch.randint(3, 320, (2, 6)), torch.randint(0, 3, (2, 6))
    labels[0, :2] = labels[1, 4:] = -100
    output = model(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(output.logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(output.loss, expected)


def test_the_token_classifier_reads_hidden_dropout_and_its_bias_option_as_llamas():
    """transformers' Llama takes the token classifier's dropout from `config.hidden_dropout` when
    `classifier_dropout` is unset, and leaves the head's bias out with `config.token_classification_bias=False`; these
    heads kept 0.1 and a bias whatever those fields said."""
    model = head_model(AutoModelForTokenClassification, "kvffn", hidden_dropout=0.0, token_classification_bias=False)
    assert model.dropout.p == 0.0 and model.score.bias is None
    assert head_model(AutoModelForTokenClassification, "kvffn", hidden_dropout=0.2,
                      classifier_dropout=0.3).dropout.p == 0.3  # (classifier_dropout first, as Llama's)
    with pytest.raises(ValueError, match=r"`hidden_dropout`.*\[0, 1\)"):
        tiny_config("kvffn", hidden_dropout=1.5)
    with pytest.raises(ValueError, match=r"`token_classification_bias`.*True or False"):
        tiny_config("kvffn", token_classification_bias="no")


@pytest.mark.parametrize("classifier_dropout", [1.5, -0.1, "0.1"])
def test_a_bad_classifier_dropout_is_refused_naming_the_field(classifier_dropout):
    """The token classifier's dropout probability is checked with the config (also one set by hand before the head
    is built), instead of failing inside `nn.Dropout` without naming the field."""
    with pytest.raises(ValueError, match=r"`classifier_dropout`.*\[0, 1\)"):
        tiny_config("kvffn", classifier_dropout=classifier_dropout)
    config = tiny_config("memoryllm", num_labels=3)
    config.classifier_dropout = classifier_dropout
    with pytest.raises(ValueError, match=r"`classifier_dropout`.*\[0, 1\)"):
        AutoModelForTokenClassification.from_config(config)


def test_a_bad_problem_type_or_label_count_is_refused_naming_the_field(tmp_path):
    """A misspelt `problem_type` was taken and failed only at the first labelled batch (`Invalid problem type`), and
    `num_labels=0` built a classifier with no outputs; both are now refused with the config, naming the field (also
    when given to `from_pretrained`, and when set by hand before the head is built)."""
    # (transformers 5.17 checks the field itself, in its own words and with huggingface_hub's error class)
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        StrictDataclassError = ValueError
    refused = (ValueError, TypeError, StrictDataclassError)
    problem_type = r"(?s)problem_type.*multi_label.*'regression', '?single_label_classification"
    for fields, message in (({"problem_type": "multi_label"}, problem_type),
                            ({"num_labels": 0}, r"`num_labels`=0 is invalid: must be >= 1")):
        with pytest.raises(refused, match=message):
            tiny_config("kvffn", **fields)
    AutoModelForCausalLM.from_config(tiny_config("flash_mhf", pad_token_id=0)).save_pretrained(tmp_path / "lm")
    with pytest.raises(refused, match=problem_type):
        AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", problem_type="multi_label")
    config = tiny_config("memoryllm", pad_token_id=0)
    with pytest.raises(refused, match=problem_type):
        config.problem_type = "multi_label"  # (refused here by transformers 5.17, by the head's build from 5.25)
        AutoModelForSequenceClassification.from_config(config)
    for problem_type in (None, "regression", "single_label_classification", "multi_label_classification"):
        tiny_config("kvffn", problem_type=problem_type)


def test_a_label_count_of_numpy_integer_type_is_taken_as_transformers_takes_it(tmp_path):
    """`num_labels=labels.max() + 1` over a NumPy array of labels is a NumPy integer, which transformers (and Llama)
    count labels with: the check of the field's type refused it, also when given to `from_pretrained`."""
    import numpy

    labels = numpy.array([0, 2, 1, 2])
    config = tiny_config("kvffn", num_labels=labels.max() + 1, pad_token_id=0)
    assert config.num_labels == 3 and type(config.num_labels) is int
    AutoModelForCausalLM.from_config(tiny_config("memoryllm", pad_token_id=0)).save_pretrained(tmp_path / "lm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=labels.max() + 1)
    assert model.score.weight.shape[0] == 3
    with pytest.raises(ValueError, match=r"`num_labels`=np.True_ is invalid: must be >= 1"):
        tiny_config("kvffn", num_labels=numpy.bool_(True))


def test_the_answer_span_loss_averages_start_and_end_and_ignores_positions_past_the_end():
    """As Llama's: a position past the end is ignored; a negative one (-100 too) is clamped to 0 and scored."""
    model = head_model(AutoModelForQuestionAnswering, "flash_mhf")
    ids, start, end = torch.randint(3, 320, (2, 6)), torch.tensor([1, 4]), torch.tensor([2, 9])
    output = model(ids, start_positions=start, end_positions=end)
    cross_entropy = torch.nn.functional.cross_entropy
    expected = (cross_entropy(output.start_logits, start) + cross_entropy(output.end_logits[:1], end[:1])) / 2
    torch.testing.assert_close(output.loss, expected)
    negative = model(ids, start_positions=torch.tensor([-1, 4]), end_positions=torch.tensor([2, -100]))
    first = torch.tensor([0, 4]), torch.tensor([2, 0])
    expected = (cross_entropy(negative.start_logits, first[0]) + cross_entropy(negative.end_logits, first[1])) / 2
    torch.testing.assert_close(negative.loss, expected)


@pytest.mark.parametrize("head", HEADS, ids=lambda auto_class: auto_class.__name__[len("AutoModelFor"):])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_causal_lms_checkpoint_loads_under_each_head_and_round_trips(arch, head, tmp_path):
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny_config(arch, pad_token_id=0)).eval()
    lm.save_pretrained(tmp_path / "lm")
    model = head.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    ids = torch.randint(3, 320, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids).last_hidden_state, lm.model(ids).last_hidden_state,
                                   rtol=0, atol=0)
        outputs = model(ids, use_cache=False).to_tuple()  # (the scores alone)
    model.save_pretrained(tmp_path / "head")
    again = head.from_pretrained(tmp_path / "head").eval()
    assert type(again) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, use_cache=False).to_tuple(), outputs, rtol=0, atol=0)


def _task(count: int = 32, length: int = 8):
    """Sequences labelled by the range their first token falls in (three ranges): learnable in a few steps."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 320, (count, length), generator=generator)
    labels = (ids[:, 0] - 3) * 3 // 317
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels)]


def _token_task(count: int = 32, length: int = 8):
    """Each token labelled by the range its id falls in (three ranges); the answer span: from the token of the largest
    id to the end of the row."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 320, (count, length), generator=generator)
    starts = ids.argmax(-1)
    return [{"input_ids": row, "labels": (row - 3) * 3 // 317, "start_positions": start,
             "end_positions": torch.tensor(length - 1)} for row, start in zip(ids, starts)]


@pytest.mark.parametrize("arch, auto_class, task_type, head, task", [
    ("flash_mhf", AutoModelForSequenceClassification, "SEQ_CLS", "score", _task),
    ("memoryllm", AutoModelForSequenceClassification, "SEQ_CLS", "score", _task),
    ("kvffn", AutoModelForTokenClassification, "TOKEN_CLS", "score", _token_task),
    ("flex_memoryllm", AutoModelForQuestionAnswering, "QUESTION_ANS", "qa_outputs", _token_task),
], ids=["flash_mhf-sequence", "memoryllm-sequence", "kvffn-token", "flex_memoryllm-question_answering"])
def test_trainer_and_lora_train_each_head(arch, auto_class, task_type, head, task, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = head_model(auto_class, arch)
    peft_model = get_peft_model(model, LoraConfig(task_type=task_type, r=4,
                                                  target_modules=hf_memffn.LORA_TARGET_MODULES[arch]))
    trainable = {name for name, parameter in peft_model.named_parameters() if parameter.requires_grad}
    assert any(head in name for name in trainable) and any("lora_" in name for name in trainable)
    args = TrainingArguments(str(tmp_path), per_device_train_batch_size=8, learning_rate=1e-2, num_train_epochs=4,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no")
    inputs = inspect.signature(model.forward).parameters  # (the token task's labels, or its answer spans)
    dataset = [{key: value for key, value in row.items() if key in inputs} for row in task()]
    trainer = Trainer(model=peft_model, args=args, train_dataset=dataset)
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


def test_token_classification_pipeline():
    """(transformers 5 has no extractive question-answering pipeline: the heads are used directly. The pipeline puts
    the model on the GPU where there is one, so the tiny model is one that runs there: FlashMHF's FFN heads of 16
    have no kernel, and `ffn_kernel='auto'` refuses them on CUDA.)"""
    tokenizer = tiny_tokenizer()
    model = head_model(AutoModelForTokenClassification, "flex_memoryllm", pad_token_id=tokenizer.pad_token_id)
    tag = pipeline("token-classification", model=model, tokenizer=tokenizer)
    tagged = tag(["the memory reads a key", "a value"])
    assert all(row and all({"entity", "score", "index", "word", "start", "end"} <= set(token) for token in row)
               for row in tagged)
    assert {token["entity"] for row in tagged for token in row} <= {"LABEL_0", "LABEL_1", "LABEL_2"}


@pytest.mark.parametrize("arch, head", [("memoryllm", AutoModelForSequenceClassification),
                                        ("flex_memoryllm", AutoModelForSequenceClassification),
                                        ("flex_memoryllm", AutoModelForTokenClassification),
                                        ("memoryllm", AutoModelForQuestionAnswering)])
def test_token_lookup_tables_serve_the_heads(arch, head, tmp_path):
    """A table exported from the causal LM replaces the head model's FFNs on X0: the same scores."""
    from hf_memffn.conversion import export_tols

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(arch, pad_token_id=0)).save_pretrained(tmp_path / "lm")
    export_tols(str(tmp_path / "lm"), tmp_path / "table", format="fp32", progress=False)
    model = head.from_pretrained(tmp_path / "lm", num_labels=3).eval()
    ids = torch.randint(3, 320, (2, 7))
    with torch.no_grad():
        computed = model(ids, use_cache=False).to_tuple()
        model.load_tols(tmp_path / "table", placement="cpu")
        assert model.model.token_lookup is not None
        looked_up = model(ids, use_cache=False).to_tuple()
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
