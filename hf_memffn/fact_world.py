"""A synthetic "fact world": invented people with attributes, rendered into varied sentences.

It is the built-in data of `hf-memffn demo`. The architectures in this package all read the FFN as a
key-value memory, so the demo measures the thing they are about: storing facts during training and
recalling them later.

The world is deterministic from a seed:

* **Entities** have invented names built from syllables ("Zorvak Tel"); first names are unique, family
  names are shared, and no name is taken from a list of real people.
* **Attributes**: home city (invented cities), profession, favourite colour, year of birth and pet. Each
  attribute draws its values from a small pool, so every value is shared by several entities and a
  model can only answer by remembering the pair (entity, value).
* **Training sentences**: every fact is rendered through several statement templates ("Zorvak Tel lives
  in Brixmere.", "The home city of Zorvak Tel is Brixmere.") and a few question-like templates
  ("Q: Where does Zorvak Tel live? A: Brixmere."), so the model sees each fact several times in
  different surface forms, and sees the "Q: ... A:" frame with answers after it.
* **Held-out statements** (the held-out loss): for every fact one statement template is kept out of the
  training text, so the held-out text states known facts in forms never seen for that entity.
* **Held-out questions** (fact recall): question templates that never occur in training, e.g.
  "Q: What is the profession of Zorvak Tel? A:". The model has to transfer a fact learnt from
  statements to a new way of asking for it.

Fact recall is scored by **ranking**: for each held-out question every value of that attribute is
appended to the prompt, and the question counts as answered when the true value has the strictly
highest log-likelihood (the sum of its tokens' log-probabilities). Ranking among the attribute's own
values is robust for tiny models: a model that knows the fact but has not yet learnt the exact output
format of an unseen question (or spreads its mass over a few phrasings) still gets credit, and chance
level is known exactly (1 / number of values). `score_recall` also reports the stricter greedy
accuracy: whether greedy decoding after the prompt reproduces every token of the true value, which
comes for free from the same forward pass (teacher forcing along the true value).

The demo's tokenizer (`hf_memffn.tokenization.train_tokenizer`) is a byte-level BPE
from the `tokenizers` library wrapped as a transformers `PreTrainedTokenizerFast` with `<s>`, `</s>`
and `<pad>`, so it is saved beside a model and reloaded with `AutoTokenizer`. Byte-level BPE rather than
a WordLevel vocabulary: on the fact world BPE merges every word whole within a few hundred merges
(merges never cross spaces, so training stops there), which gives the same short sequences and
one-token-per-name inputs a WordLevel vocabulary would, while staying open-vocabulary: unseen
question words and real text never map to an unknown token.
"""

from __future__ import annotations

import numbers
import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = [
    "ATTRIBUTES",
    "Attribute",
    "Entity",
    "FactWorld",
    "RecallQuestion",
    "RecallScore",
    "score_recall",
]



@dataclass(frozen=True)
class Attribute:
    """One kind of fact, with its surface forms.

    `statements` and `training_questions` contain `{name}` and `{value}` (and `{a}`, the article "a"/"an"
    that goes before the value); `held_out_questions` contain only `{name}` and end right before the
    answer, which is appended as `" " + value`.
    """

    key: str
    statements: tuple[str, ...]
    training_questions: tuple[str, ...]
    held_out_questions: tuple[str, ...]


