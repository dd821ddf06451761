"""The synthetic fact world: determinism, held-out forms, tokenizer, recall scoring."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from hf_memffn.fact_world import ATTRIBUTES, FactWorld, RecallQuestion, score_recall
from hf_memffn.tokenization import train_tokenizer


@pytest.fixture(scope="module")
def world():
    return FactWorld(seed=3, num_entities=12)


@pytest.fixture(scope="module")
def tokenizer(world):
    return train_tokenizer(world.training_documents(passes=1))


def test_deterministic_from_seed(world):
    again = FactWorld(seed=3, num_entities=12)
    assert [(e.name, e.facts) for e in again.entities] == [(e.name, e.facts) for e in world.entities]
    assert again.training_documents(passes=2) == world.training_documents(passes=2)
    assert again.held_out_sentences() == world.held_out_sentences()
    assert again.recall_questions() == world.recall_questions()
    other = FactWorld(seed=4, num_entities=12)
    assert [e.name for e in other.entities] != [e.name for e in world.entities]


def test_entities_are_distinct_and_every_fact_is_trained_in_several_forms(world):
    first_names = [e.name.split()[0] for e in world.entities]
    assert len(set(first_names)) == len(first_names)
    training = world.training_sentences()
    for entity in world.entities:
        for attr in ATTRIBUTES:
            value = entity.facts[attr.key]
            assert value in world.candidates(attr.key)
            mentions = [s for s in training if entity.name in s and re.search(rf"\b{value}\b", s)]
            assert len(mentions) >= 5, (entity.name, attr.key, mentions)
            assert any(s.startswith("Q:") for s in mentions)  # question-like training forms exist


def test_held_out_forms_never_appear_in_training(world):
    training_templates = {t for attr in ATTRIBUTES for t in attr.statements + attr.training_questions}
    held_out_templates = {t for attr in ATTRIBUTES for t in attr.held_out_questions}
    assert not training_templates & held_out_templates
    assert not any(t.startswith(h.removesuffix("A:")) for t in training_templates for h in held_out_templates)

    training_text = "\n".join(world.training_sentences())
    questions = world.recall_questions()
    assert len(questions) == len(world.entities) * sum(len(a.held_out_questions) for a in ATTRIBUTES)
    for question in questions:
        assert question.prompt not in training_text
        assert question.prompt.startswith("Q:") and question.prompt.endswith("A:")
    # held-out statements (the held-out loss text) are never training sentences
    assert not set(world.held_out_sentences()) & set(world.training_sentences())
    # ... but every word of a held-out question is a word of the training text
    training_words = set(re.findall(r"\w+", training_text))
    for question in questions:
        assert set(re.findall(r"\w+", question.prompt)) <= training_words, question.prompt


def test_bad_arguments_name_the_field():
    for bad in (1, 2.5, "8", True):
        with pytest.raises(ValueError, match=rf"num_entities={bad!r} is invalid; allowed: an integer >= 2"):
            FactWorld(num_entities=bad)
    with pytest.raises(ValueError, match="attribute"):
        FactWorld(num_entities=4).candidates("shoe_size")
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a b c"], vocab_size=10)


def test_train_tokenizer_refuses_one_text_and_items_that_are_not_texts():
    """One str (a whole corpus read from a file) was trained on as texts of one character each, a BPE without a
    merge; a dict, as an item or as the whole of `texts`, was trained on as its keys; a float or str vocab_size failed
    in `tokenizers` without its name."""
    corpus = "the memory stores the key and the value of the token " * 50
    with pytest.raises(ValueError, match=r"texts is one str of 2650 characters; allowed: an iterable of texts"):
        train_tokenizer(corpus, vocab_size=300)
    with pytest.raises(ValueError, match=r"texts\[0\] is dict .*; allowed: a str \(a text\) or a list of str"):
        train_tokenizer([{"text": corpus}], vocab_size=300)
    # (a batch of rows as `datasets` slices it, `dataset[:n]`, is a dict of columns: it trained on the column names)
    with pytest.raises(ValueError, match=r"texts is a dict with keys \['text'\]; allowed: an iterable of texts"):
        train_tokenizer({"text": [corpus] * 4}, vocab_size=300)
    with pytest.raises(ValueError, match=r"texts\[1\] is NoneType None; allowed: a str \(a text\) or a list"):
        train_tokenizer((text for text in [corpus, None]), vocab_size=300)
    for size in (2048.0, "2048", None):
        with pytest.raises(ValueError, match=rf"vocab_size={size!r} is invalid; allowed: an integer >= 259"):
            train_tokenizer([corpus], vocab_size=size)
    assert len(train_tokenizer([corpus], vocab_size=300)("memory key")["input_ids"]) == 3  # <s> and a token a word
    # batches of texts (a `batch_iterator()` as for `train_new_from_iterator`) train the same tokenizer
    batched = train_tokenizer(iter([[corpus], (corpus,)]), vocab_size=300)
    assert batched.get_vocab() == train_tokenizer([corpus, corpus], vocab_size=300).get_vocab()


def test_tokenizer_round_trip_and_reload(world, tokenizer, tmp_path):
    from transformers import AutoTokenizer

    text = world.training_documents(passes=1)[0]
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert {tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id} == {0, 1, 2}
    assert tokenizer.decode(ids, skip_special_tokens=True) == " " + text  # byte-level BPE with a prefix space
    # every word of the fact world is a single token
    assert len(ids) - 1 == len(re.findall(r"\w+|[^\w\s]", text))
    # unseen text still encodes (byte level) and round-trips
    assert tokenizer.decode(tokenizer("Ünïcode ☃ x9")["input_ids"], skip_special_tokens=True) == " Ünïcode ☃ x9"

    question = world.recall_questions()[0]
    joined = tokenizer(question.prompt + " " + question.answer)["input_ids"]
    answer_ids = tokenizer(" " + question.answer, add_special_tokens=False)["input_ids"]
    split = tokenizer(question.prompt)["input_ids"] + answer_ids
    assert joined == split

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text)["input_ids"] == ids
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.pad_token) == ("<s>", "</s>", "<pad>")


class PrefixTableLM(torch.nn.Module):
    """A stub LM that puts all its mass on the token that follows the prefix in `sequences`."""

    def __init__(self, sequences, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.next_token = {tuple(seq[:i]): seq[i] for seq in sequences for i in range(1, len(seq))}
        self.dummy = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for b, row in enumerate(input_ids.tolist()):
            for i in range(len(row)):
                token = self.next_token.get(tuple(row[: i + 1]))
                if token is not None:
                    logits[b, i, token] = 20.0
        return SimpleNamespace(logits=logits)


def _answer_table(tokenizer, questions, answer_of):
    return [tokenizer(q.prompt)["input_ids"] + tokenizer(" " + answer_of(q), add_special_tokens=False)["input_ids"]
            for q in questions]


def test_score_recall_on_stubs(world, tokenizer):
    questions = world.recall_questions()[:20]
    candidates = {attr: world.candidates(attr) for attr in world.values}
    oracle = PrefixTableLM(_answer_table(tokenizer, questions, lambda q: q.answer), len(tokenizer))
    score = score_recall(oracle, tokenizer, questions, candidates, batch_size=17)
    assert score.accuracy == 1.0 and score.greedy_accuracy == 1.0
    assert score.num_questions == 20
    assert 0 < score.chance < 0.2
    assert set(score.per_attribute.values()) == {1.0}
    assert score.ranked_answers == [q.answer for q in questions]

    def wrong(q):
        values = candidates[q.attribute]
        return values[(values.index(q.answer) + 1) % len(values)]

    liar = PrefixTableLM(_answer_table(tokenizer, questions, wrong), len(tokenizer))
    score = score_recall(liar, tokenizer, questions, candidates)
    assert score.accuracy == 0.0 and score.greedy_accuracy == 0.0
    assert score.ranked_answers == [wrong(q) for q in questions]

    with pytest.raises(ValueError, match="answer"):
        score_recall(oracle, tokenizer, [RecallQuestion("Q: x? A:", "pet", "dragon", "x")], candidates)


def test_the_readme_edits_a_person_of_the_default_demos_world():
    """The README's `hf-memffn analyze` example runs on the models `hf-memffn demo` trains by default: the person
    asked about lives in that world, and the target is another of its cities."""
    from pathlib import Path

    from hf_memffn.demo import DEFAULT

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert "hf-memffn demo --out memffn-demo  " in readme
    edits = re.findall(r'--edit "Q: What is the home city of ([A-Z][a-z]+ [A-Z][a-z]+)\? A:=> (\w+)"', readme)
    assert edits
    default_world = FactWorld(seed=0, num_entities=DEFAULT.num_entities)
    cities = {entity.name: entity.facts["home_city"] for entity in default_world.entities}
    for name, target in edits:
        assert name in cities
        assert target in default_world.values["home_city"] and target != cities[name]


def test_batch_and_document_sizes_below_one_are_refused_naming_the_argument(world, tokenizer):
    """`batch_size=-1` scored no row at all and returned accuracy 0 as if measured; a size of 0 failed with
    `range() arg 3 must not be zero`; a negative document size gave an empty corpus."""
    questions = world.recall_questions()[:4]
    candidates = {attr: world.candidates(attr) for attr in world.values}
    oracle = PrefixTableLM(_answer_table(tokenizer, questions, lambda q: q.answer), len(tokenizer))
    for batch_size in (0, -1, 2.5):
        with pytest.raises(ValueError, match=rf"batch_size={batch_size} is invalid; allowed: an integer >= 1"):
            score_recall(oracle, tokenizer, questions, candidates, batch_size=batch_size)
    for size in (0, -2):
        with pytest.raises(ValueError, match=rf"sentences_per_document={size} is invalid"):
            world.training_documents(sentences_per_document=size)
        with pytest.raises(ValueError, match=rf"sentences_per_document={size} is invalid"):
            world.held_out_documents(sentences_per_document=size)
    with pytest.raises(ValueError, match=r"passes=-1 is invalid; allowed: an integer >= 1"):
        world.training_documents(passes=-1)
    assert score_recall(oracle, tokenizer, questions, candidates, batch_size=1).accuracy == 1.0


def test_score_recall_gives_each_module_back_the_mode_it_had(world, tokenizer):
    """score_recall put the whole model in eval mode and, for a model in training mode, ended with a blanket
    `model.train()`: a submodule kept in eval mode (a frozen part of a model being fine-tuned, its dropout off) came
    back training. Each module, the model's too, gets back its own mode."""
    questions = world.recall_questions()[:4]
    candidates = {attr: world.candidates(attr) for attr in world.values}
    model = PrefixTableLM(_answer_table(tokenizer, questions, lambda q: q.answer), len(tokenizer))
    model.frozen = torch.nn.Dropout(0.5)
    model.train()
    model.frozen.eval()
    assert score_recall(model, tokenizer, questions, candidates).accuracy == 1.0
    assert model.training and not model.frozen.training
    model.eval()
    score_recall(model, tokenizer, questions, candidates)
    assert not model.training and not model.frozen.training
