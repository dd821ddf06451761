"""The tokenizer trainer shared by the demo, the examples and the tests: a byte-level BPE built with `tokenizers`,
wrapped as a transformers `PreTrainedTokenizerFast` that `save_pretrained` / `AutoTokenizer` handle."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
MIN_VOCAB_SIZE = 256 + 3  # the byte alphabet and the three special tokens


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """Train a byte-level BPE on `texts` (texts, or batches of texts as lists); return a `PreTrainedTokenizerFast`
    that adds `<s>` in front (`add_bos_token=True`, `add_eos_token=False`) and pads on the left
    (`padding_side="left"`, kept in tokenizer_config.json), as Llama's: a padded batch of prompts goes to `generate`
    as it is.

    Saved, the template that adds `<s>` is in tokenizer.json; transformers 5.25 keeps neither flag in the saved files
    (for every tokenizer, Llama's too), so a reloaded tokenizer adds `<s>` while it reads `add_bos_token=False`.
    To change the flags of a reloaded tokenizer, set both (`AutoTokenizer.from_pretrained(dir, add_bos_token=True,
    add_eos_token=True)`): transformers rebuilds the template from the two flags, and one left out counts as False.

    Special tokens: `<pad>` = 0, `<s>` = 1 (bos), `</s>` = 2 (eos). `vocab_size` is an upper bound: on
    the fact world, training stops early once every word is a single token. A space is put in front of
    every text (GPT-2's `add_prefix_space`), so a word at the start of a document or prompt gets the same
    token as inside a sentence; `decode` returns the text with that leading space.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise ValueError(f"vocab_size={vocab_size!r} is invalid; allowed: an integer >= {MIN_VOCAB_SIZE} "
                         "(256 bytes + 3 special tokens)")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size={vocab_size!r} is too small; allowed: an integer >= {MIN_VOCAB_SIZE} "
                         "(256 bytes + 3 special tokens)")
    if isinstance(texts, (str, bytes)):  # (iterated, a text is its characters: a BPE without a merge)
        raise ValueError(f"texts is one {type(texts).__name__} of {len(texts)} characters; allowed: an iterable of "
                         "texts (str), e.g. a list of documents")
    if isinstance(texts, Mapping):  # (iterated, a dict is its keys: `dataset[:n]` trained on its column names)
        raise ValueError(f"texts is a {type(texts).__name__} with keys {list(texts)[:5]!r}; allowed: an iterable of "
                         "texts (str), e.g. a list of documents, or one column of this mapping (texts['text'])")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD_TOKEN, BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_only_texts(texts), trainer)
    # transformers builds the template that adds `<s>` from the flags (`update_post_processor`): a template built here
    # left `add_bos_token` False, and setting `add_eos_token` rebuilt it from the flags without `<s>`
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        # a decoder-only model continues each row from its last position: right padding put the pad tokens there
        padding_side="left",
    )


def _only_texts(texts: Iterable[str | list[str]]) -> Iterator[str | list[str]]:
    """`texts`, refusing an item that is neither a str nor a list or tuple of str (a batch of texts, as `tokenizers`
    takes them): the trainer read a dict's keys as texts."""
    for index, text in enumerate(texts):
        if not (isinstance(text, str) or isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text)):
            raise ValueError(f"texts[{index}] is {type(text).__name__} {text!r:.60}; allowed: a str (a text) or a "
                             "list of str (a batch of texts)")
        yield text