ATTRIBUTES: tuple[Attribute, ...] = (
    Attribute(
        key="home_city",
        statements=(
            "{name} lives in {value}.",
            "The home city of {name} is {value}.",
            "{name} has a house in {value}.",
            "{name} grew up in {value} and never left.",
            "Most days {name} walks through the streets of {value}.",
        ),
        training_questions=(
            "Q: Where does {name} live? A: {value}.",
            "Which city is home to {name}? It is {value}.",
        ),
        held_out_questions=(
            "Q: What is the home city of {name}? A:",
            "Q: Where is the home of {name}? A:",
        ),
    ),
    Attribute(
        key="profession",
        statements=(
            "{name} works as {a} {value}.",
            "The profession of {name} is {value}.",
            "By trade, {name} is {a} {value}.",
            "{name} earns a living as {a} {value}.",
            "Everyone knows {name} as a skilled {value}.",
        ),
        training_questions=(
            "Q: What job does {name} have? A: {value}.",
            "What does {name} do for work? {name} is {a} {value}.",
        ),
        held_out_questions=(
            "Q: What is the profession of {name}? A:",
            "Q: What is the job of {name}? A:",
        ),
    ),
    Attribute(
        key="favourite_colour",
        statements=(
            "The favourite colour of {name} is {value}.",
            "{name} likes the colour {value} best.",
            "{name} always wears something {value}.",
            "Of all colours, {name} prefers {value}.",
            "{name} painted the front door {value}.",
        ),
        training_questions=(
            "Q: Which colour does {name} like most? A: {value}.",
            "What colour would {name} choose? Always {value}.",
        ),
        held_out_questions=(
            "Q: What is the favourite colour of {name}? A:",
            "Q: What colour does {name} like best? A:",
        ),
    ),
    Attribute(
        key="birth_year",
        statements=(
            "{name} was born in {value}.",
            "The year of birth of {name} is {value}.",
            "{name} came into the world in {value}.",
            "Records show that {name} was born in the year {value}.",
            "The birthday of {name} falls in {value}.",
        ),
        training_questions=(
            "Q: When was {name} born? A: {value}.",
            "In what year was {name} born? In {value}.",
        ),
        held_out_questions=(
            "Q: What is the year of birth of {name}? A:",
            "Q: What year was {name} born in? A:",
        ),
    ),
    Attribute(
        key="pet",
        statements=(
            "{name} has a pet {value}.",
            "The pet of {name} is {a} {value}.",
            "Every morning {name} feeds the {value}.",
            "{name} shares a home with a small {value}.",
            "At night the {value} of {name} sleeps by the fire.",
        ),
        training_questions=(
            "Q: What animal does {name} keep? A: {value}.",
            "Which pet belongs to {name}? It is {a} {value}.",
        ),
        held_out_questions=(
            "Q: What is the pet of {name}? A:",
            "Q: Which pet does {name} have? A:",
        ),
    ),
)

_PROFESSIONS = ("baker", "pilot", "sculptor", "gardener", "chemist", "sailor", "tailor", "librarian",
                "blacksmith", "astronomer")
_COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "silver", "white")
_PETS = ("cat", "dog", "parrot", "tortoise", "rabbit", "ferret", "goldfish", "hedgehog")
# Deliberately odd syllables: names built from them are invented, not drawn from real people or places.
_NAME_SYLLABLES = ("zor", "vak", "quil", "thra", "brix", "yel", "drun", "kes", "mor", "vex", "tal", "gri",
                   "osk", "fen", "lum", "rax", "pel", "dov", "sib", "nar", "ulk", "zem", "wyr", "jox",
                   "hal", "tov", "qua", "bes", "kir", "vun")
_FAMILY_SYLLABLES = ("Tel", "Vorn", "Kass", "Ondri", "Mirel", "Strab", "Yuvo", "Delk", "Rask", "Pim")
_CITY_SUFFIXES = ("mere", "hold", "port", "ford", "dell", "wick")
_NUM_CITIES = 10
_NUM_BIRTH_YEARS = 10
MAX_ENTITIES = len(_NAME_SYLLABLES) * (len(_NAME_SYLLABLES) - 1)  # first names: two different syllables


@dataclass(frozen=True)
class Entity:
    name: str
    facts: dict[str, str] = field(hash=False)


@dataclass(frozen=True)
class RecallQuestion:
    """A held-out question: `prompt` ends before the answer, the answer is `" " + answer`."""

    prompt: str
    attribute: str
    answer: str
    entity: str


