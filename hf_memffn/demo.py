"""`hf-memffn demo`: train a tiny Llama and every memffn architecture on the same data, then compare them.

What it does, in order:

1. builds the data: by default the synthetic fact world (`hf_memffn.fact_world`), or real text from
   `--text-files` / `--dataset`; trains a byte-level BPE tokenizer on the training text;
2. trains the baseline (transformers' own `LlamaForCausalLM`) and each memffn architecture from the same
   initial seed on exactly the same batches (same token budget), with a progress bar per model;
3. measures the final train loss, the held-out loss and, on the fact world, fact recall on held-out
   question forms; prints a table and saves it as `results.json` and `results.md` in `--out` (in `results.json` a
   number that is not finite, e.g. the loss of a diverged run, is `null`, named under `not_finite`);
4. saves every model with its tokenizer in `--out/<arch>`, reloads one with
   `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`, checks its logits against the
   trained model and generates an answer to a held-out question;
5. writes the loss curves to `--out/loss_curves.png`.

The defaults are sized to take about two minutes on a 2-core CPU; `--device cuda` runs on a GPU,
`--quick` is a seconds-long smoke run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .architectures import ARCHITECTURE_NAMES, BASELINE, DISPLAY_NAMES, REGISTRY
from .atomic_write import atomic_output, write_atomic
from .cli_args import install_hint, missing_gpu
from .demo_command import DEFAULT, QUICK, REAL_TEXT_VOCAB_SIZE, DemoSettings, add_arguments  # noqa: F401
from .fact_world import ATTRIBUTES, MAX_ENTITIES, FactWorld, score_recall
from .flash_mhf_op import SUPPORTED_HEAD_DIMS
from .run_records import run_record_json
from .testing import BLOCK_PACKAGE_IMPORT, tiny_config
from .tokenization import MIN_VOCAB_SIZE, train_tokenizer

DEVICE_KINDS = ("cpu", "cuda", "mps")


@dataclass
class Corpus:
    """Token streams (documents wrapped in `<s> ... </s>` and concatenated) and what they came from."""

    description: str
    tokenizer: object
    train_ids: torch.Tensor
    held_out_ids: torch.Tensor
    world: FactWorld | None = None


@dataclass
class ArchResult:
    arch: str
    name: str
    total_params: int
    active_params: int
    train_loss: float
    held_out_loss: float
    recall: float | None
    recall_greedy: float | None
    tokens_per_second: float
    train_seconds: float
    losses: list[float] = field(repr=False)


# ---- command line ---------------------------------------------------------------------------------
def _settings_from_args(args: argparse.Namespace) -> DemoSettings:
    base = QUICK if args.quick else DEFAULT
    overrides = {
        "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "learning_rate": args.lr,
        "hidden_size": args.hidden_size, "num_layers": args.num_layers, "intermediate_size": args.intermediate_size,
        "num_entities": args.num_entities,
    }
    flags = {"learning_rate": "--lr"}  # the settings' fields whose option has another name
    values = asdict(base)
    for name, value in overrides.items():
        if value is None:
            continue
        if not 0 < value < math.inf:  # (nan and inf too)
            flag = flags.get(name, f"--{name.replace('_', '-')}")
            raise ValueError(f"{flag}={value!r} is invalid; allowed: a positive number")
        values[name] = value
    if args.vocab_size is not None:
        values["vocab_size"] = args.vocab_size
    elif args.text_files or args.dataset:
        values["vocab_size"] = REAL_TEXT_VOCAB_SIZE
    settings = DemoSettings(**values)
    if settings.hidden_size % (2 * settings.num_heads):
        raise ValueError(f"--hidden-size={settings.hidden_size!r} is invalid; allowed: a multiple of "
                         f"{2 * settings.num_heads} (the {settings.num_heads} attention heads, each of an even width "
                         f"for the rotary embeddings)")
    if settings.seq_len < 2:
        raise ValueError(f"--seq-len={settings.seq_len!r} is invalid; allowed: 2 or more (a window predicts its "
                         f"tokens after the first)")
    if settings.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"--vocab-size={settings.vocab_size!r} is too small; allowed: an integer >= {MIN_VOCAB_SIZE} "
                         "(256 bytes + 3 special tokens)")
    if not (args.text_files or args.dataset) and not 2 <= settings.num_entities <= MAX_ENTITIES:
        raise ValueError(f"--num-entities={settings.num_entities!r} is invalid; allowed: 2..{MAX_ENTITIES}")
    return settings


def _parse_archs(values: list[str]) -> list[str]:
    archs: list[str] = []
    for value in values:
        for name in filter(None, (part.strip() for part in value.split(","))):
            if name not in REGISTRY:
                raise ValueError(f"--archs contains {name!r}; allowed: {', '.join(ARCHITECTURE_NAMES)}")
            if name not in archs:
                archs.append(name)
    if not archs:
        raise ValueError(f"--archs={values!r} names no architecture; allowed: {', '.join(ARCHITECTURE_NAMES)}")
    return archs


def _parse_device(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"--device={value!r} is not a torch device; allowed: {', '.join(DEVICE_KINDS)}, cuda:N")
    if device.type not in DEVICE_KINDS:
        raise ValueError(f"--device={value!r} is not supported; allowed: {', '.join(DEVICE_KINDS)}, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={value!r} but torch sees no CUDA device; allowed here: cpu")
    problem = missing_gpu(device)
    if problem:
        raise ValueError(f"--device={value!r}: {problem}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device={value!r} but torch sees no MPS device; allowed here: cpu")
    return device


# ---- data ------------------------------------------------------------------------------------------
def _to_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """`<s> doc </s>` for every document, concatenated into one 1-D tensor."""
    encoded = tokenizer(documents)["input_ids"]  # the tokenizer puts <s> in front
    ids = [token for doc in encoded for token in doc + [tokenizer.eos_token_id]]
    return torch.tensor(ids, dtype=torch.long)


def build_fact_world_corpus(settings: DemoSettings, seed: int) -> Corpus:
    world = FactWorld(seed=seed, num_entities=settings.num_entities)
    one_pass = world.training_documents(passes=1, seed=seed)
    tokenizer = train_tokenizer(one_pass, vocab_size=settings.vocab_size)
    tokens_per_pass = len(_to_stream(tokenizer, one_pass))
    budget = settings.steps * settings.batch_size * settings.seq_len
    passes = max(2, math.ceil(budget / tokens_per_pass))  # the stream holds the whole budget: no window repeats much
    train_ids = _to_stream(tokenizer, world.training_documents(passes=passes, seed=seed))
    held_out_ids = _to_stream(tokenizer, world.held_out_documents())
    num_sentences = len(world.training_sentences())
    forms_per_fact = num_sentences // (len(world.entities) * len(ATTRIBUTES))
    description = (f"{world.describe()}; {num_sentences} training sentences ({tokens_per_pass} tokens a pass, "
                   f"each fact in {forms_per_fact} forms); {len(world.recall_questions())} held-out questions")
    return Corpus(description, tokenizer, train_ids, held_out_ids, world)


def _read_real_text(args: argparse.Namespace) -> tuple[list[str], str]:
    if args.text_files and args.dataset:
        raise ValueError("--text-files and --dataset were both given; allowed: one of them")
    texts: list[str] = []
    if args.text_files:
        for name in args.text_files:
            path = Path(name)
            if not path.is_file():
                raise ValueError(f"--text-files contains {name!r}, which is not a file; allowed: paths of text files")
            # (not replaced by U+FFFD: such characters would be trained on as U+FFFD; a byte-order mark, which
            # Windows editors write, left out: it began the first paragraph)
            try:
                texts.append(path.read_text(encoding="utf-8-sig"))
            except UnicodeDecodeError as error:
                raise ValueError(f"--text-files contains {name!r}, which is not UTF-8 text ({error}); allowed: "
                                 "UTF-8 text files (convert it to UTF-8)") from error
        source = f"{len(args.text_files)} text file(s)"
    else:
        try:
            import datasets
        except ImportError as error:
            raise ImportError("--dataset needs the `datasets` package, which is not installed: "
                              f"{install_hint('datasets')}") from error
        if os.path.isfile(args.dataset):  # `datasets` reads data files through a folder or a builder, not one file
            raise ValueError(f"--dataset={args.dataset!r} is a file; allowed: a Hub dataset name, a folder saved by "
                             "save_to_disk or a folder of data files (json, csv, parquet, txt)")
        saved_markers = ("dataset_info.json", "state.json", "dataset_dict.json")  # written by save_to_disk
        if os.path.isdir(args.dataset) and any((Path(args.dataset) / m).exists() for m in saved_markers):
            dataset = datasets.load_from_disk(args.dataset)
            if isinstance(dataset, datasets.DatasetDict):
                if args.dataset_split not in dataset:
                    raise ValueError(f"--dataset-split={args.dataset_split!r} is not a split of {args.dataset!r}; "
                                     f"allowed: {', '.join(dataset)}")
                dataset = dataset[args.dataset_split]
            else:  # one split saved alone: --dataset-split may only name it (or be left at train)
                allowed = ["train"] + [str(dataset.split)] * (dataset.split not in (None, "train"))
                if args.dataset_split not in allowed:
                    raise ValueError(f"--dataset-split={args.dataset_split!r} is not a split of {args.dataset!r}, "
                                     f"which holds one dataset saved without its other splits; allowed: "
                                     f"{' or '.join(allowed)} (the default train: the whole saved dataset)")
        else:
            dataset = datasets.load_dataset(args.dataset, args.dataset_config, split=args.dataset_split)
        if args.text_column not in dataset.column_names:
            raise ValueError(f"--text-column={args.text_column!r} is not a column of {args.dataset!r}; "
                             f"allowed: {dataset.column_names}")
        features = dataset.features or {}
        text_columns = [name for name, feature in features.items()
                        if isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")]
        if args.text_column in features and args.text_column not in text_columns:
            raise ValueError(f"--text-column={args.text_column!r} of {args.dataset!r} holds "
                             f"{features[args.text_column]}, not text; allowed: a column of strings: {text_columns}")
        total = 0
        for row in dataset:
            text = row[args.text_column] or ""
            if not isinstance(text, str):  # (a dataset that declares no column types)
                raise ValueError(f"--text-column={args.text_column!r} of {args.dataset!r} holds "
                                 f"{type(text).__name__} values, not text; allowed: a column of strings")
            texts.append(text)
            total += len(text)
            if total >= args.max_chars:
                break
        source = f"dataset {args.dataset!r} ({args.dataset_split})"
    # Documents are paragraphs; truncate to --max-chars.
    paragraphs: list[str] = []
    total = 0
    for text in texts:
        for paragraph in re.split(r"\n\s*\n", text):
            paragraph = paragraph.strip()
            if paragraph and total < args.max_chars:
                paragraphs.append(paragraph[: args.max_chars - total])
                total += len(paragraphs[-1])
    if not paragraphs:
        raise ValueError(f"{source} contain no text; allowed: non-empty text")
    return paragraphs, f"{source}: {len(paragraphs)} paragraphs, {total:,} characters"


def build_real_text_corpus(args: argparse.Namespace, settings: DemoSettings) -> Corpus:
    paragraphs, description = _read_real_text(args)
    if len(paragraphs) >= 20:  # every 20th paragraph is held out
        train_docs = [p for i, p in enumerate(paragraphs) if i % 20 != 19]
        held_out_docs = paragraphs[19::20]
    else:  # too few paragraphs: hold out the last 5% of the characters
        text = "\n\n".join(paragraphs)
        cut = int(len(text) * 0.95)
        train_docs, held_out_docs = [text[:cut]], [text[cut:]]
    tokenizer = train_tokenizer(train_docs, vocab_size=settings.vocab_size)
    train_ids = _to_stream(tokenizer, train_docs)
    held_out_ids = _to_stream(tokenizer, held_out_docs)
    if len(train_ids) <= settings.seq_len:
        raise ValueError(f"the training text has {len(train_ids)} tokens, fewer than --seq-len={settings.seq_len}; "
                         "allowed: more text or a shorter --seq-len")
    return Corpus(f"{description}; {len(train_ids):,} training tokens, {len(held_out_ids):,} held out",
                  tokenizer, train_ids, held_out_ids)


# ---- models ----------------------------------------------------------------------------------------
def build_model(arch: str, settings: DemoSettings, tokenizer, device: torch.device | None = None) -> torch.nn.Module:
    """A freshly initialised model of `arch` sized by `settings` (the baseline is `LlamaForCausalLM`): the
    architectures get the baseline's FFN parameters (`Architecture.ffn_fields_at_width`; FlashMHF below)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(arch, settings, tokenizer, device))