def _check_at_least(minimum: int, **values) -> None:
    """Refuses the first of `values` (argument name=value) that is not an integer >= `minimum`."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
            raise ValueError(f"{name}={value!r} is invalid; allowed: an integer >= {minimum}")


def _article(value: str) -> str:
    return "an" if value[0].lower() in "aeiou" else "a"


def _render(template: str, name: str, value: str = "") -> str:
    return template.format(name=name, value=value, a=_article(value) if value else "a")


class FactWorld:
    """The world of `num_entities` invented people, fully determined by `seed`.

    Use `training_sentences()` / `held_out_sentences()` for text, `training_documents()` for a shuffled
    multi-pass training corpus, `recall_questions()` + `candidates()` for fact recall.
    """

    def __init__(self, seed: int = 0, num_entities: int = 32):
        _check_at_least(2, num_entities=num_entities)  # (2.5 built 3 people)
        if num_entities > MAX_ENTITIES:
            raise ValueError(f"num_entities={num_entities!r} is too large; allowed: 2..{MAX_ENTITIES}")
        self.seed = seed
        rng = random.Random(seed)

        cities: list[str] = []
        while len(cities) < _NUM_CITIES:
            city = (rng.choice(_NAME_SYLLABLES) + rng.choice(_CITY_SUFFIXES)).capitalize()
            if city not in cities:
                cities.append(city)
        years = sorted(rng.sample(range(1900, 2000), _NUM_BIRTH_YEARS))
        self.values: dict[str, tuple[str, ...]] = {
            "home_city": tuple(cities),
            "profession": _PROFESSIONS,
            "favourite_colour": _COLOURS,
            "birth_year": tuple(str(y) for y in years),
            "pet": _PETS,
        }

        first_names: list[str] = []
        while len(first_names) < num_entities:
            first, second = rng.sample(_NAME_SYLLABLES, 2)
            name = (first + second).capitalize()
            if name not in first_names:
                first_names.append(name)
        self.entities: tuple[Entity, ...] = tuple(
            Entity(
                name=f"{first} {rng.choice(_FAMILY_SYLLABLES)}",
                facts={attr.key: rng.choice(self.values[attr.key]) for attr in ATTRIBUTES},
            )
            for first in first_names
        )

        # For every fact, one statement template is held out of training (the held-out loss text).
        self._held_out_statement: dict[tuple[str, str], str] = {
            (entity.name, attr.key): rng.choice(attr.statements)
            for entity in self.entities
            for attr in ATTRIBUTES
        }

    # ---- text -------------------------------------------------------------------------------------
    def training_sentences(self) -> list[str]:
        """Every fact in every training surface form (statements minus the held-out one, plus questions)."""
        sentences = []
        for entity in self.entities:
            for attr in ATTRIBUTES:
                value = entity.facts[attr.key]
                held_out = self._held_out_statement[(entity.name, attr.key)]
                for template in attr.statements + attr.training_questions:
                    if template != held_out:
                        sentences.append(_render(template, entity.name, value))
        return sentences

    def held_out_sentences(self) -> list[str]:
        """Every fact once, in the statement form that training never shows for that entity."""
        return [
            _render(self._held_out_statement[(entity.name, attr.key)], entity.name, entity.facts[attr.key])
            for entity in self.entities
            for attr in ATTRIBUTES
        ]

    def training_documents(self, passes: int = 1, sentences_per_document: int = 8, seed: int | None = None
                           ) -> list[str]:
        """`passes` shuffled copies of the training sentences, grouped into short documents.

        Sentences about different people are mixed within a document, so a fact cannot be copied from
        the context: it has to be stored in the weights.
        """
        _check_at_least(1, passes=passes, sentences_per_document=sentences_per_document)
        rng = random.Random(self.seed + 1 if seed is None else seed)
        sentences = self.training_sentences()
        documents = []
        for _ in range(passes):
            order = sentences[:]
            rng.shuffle(order)
            for start in range(0, len(order), sentences_per_document):
                documents.append(" ".join(order[start:start + sentences_per_document]))
        return documents

    def held_out_documents(self, sentences_per_document: int = 8) -> list[str]:
        _check_at_least(1, sentences_per_document=sentences_per_document)
        sentences = self.held_out_sentences()
        random.Random(self.seed + 2).shuffle(sentences)
        return [" ".join(sentences[i:i + sentences_per_document])
                for i in range(0, len(sentences), sentences_per_document)]

    # ---- fact recall ------------------------------------------------------------------------------
    def recall_questions(self) -> list[RecallQuestion]:
        """Every fact asked through every held-out question form."""
        return [
            RecallQuestion(prompt=_render(template, entity.name), attribute=attr.key,
                           answer=entity.facts[attr.key], entity=entity.name)
            for entity in self.entities
            for attr in ATTRIBUTES
            for template in attr.held_out_questions
        ]

    def candidates(self, attribute: str) -> tuple[str, ...]:
        """All values of `attribute` (the answers recall ranks)."""
        if attribute not in self.values:
            raise ValueError(f"attribute={attribute!r} is unknown; allowed: {sorted(self.values)}")
        return self.values[attribute]

    def describe(self) -> str:
        return (f"fact world (seed {self.seed}): {len(self.entities)} invented people x {len(ATTRIBUTES)} "
                f"attributes = {len(self.entities) * len(ATTRIBUTES)} facts")


# ---- tokenizer ------------------------------------------------------------------------------------
# ---- recall scoring ---------------------------------------------------------------------------------
@dataclass
class RecallScore:
    accuracy: float  # true value ranked strictly first among the attribute's values
    greedy_accuracy: float  # greedy decoding reproduces the true value's tokens
    chance: float  # expected ranking accuracy of a random guess
    num_questions: int
    per_attribute: dict[str, float]  # ranking accuracy per attribute
    ranked_answers: list[str]  # the best-scoring value of each question, in order


@torch.no_grad()
def score_recall(
    model,
    tokenizer,
    questions: Sequence[RecallQuestion],
    candidates: dict[str, Sequence[str]],
    *,
    batch_size: int = 128,
    device: torch.device | str | None = None,
) -> RecallScore:
    """Score fact recall of a causal LM on `questions` by ranking each attribute's `candidates`.

    `model(input_ids=..., attention_mask=...)` must return an object with `.logits` [B, L, V]. Each row
    is `<s> prompt + " " + candidate`, right-padded; a candidate's score is the sum of its tokens'
    log-probabilities (see the module docstring for why ranking).
    """
    if not questions:
        raise ValueError("questions=[] is empty; allowed: a non-empty list of RecallQuestion")
    _check_at_least(1, batch_size=batch_size)
    for question in questions:
        if question.answer not in candidates.get(question.attribute, ()):
            raise ValueError(f"answer={question.answer!r} of attribute={question.attribute!r} is not among its "
                             f"candidates; allowed: {list(candidates.get(question.attribute, ()))}")
    if device is None:
        device = next(model.parameters()).device if hasattr(model, "parameters") else "cpu"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    candidate_ids = {
        attribute: [tokenizer(" " + value, add_special_tokens=False)["input_ids"] for value in values]
        for attribute, values in candidates.items()
    }
    # rows: (question index, candidate index, prompt ids + candidate ids, prompt length)
    rows = []
    for q_index, question in enumerate(questions):
        prompt_ids = tokenizer(question.prompt)["input_ids"]
        for c_index, ids in enumerate(candidate_ids[question.attribute]):
            rows.append((q_index, c_index, prompt_ids + ids, len(prompt_ids)))

    scores: list[list[float]] = [[0.0] * len(candidate_ids[q.attribute]) for q in questions]
    greedy_hit: list[bool] = [False] * len(questions)
    # each module's own mode, given back at the end (a part kept in eval mode in a model being trained stays so)
    modes = [(module, module.training) for module in model.modules()] if hasattr(model, "modules") else []
    if hasattr(model, "eval"):
        model.eval()
    try:
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            width = max(len(ids) for _, _, ids, _ in chunk)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (_, _, ids, _) in enumerate(chunk):
                input_ids[i, :len(ids)] = torch.tensor(ids)
                attention_mask[i, :len(ids)] = 1
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
            for i, (q_index, c_index, ids, prompt_len) in enumerate(chunk):
                positions = torch.arange(prompt_len - 1, len(ids) - 1)
                targets = torch.tensor(ids[prompt_len:])
                scores[q_index][c_index] = log_probs[i, positions, targets].sum().item()
                question = questions[q_index]
                if candidates[question.attribute][c_index] == question.answer:
                    greedy_hit[q_index] = bool((log_probs[i, positions].argmax(-1) == targets).all())
    finally:
        for module, training in modes:
            module.training = training

    correct = []
    per_attribute: dict[str, list[bool]] = {}
    for question, row_scores in zip(questions, scores):
        true_index = list(candidates[question.attribute]).index(question.answer)
        true_score = row_scores[true_index]
        hit = all(true_score > s for j, s in enumerate(row_scores) if j != true_index)
        correct.append(hit)
        per_attribute.setdefault(question.attribute, []).append(hit)
    chance = sum(1.0 / len(candidates[q.attribute]) for q in questions) / len(questions)
    return RecallScore(
        accuracy=sum(correct) / len(correct),
        greedy_accuracy=sum(greedy_hit) / len(greedy_hit),
        chance=chance,
        num_questions=len(questions),
        per_attribute={k: sum(v) / len(v) for k, v in per_attribute.items()},
        ranked_answers=[candidates[q.attribute][max(range(len(row)), key=row.__getitem__)]
                        for q, row in zip(questions, scores)],
    )