def model_config(arch: str, settings: DemoSettings, tokenizer, device: torch.device | None = None):
    """The config `build_model` builds `arch` from (a `ValueError` naming the field where the settings give an
    invalid one)."""
    overrides = dict(
        vocab_size=len(tokenizer),
        hidden_size=settings.hidden_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        head_dim=settings.hidden_size // settings.num_heads,
        max_position_embeddings=max(settings.seq_len, 128),
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch == "flash_mhf":
        overrides.update(_flash_mhf_fields(settings, device))
    else:
        overrides.update(REGISTRY[arch].ffn_fields_at_width(settings.hidden_size, settings.intermediate_size))
    return tiny_config(arch, **overrides)


def _flash_mhf_fields(settings: DemoSettings, device: torch.device | None) -> dict:
    """One FFN head per attention head, each with its own weights. The width makes the FFN's parameters
    (3 * heads * width * head_dim + the 2 * d^2 input/output projections) match the baseline's SwiGLU
    (3 * d * intermediate_size), as the paper compares at equal size; sub-networks are about 8/3 of the head width
    wide (as in the paper) and a multiple of 16 (for the Triton kernels)."""
    d, head_dim = settings.hidden_size, settings.hidden_size // settings.num_heads
    width = max(16, (3 * d * settings.intermediate_size - 2 * d * d) / (3 * settings.num_heads * head_dim))
    num_subnetworks = max(1, round(width / (8 / 3 * head_dim)))
    subnetwork_size = max(16, round(width / num_subnetworks / 16) * 16)
    fields = dict(intermediate_size=num_subnetworks * subnetwork_size, ffn_num_subnetworks=num_subnetworks,
                  ffn_num_heads=settings.num_heads, ffn_num_kv_heads=settings.num_heads)
    if _flash_mhf_runs_torch_op(settings, device):
        fields["ffn_kernel"] = "torch"
    return fields


def _flash_mhf_runs_torch_op(settings: DemoSettings, device: torch.device | None) -> bool:
    """Whether FlashMHF's FFN runs the PyTorch reference op on a GPU: its heads are a width the Triton kernels
    do not take."""
    head_dim = settings.hidden_size // settings.num_heads
    return device is not None and device.type == "cuda" and head_dim not in SUPPORTED_HEAD_DIMS


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    if hasattr(model, "parameter_counts"):
        return model.parameter_counts()
    total = sum(p.numel() for p in model.parameters())  # parameters() lists tied weights once
    return {"total": total, "active": total}


# ---- training and evaluation ---------------------------------------------------------------------
def batch_starts(num_tokens: int, settings: DemoSettings, seed: int) -> torch.Tensor:
    """[steps, batch] start offsets of the training windows: identical for every architecture."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, num_tokens - settings.seq_len, (settings.steps, settings.batch_size), generator=generator)


def _lr_factor(step: int, settings: DemoSettings) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    warmup = max(1, int(settings.steps * settings.warmup_fraction))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, settings.steps - warmup)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model: torch.nn.Module, corpus: Corpus, settings: DemoSettings, starts: torch.Tensor,
          device: torch.device, label: str) -> tuple[list[float], float]:
    """Train with AdamW + warmup/cosine; return (loss per step, training seconds)."""
    from tqdm.auto import tqdm

    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, settings))
    offsets = torch.arange(settings.seq_len)
    train_ids = corpus.train_ids
    losses: list[float] = []
    tokens_per_step = settings.batch_size * settings.seq_len
    # A bar where a terminal shows it; written to a file or a pipe, one line per model when its training ends.
    interactive = sys.stderr.isatty()
    progress = tqdm(range(settings.steps), desc=f"{label:>17}", unit="step", dynamic_ncols=True, leave=True,
                    disable=not interactive)
    _sync(device)
    start = time.perf_counter()
    for step in progress:
        input_ids = train_ids[starts[step][:, None] + offsets].to(device, non_blocking=True)
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 5 == 0 or step == settings.steps - 1:
            elapsed = time.perf_counter() - start
            progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{(step + 1) * tokens_per_step / elapsed:,.0f}")
    _sync(device)
    seconds = time.perf_counter() - start
    progress.close()
    if not interactive:
        print(f"{label:>17}: {settings.steps} steps in {seconds:.1f} s, last loss {losses[-1]:.3f}, "
              f"{settings.steps * tokens_per_step / seconds:,.0f} tokens/s", file=sys.stderr, flush=True)
    return losses, seconds


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, ids: torch.Tensor, settings: DemoSettings, device: torch.device) -> float:
    """Mean next-token loss over `ids`, cut into consecutive windows of `seq_len` tokens."""
    model.eval()
    total, count = 0.0, 0
    windows = [ids[i:i + settings.seq_len] for i in range(0, len(ids) - 1, settings.seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    full = [w for w in windows if len(w) == settings.seq_len]
    groups = [torch.stack(full[i:i + settings.batch_size]) for i in range(0, len(full), settings.batch_size)]
    groups += [w[None] for w in windows if len(w) != settings.seq_len]
    for batch in groups:
        batch = batch.to(device)
        logits = model(input_ids=batch).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


# ---- saving, reloading, reporting ------------------------------------------------------------------
def save_model(model: torch.nn.Module, tokenizer, directory: Path) -> None:
    """Save model + tokenizer to `directory`, written under a temporary name first."""
    with atomic_output(directory) as tmp:
        if hasattr(model, "attach_tokenizer"):
            model.attach_tokenizer(tokenizer)
            model.save_pretrained(tmp)
        else:  # the transformers baseline
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)


# Run in a fresh Python in which `hf_memffn` cannot be imported: only the code saved with the model can load it,
# as for someone who downloads the checkpoint without installing this package.
_RELOAD_SCRIPT = BLOCK_PACKAGE_IMPORT + textwrap.dedent(
    """
    import json, sys

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, device, prompts_path, result_path = sys.argv[1:5]
    with open(prompts_path) as handle:
        prompts = json.load(handle)
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).to(device).eval()
    # (AutoTokenizer reads config.json, whose model type this Python does not know: without the same trust it asks
    # y/N on the terminal, unseen in the captured output, and waits 15 s)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    generated_texts = []
    with torch.no_grad():
        for prompt in prompts:
            inputs = tokenizer(prompt, return_tensors="pt").to(device)
            generated = model.generate(**inputs, max_new_tokens=8, do_sample=False,
                                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            generated_texts.append(tokenizer.decode(generated[0, inputs["input_ids"].shape[1]:],
                                                    skip_special_tokens=True))
        inputs = tokenizer(prompts[0], return_tensors="pt").to(device)
        logits = model(**inputs).logits.float().cpu()
    torch.save({"input_ids": inputs["input_ids"].cpu(), "logits": logits}, result_path + ".pt")
    with open(result_path, "w") as handle:
        json.dump({"class": f"{type(model).__module__}.{type(model).__name__}", "generated": generated_texts}, handle)
    """
)


@torch.no_grad()
def reload_and_generate(directory: Path, trained: torch.nn.Module, corpus: Corpus, device: torch.device) -> dict:
    """Reload a saved model with `trust_remote_code=True` in a fresh Python without `hf_memffn`, check its
    logits against the trained model and answer a few held-out questions greedily (one per attribute of the
    first person; on real text, continue the start of the held-out text)."""
    if corpus.world is not None:
        first = corpus.world.entities[0].name
        seen, questions = set(), []
        for question in corpus.world.recall_questions():
            if question.entity == first and question.attribute not in seen:
                seen.add(question.attribute)
                questions.append(question)
        prompts, expected = [q.prompt for q in questions], [q.answer for q in questions]
        world = corpus.world
        ranked = score_recall(trained, corpus.tokenizer, questions,
                              {attr: world.candidates(attr) for attr in world.values}, device=device).ranked_answers
    else:
        text = corpus.tokenizer.decode(corpus.held_out_ids[1:40].tolist(), skip_special_tokens=True)
        prompts, expected, ranked = [" ".join(text.split()[:8])], [None], [None]
    with tempfile.TemporaryDirectory() as scratch:
        prompts_path, result_path = os.path.join(scratch, "prompts.json"), os.path.join(scratch, "reload.json")
        with open(prompts_path, "w", encoding="utf-8") as handle:
            json.dump(prompts, handle)
        completed = subprocess.run(
            [sys.executable, "-c", _RELOAD_SCRIPT, str(directory), str(device), prompts_path, result_path],
            capture_output=True, text=True,
        )
        if completed.returncode != 0:
            raise RuntimeError(f"reloading {directory} with trust_remote_code=True failed:\n{completed.stderr}")
        with open(result_path, encoding="utf-8") as handle:
            reloaded = json.load(handle)
        outputs = torch.load(result_path + ".pt")
    trained.eval()
    logits = trained(input_ids=outputs["input_ids"].to(device)).logits.float().cpu()
    reference = outputs["logits"]
    same = (logits == reference) | (logits.isnan() & reference.isnan())  # (a diverged model's nan, reloaded)
    difference = torch.where(same, 0.0, (logits - reference).abs()).max().item()
    return {
        "directory": str(directory),
        "class": reloaded["class"],
        "max_abs_logit_difference": difference,
        "matched": difference < 1e-4,
        "samples": [{"prompt": p, "generated": g, "ranked": r, "expected": e}
                    for p, g, r, e in zip(prompts, reloaded["generated"], ranked, expected)],
    }


def lookup_table_step(directory: Path, corpus: Corpus, device: torch.device) -> dict:
    """Export the MemoryLLM's FFNs on X0 as token lookup tables (fp32 and int8) next to its checkpoint and check
    that lookup mode gives the logits and the greedy `generate()` of compute mode (`hf_memffn.conversion.demo_step`)."""
    from .conversion import demo_step
    from .model_card import refresh_lookup_section

    if corpus.world is not None:
        prompt = corpus.world.recall_questions()[0].prompt
    else:
        prompt = corpus.tokenizer.decode(corpus.held_out_ids[1:16].tolist(), skip_special_tokens=True)
    prompt_ids = corpus.tokenizer(prompt, return_tensors="pt").input_ids
    formats = demo_step(directory, directory / "token_lookup", prompt_ids=prompt_ids, max_new_tokens=12,
                        device=device)
    refresh_lookup_section(directory)  # the checkpoint's card now lists the tables in its subfolders
    return {"directory": str(directory / "token_lookup"), "prompt": prompt, "formats": formats}


def _format_table(results: list[ArchResult], with_recall: bool) -> list[list[str]]:
    header = ["arch", "total params", "active params", "train loss", "held-out loss"]
    if with_recall:
        header += ["recall (rank)", "recall (greedy)"]
    header += ["tokens/s"]
    rows = [header]
    for r in results:
        row = [r.name, f"{r.total_params:,}", f"{r.active_params:,}", f"{r.train_loss:.3f}", f"{r.held_out_loss:.3f}"]
        if with_recall:
            row += [f"{r.recall:.1%}", f"{r.recall_greedy:.1%}"]
        row += [f"{r.tokens_per_second:,.0f}"]
        rows.append(row)
    return rows


def render_text_table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "|".join(["---"] + ["---:"] * (len(rows[0]) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(lines)


def _centered_mean(values: list[float], radius: int) -> list[float]:
    """Mean over a window of `2 * radius + 1` steps around each step (narrower at the ends): no lag."""
    return [sum(values[max(0, i - radius):i + radius + 1]) / len(values[max(0, i - radius):i + radius + 1])
            for i in range(len(values))]


def plot_losses(results: list[ArchResult], settings: DemoSettings, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    tokens_per_step = settings.batch_size * settings.seq_len
    fig, ax = plt.subplots(figsize=(8, 5))
    try:  # (closed whether or not the save succeeds: pyplot keeps every figure left open)
        for r in results:
            x = [(i + 1) * tokens_per_step for i in range(len(r.losses))]
            (line,) = ax.plot(x, _centered_mean(r.losses, max(1, len(r.losses) // 25)),
                              label=f"{r.name} (held-out {r.held_out_loss:.2f})")
            ax.plot(x, r.losses, color=line.get_color(), alpha=0.2, linewidth=0.8)
            ax.scatter([x[-1]], [r.held_out_loss], color=line.get_color(), marker="x", zorder=3)
        ax.set_yscale("log")  # the fact-learning phase happens at low loss
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%.1f"))
        ax.set_xlabel("training tokens")
        ax.set_ylabel("loss (lines: train, x: held-out at the end)")
        ax.set_title("hf-memffn demo: same data, same token budget")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with atomic_output(path) as tmp:
            fig.savefig(tmp, format="png", dpi=110)
    finally:
        plt.close(fig)


# ---- the command ---------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    # Off a terminal (a log file, a pipe, CI) transformers' own bars (saving, loading) stay quiet too.
    from transformers.utils import logging as transformers_logging

    bars_were_on = transformers_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        transformers_logging.disable_progress_bar()
    try:
        return _run(args)
    finally:
        if bars_were_on:
            transformers_logging.enable_progress_bar()


def _run(args: argparse.Namespace) -> int:
    run_start = time.perf_counter()
    settings = _settings_from_args(args)
    if not -2**63 <= args.seed < 2**64:  # torch's seeds (the initial weights, the batches)
        raise ValueError(f"--seed={args.seed} is out of range; allowed: an integer from -2**63 to 2**64 - 1")
    archs = _parse_archs(args.archs)
    device = _parse_device(args.device)
    if args.text_files or args.dataset:
        corpus = build_real_text_corpus(args, settings)
    else:
        corpus = build_fact_world_corpus(settings, args.seed)
    for arch in archs:  # every model's config is checked before anything trains or is written
        try:
            model_config(arch, settings, corpus.tokenizer, device)
        except ValueError as error:
            raise ValueError(f"the settings give {arch} an invalid config: {error} (set by --hidden-size, "
                             f"--intermediate-size, --num-layers, --seq-len and --vocab-size)") from error
    if "flash_mhf" in archs and _flash_mhf_runs_torch_op(settings, device):
        print(f"note: FlashMHFLlama's FFN heads are {settings.hidden_size // settings.num_heads} wide; the Triton "
              f"kernels take {SUPPORTED_HEAD_DIMS}, so it runs the PyTorch reference op "
              f"(--hidden-size {SUPPORTED_HEAD_DIMS[0] * settings.num_heads} runs the kernels)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"data: {corpus.description}")
    print(f"tokenizer: byte-level BPE, {len(corpus.tokenizer)} tokens")
    print(f"budget: {settings.steps} steps x {settings.batch_size} x {settings.seq_len} tokens = "
          f"{settings.steps * settings.batch_size * settings.seq_len:,} tokens per model, on {device}")

    # before the first model is written: a run stopped on its way (Ctrl-C, SIGTERM) leaves no results of other models
    removed, kept = _clear_earlier_run(out, archs, settings, corpus, args.seed)
    if removed:
        print(f"removed from {out} what an earlier run with other settings, data or seed wrote: {', '.join(removed)}")
    results, trained, chance = train_architectures(archs, corpus, settings, args.seed, device, out)
    # reload one of this package's architectures if any was trained (the baseline needs no remote code)
    reload_arch = next((a for a in ARCHITECTURE_NAMES if a in trained and a != BASELINE), BASELINE)
    sample = reload_and_generate(out / reload_arch, trained[reload_arch], corpus, device)
    lookup = None
    if "memoryllm" in trained:
        if all(torch.isfinite(p).all() for p in trained["memoryllm"].parameters()):
            lookup = lookup_table_step(out / "memoryllm", corpus, device)
        else:  # (its tables would hold nan or inf, which the export refuses)
            print("note: MemoryLLM diverged (weights that are not finite): no token lookup tables exported")
    plot_losses(results, settings, out / "loss_curves.png")
    if corpus.world is not None:  # texts for `hf-memffn analyze OUT/<arch> --texts OUT/facts.txt`
        write_atomic(out / "facts.txt", "\n".join(corpus.world.held_out_sentences()) + "\n")

    rows = _format_table(results, with_recall=corpus.world is not None)
    notes = _notes(corpus, settings, device, chance)
    write_atomic(out / "results.md", "\n".join([render_markdown_table(rows), ""] + [f"- {n}" for n in notes]) + "\n")
    total_seconds = time.perf_counter() - run_start
    summary = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_threads": torch.get_num_threads(),
        "settings": asdict(settings),
        "seed": args.seed,
        "archs": archs,
        "model_folders": sorted([*archs, *kept]),  # (of this run's world: an earlier run's with the same settings too)
        "data": corpus.description,
        "recall_chance": chance,
        "results": [asdict(r) for r in results],
        "reload": sample,
        "token_lookup": lookup,
        "total_seconds": total_seconds,
    }
    write_atomic(out / "results.json", results_json(summary))
    _print_report(rows, notes, sample, lookup, corpus)
    print(f"saved: {', '.join(str(out / a) for a in archs)}, {out / 'results.json'}, {out / 'results.md'}, "
          f"{out / 'loss_curves.png'}  ({total_seconds:.0f} s in all)")
    return 0


# What a run writes about its models once all are trained (results.json last, as the record of the run).
RESULT_FILES = ("loss_curves.png", "results.md", "results.json")


def _clear_earlier_run(out: Path, archs: list[str], settings: DemoSettings, corpus: Corpus,
                       seed: int) -> tuple[list[str], list[str]]:
    """Removes from `out` the model folders of an earlier run with other settings, data or seed that this run does not
    write again, its `facts.txt` and its results (`RESULT_FILES`), so that `out` holds one world's models and
    texts and, should this run be stopped before it writes its own results, none that describe other models; returns
    the names removed, and the architectures whose folders an earlier run with the same settings, data and seed left
    (they stay, with its results: this run's results.json lists them in `model_folders`). The earlier run is known by
    its `results.json`: only folders it lists (`model_folders`, else `archs`) are removed. Called before this run
    writes anything."""
    try:
        earlier = json.loads((out / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return [], []
    if not isinstance(earlier, dict) or not isinstance(earlier.get("archs"), list):
        return [], []
    folders = earlier.get("model_folders")
    folders = folders if isinstance(folders, list) else earlier["archs"]
    others = [arch for arch in folders
              if arch in REGISTRY and arch not in archs and (out / arch / "config.json").is_file()]
    if (earlier.get("settings"), earlier.get("data"), earlier.get("seed", seed)) == (
            asdict(settings), corpus.description, seed):
        return [], others  # the same world and models: folders of other architectures stay
    removed = []
    for arch in others:
        shutil.rmtree(out / arch)
        removed.append(f"{arch}/")
    # (results.json last: it names what the earlier run wrote, should this be stopped in between)
    for name in ("facts.txt", *RESULT_FILES):
        if (out / name).is_file():
            (out / name).unlink()
            removed.append(name)
    return removed, []


def results_json(summary: dict) -> str:
    """The text of `results.json`: strict JSON, a number that is not finite written as `null` and named under
    `not_finite` (`run_records`; Python's json would write `NaN` or `Infinity`, which strict readers refuse)."""
    return run_record_json(summary, indent=2) + "\n"


def train_architectures(archs: list[str], corpus: Corpus, settings: DemoSettings, seed: int, device: torch.device,
                        out: Path) -> tuple[list[ArchResult], dict[str, torch.nn.Module], float | None]:
    """Train each architecture from `seed` on the same batches, score it and save it to `out/<arch>`; returns the
    results, the trained models and the chance level of the recall score (None on real text)."""
    starts = batch_starts(len(corpus.train_ids), settings, seed)
    results: list[ArchResult] = []
    trained: dict[str, torch.nn.Module] = {}
    chance = None
    for arch in archs:
        torch.manual_seed(seed)
        model = build_model(arch, settings, corpus.tokenizer, device)
        counts = parameter_counts(model)
        losses, seconds = train(model, corpus, settings, starts, device, DISPLAY_NAMES[arch])
        tail = max(1, settings.steps // 10)
        recall = None
        if corpus.world is not None:
            world = corpus.world
            recall = score_recall(model, corpus.tokenizer, world.recall_questions(),
                                  {attr: world.candidates(attr) for attr in world.values}, device=device)
            chance = recall.chance
        results.append(ArchResult(
            arch=arch,
            name=DISPLAY_NAMES[arch],
            total_params=counts["total"],
            active_params=counts["active"],
            train_loss=sum(losses[-tail:]) / tail,
            held_out_loss=held_out_loss(model, corpus.held_out_ids, settings, device),
            recall=None if recall is None else recall.accuracy,
            recall_greedy=None if recall is None else recall.greedy_accuracy,
            tokens_per_second=settings.steps * settings.batch_size * settings.seq_len / seconds,
            train_seconds=seconds,
            losses=losses,
        ))
        save_model(model, corpus.tokenizer, out / arch)
        trained[arch] = model
    return results, trained, chance


def _notes(corpus: Corpus, settings: DemoSettings, device: torch.device, chance: float | None) -> list[str]:
    with_recall = corpus.world is not None
    notes = [f"data: {corpus.description}",
             f"budget: {settings.steps * settings.batch_size * settings.seq_len:,} training tokens per model "
             f"({settings.steps} steps x {settings.batch_size} x {settings.seq_len}), device: {device}",
             "train loss: mean of the last 10% of steps; held-out loss: "
             + ("facts stated in forms never shown for that person" if with_recall else "held-out paragraphs")]
    if with_recall:
        notes.append(f"recall: held-out question forms; rank = true value scores highest among that attribute's "
                     f"values (chance {chance:.1%}), greedy = greedy decoding reproduces the value")
    return notes


def _print_report(rows: list[list[str]], notes: list[str], sample: dict, lookup: dict | None, corpus: Corpus) -> None:
    print()
    print(render_text_table(rows))
    for note in notes:
        print(f"  {note}")
    print()
    print(f"reloaded {sample['directory']} with trust_remote_code=True in a Python without hf_memffn "
          f"({sample['class']}); "
          f"logits match the trained model: {sample['matched']} (max |diff| {sample['max_abs_logit_difference']:.1e})")
    if corpus.world is not None:
        print("  held-out questions, greedy generate() of the reloaded model | best-scoring value (recall (rank)):")
    for item in sample["samples"]:
        answer = item["generated"].strip()
        if item["expected"] is not None:  # a fact-world answer: show its first sentence
            answer = answer.split(".")[0] + "." if "." in answer else answer
        line = f"  {item['prompt']} {answer}"
        if item["expected"] is not None:
            line = f"{line:<62} ranked first: {item['ranked']:<11} true: {item['expected']}"
        print(line)
    if lookup is not None:
        print(f"MemoryLLM token lookup tables ({lookup['directory']}), prompt {lookup['prompt']!r}:")
        for name, row in lookup["formats"].items():
            print(f"  {name}: {row['size_bytes'] / 2**20:.2f} MiB, table max rel. error {row['max_relative_error']:.1e}, "
                  f"logits vs compute mode {row['logits_max_relative_diff']:.1e}, "
                  f"greedy generate() same tokens as compute mode: {row['tokens_match']}")
