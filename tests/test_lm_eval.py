"""lm-eval-harness on checkpoints saved by this package, offline.

Local task YAMLs `include` the stock hellaswag and piqa definitions (prompts, choices, metrics, hellaswag's
`process_docs`) and only point them at small jsonl files written here; a tiny generate_until task covers generation.
Each architecture is evaluated on all three tasks in one `simple_evaluate`; the CLI runs once, and the `memffn`
model runs a MemoryLLM from its token lookup table.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
import hf_memffn  # noqa: E402
from hf_memffn.testing import blocked_imports, run_python, tiny_config, tiny_tokenizer  # noqa: E402

ARCHS = sorted(hf_memffn.ARCHITECTURES)
LIMIT = 4
HELLASWAG, PIQA, GENERATE = "memffn_hellaswag_local", "memffn_piqa_local", "memffn_generate_local"
TASKS = [HELLASWAG, PIQA, GENERATE]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def stock_task_yaml(task: str) -> Path:
    path = Path(lm_eval.__file__).parent / "tasks" / task / f"{task}.yaml"
    assert path.is_file(), f"lm_eval no longer ships {path}"
    return path


def write_jsonl(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs), encoding="utf-8")


def hellaswag_docs(n: int) -> list[dict]:
    """Rows with the fields the stock `process_docs` reads (activity_label, ctx_a, ctx_b, endings, label)."""
    return [
        {
            "activity_label": "Reading memory",
            "ctx_a": f"The model stores key {i} in a layer.",
            "ctx_b": "then the head",
            "endings": ["reads the value.", "stores a token.", "is the key.", "of the memory."],
            "label": str(i % 4),
        }
        for i in range(n)
    ]


def piqa_docs(n: int) -> list[dict]:
    return [
        {"goal": f"How to read value {i} from memory?", "sol1": "Use the key.", "sol2": "Use the layer.", "label": i % 2}
        for i in range(n)
    ]


def generate_docs(n: int) -> list[dict]:
    return [{"question": f"key {i} reads", "answer": "value"} for i in range(n)]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lm_eval_tasks")
    write_jsonl(root / "hellaswag.jsonl", hellaswag_docs(LIMIT))
    write_jsonl(root / "piqa.jsonl", piqa_docs(LIMIT))
    write_jsonl(root / "generate.jsonl", generate_docs(LIMIT))
    for task, stock, data in ((HELLASWAG, "hellaswag", "hellaswag.jsonl"), (PIQA, "piqa", "piqa.jsonl")):
        (root / f"{task}.yaml").write_text(
            f"include: {stock_task_yaml(stock)}\n"
            f"task: {task}\n"
            "tag: []\n"
            "dataset_path: json\n"
            "dataset_name: null\n"
            "dataset_kwargs:\n"
            f"  data_files:\n    validation: {root / data}\n"
            "training_split: null\n"
            "validation_split: validation\n",
            encoding="utf-8",
        )
    (root / f"{GENERATE}.yaml").write_text(
        f"task: {GENERATE}\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {root / 'generate.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n"
        '  until: ["\\n"]\n'
        "  max_gen_toks: 4\n"
        "  do_sample: false\n"
        "metric_list:\n"
        "  - metric: exact_match\n"
        "    aggregation: mean\n"
        "    higher_is_better: true\n",
        encoding="utf-8",
    )
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """One tiny random checkpoint per architecture, saved with its tokenizer (as a user would)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    root = tmp_path_factory.mktemp("lm_eval_checkpoints")
    folders = {}
    for arch in ARCHS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch))
        model.attach_tokenizer(tokenizer)
        folders[arch] = root / arch
        model.save_pretrained(folders[arch])
    return folders


@pytest.fixture
def offline(monkeypatch):
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)


def evaluate(task_dir: Path, model: str, model_args: dict) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    output = simple_evaluate(
        model=model,
        model_args={"trust_remote_code": True, "dtype": "float32", **model_args},
        tasks=TASKS,
        # Only our task folder is indexed (indexing all built-in tasks takes tens of seconds); the stock
        # definitions still come in through `include`.
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
        limit=LIMIT,
        batch_size=LIMIT,
        device="cpu",
        log_samples=False,
    )
    return output["results"]


def check_metrics(results: dict) -> None:
    for task in (HELLASWAG, PIQA):
        for metric in ("acc,none", "acc_norm,none"):
            assert 0.0 <= results[task][metric] <= 1.0, (task, metric, results[task])
    assert 0.0 <= results[GENERATE]["exact_match,none"] <= 1.0, results[GENERATE]


@pytest.mark.parametrize("arch", ARCHS)
def test_simple_evaluate_stock_hf_model(arch, checkpoints, task_dir, offline):
    results = evaluate(task_dir, "hf", {"pretrained": str(checkpoints[arch])})
    check_metrics(results)


def test_memoryllm_lookup_mode_matches_compute_mode(checkpoints, task_dir, offline, tmp_path):
    import hf_memffn.lm_eval_model  # noqa: F401  (registers "memffn")
    from hf_memffn.conversion.export import export_tols

    folder = checkpoints["memoryllm"]
    table = tmp_path / "table"
    export_tols(str(folder), table, format="fp32", progress=False)
    computed = evaluate(task_dir, "memffn", {"pretrained": str(folder)})
    looked_up = evaluate(
        task_dir, "memffn", {"pretrained": str(folder), "token_lookup": str(table), "token_lookup_placement": "cpu"}
    )
    check_metrics(looked_up)
    for task in (HELLASWAG, PIQA):
        assert looked_up[task]["acc,none"] == computed[task]["acc,none"]
        assert looked_up[task]["acc_norm,none"] == computed[task]["acc_norm,none"]


def test_memffn_model_refuses_lookup_for_architectures_without_memory(checkpoints, tmp_path):
    from hf_memffn.lm_eval_model import MemFFNLM

    with pytest.raises(ValueError, match="token_lookup"):
        MemFFNLM(pretrained=str(checkpoints["kvffn"]), token_lookup=str(tmp_path), device="cpu", dtype="float32")


def test_memffn_model_checks_its_lookup_arguments_before_loading_the_model(checkpoints, tmp_path, monkeypatch):
    """A placement typo, a lookup option without `token_lookup`, an architecture without lookup tables or a table
    that cannot be found were refused only once the model had been loaded (minutes for a large one): now before."""
    import transformers

    from hf_memffn.lm_eval_model import MemFFNLM

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before its lookup arguments were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    for folder, arguments, message in (
            (checkpoints["memoryllm"], {"token_lookup": str(tmp_path), "token_lookup_placement": "gpus"},
             "`token_lookup_placement`='gpus' is not supported; allowed values: 'gpu', 'cpu', 'disk'"),
            (checkpoints["memoryllm"], {"drop_memory_ffn": True}, "drop_memory_ffn need token_lookup=TABLE_DIR"),
            (checkpoints["kvffn"], {"token_lookup": str(tmp_path)}, "KVFFNForCausalLM has no token lookup tables")):
        with pytest.raises(ValueError, match=re.escape(message)):
            load_lm(MemFFNLM, folder, **arguments)
    with pytest.raises(Exception, match="missing") as refused:  # (neither a folder nor a Hub repo id)
        load_lm(MemFFNLM, checkpoints["memoryllm"], token_lookup=str(tmp_path / "missing"))
    assert not isinstance(refused.value, AssertionError)


def test_memffn_model_refuses_a_drop_memory_ffn_that_is_not_a_boolean(checkpoints, tmp_path, monkeypatch):
    """lm-eval passes `drop_memory_ffn=no` (or `0.5`, `off`) through as it is: the words were taken as true, so the
    FFN weights were dropped where a table was given, and without one the error said a table was missing."""
    import transformers

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    export_tols(str(checkpoints["memoryllm"]), tmp_path / "table", format="fp32", progress=False)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before drop_memory_ffn was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    for value, table in (("no", {}), ("no", {"token_lookup": str(tmp_path / "table")}), (0.5, {})):
        with pytest.raises(ValueError, match=re.escape(
                f"`drop_memory_ffn`={value!r} is not supported; allowed values: True, False")):
            load_lm(MemFFNLM, checkpoints["memoryllm"], drop_memory_ffn=value, **table)


def test_memffn_model_refuses_a_folder_without_a_table_or_another_models_table_before_loading(checkpoints, tmp_path,
                                                                                              monkeypatch):
    """A folder holding no table (the checkpoint's own, before `export-tols`), a table exported from a model of
    another shape and `token_lookup_placement=gpu` without CUDA were refused by `load_tols` only once the model had
    been loaded: now before, as `hf-memffn serve` refuses them."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    config = tiny_config("memoryllm")
    config.num_hidden_layers += 1
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "other")
    export_tols(str(tmp_path / "other"), tmp_path / "other_table", format="fp32", progress=False)
    export_tols(str(checkpoints["memoryllm"]), tmp_path / "table", format="fp32", progress=False)

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before its lookup table was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for arguments, error, message in (
            ({"token_lookup": str(checkpoints["memoryllm"])}, ValueError,
             "no token lookup table in this folder (token_lookup.safetensors.index.json is missing)"),
            ({"token_lookup": str(tmp_path / "other_table")}, ValueError,
             f"the table was exported from another model: num_hidden_layers={config.num_hidden_layers} "
             f"(the model has {config.num_hidden_layers - 1})"),
            ({"token_lookup": str(tmp_path / "table"), "token_lookup_placement": "gpu"}, ValueError,
             "token_lookup_placement='gpu': needs a CUDA device; allowed here: cpu, disk")):
        with pytest.raises(error, match=re.escape(message)):
            load_lm(MemFFNLM, checkpoints["memoryllm"], **arguments)

def save_adapter(folder: Path, adapter_dir: Path, **lora) -> None:
    """A LoRA adapter of random (not zero) weights for the checkpoint in `folder`, saved as PEFT saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    get_peft_model(model, LoraConfig(r=4, init_lora_weights=False, **lora)).save_pretrained(adapter_dir)


def test_memffn_model_with_an_adapter_keeps_a_padded_vocabulary_and_reads_the_table(checkpoints, tmp_path):
    """`peft=ADAPTER` on a checkpoint whose embedding has rows beyond the tokenizer's (320 rows, 301 tokens): HFLM
    resized the embedding down to the tokenizer, so the log-probabilities were normalised over 301 logits, not the
    model's 320, and a table exported from the model was refused for its vocab_size once the model and the adapter
    had loaded. Now the scores are the adapted model's own, with the table or without."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    folder = checkpoints["memoryllm"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert base.config.vocab_size > len(tokenizer)
    save_adapter(folder, tmp_path / "adapter", target_modules=["q_proj", "v_proj"])
    export_tols(str(folder), tmp_path / "table", format="fp32", progress=False)
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    expected = [score for score, _ in (hand_loglikelihood(reference, tokenizer, *pair) for pair in LL_PAIRS)]
    for table in ({}, {"token_lookup": str(tmp_path / "table"), "token_lookup_placement": "cpu"}):
        lm = load_lm(MemFFNLM, folder, batch_size=2, peft=str(tmp_path / "adapter"), **table)
        assert lm.model.get_input_embeddings().weight.shape[0] == base.config.vocab_size
        ll = lm.loglikelihood(requests("loglikelihood", LL_PAIRS))
        assert [score for score, _ in ll] == pytest.approx(expected, abs=1e-4), table


def test_memffn_model_refuses_an_adapter_the_table_cannot_be_read_under_before_loading(checkpoints, tmp_path,
                                                                                         monkeypatch):
    """An adapter on the token embedding or on the FFNs on X0, given with `token_lookup`, was refused by `load_tols`
    only once the model and the adapter had been loaded: now before the weights load."""
    import transformers

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    folder = checkpoints["memoryllm"]
    export_tols(str(folder), tmp_path / "table", format="fp32", progress=False)
    save_adapter(folder, tmp_path / "embedding", target_modules=["embed_tokens"])
    save_adapter(folder, tmp_path / "memory", target_modules=["q_proj"], modules_to_save=["memory"])
    save_adapter(folder, tmp_path / "attention", target_modules=["q_proj"])
    grown = tiny_tokenizer()  # (an adapter trained with added tokens, saved with its tokenizer)
    grown.add_tokens([f"<new_{i}>" for i in range(40)])
    grown.save_pretrained(tmp_path / "attention")

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the adapter was checked against the table")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_loading)
    for adapter, message in (("embedding", "the token embedding has parameters that its weight does not hold"),
                             ("memory", "the FFNs on X0 (memory) carry parameters that are not their weights")):
        with pytest.raises(ValueError, match=re.escape(
                f"token_lookup={str(tmp_path / 'table')!r} with peft={str(tmp_path / adapter)!r}: {message}")):
            load_lm(MemFFNLM, folder, peft=str(tmp_path / adapter), token_lookup=str(tmp_path / "table"))
    with pytest.raises(ValueError, match=re.escape(f"the tokenizer has {len(grown)} tokens, more than the model's "
                                                   "vocab_size=320, and the table holds the model's tokens only")):
        load_lm(MemFFNLM, folder, peft=str(tmp_path / "attention"), tokenizer=str(tmp_path / "attention"),
                token_lookup=str(tmp_path / "table"))


def test_memffn_model_default_table_placement_follows_the_models_device(checkpoints, tmp_path, monkeypatch):
    """`device=cpu` on a machine with CUDA: without `token_lookup_placement` the table stays on the host."""
    import torch

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    export_tols(str(checkpoints["memoryllm"]), tmp_path / "table", format="fp32", progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lm = MemFFNLM(pretrained=str(checkpoints["memoryllm"]), token_lookup=str(tmp_path / "table"), device="cpu",
                  dtype="float32")
    assert lm.model.model.token_lookup.placement == "cpu"


def test_memffn_model_default_table_placement_is_where_an_offloaded_embedding_computes(checkpoints, tmp_path,
                                                                                       monkeypatch):
    """A device map that offloaded the token embedding leaves its weight on the meta device: the table went to the
    host ("cpu") for a model computing on CUDA. Without a GPU: a meta weight with a stand-in for accelerate's hook
    (its `execution_device`), set where HFLM has loaded the model."""
    from types import SimpleNamespace

    import torch
    from lm_eval.models.huggingface import HFLM

    from hf_memffn.conversion.export import export_tols
    from hf_memffn.lm_eval_model import MemFFNLM

    export_tols(str(checkpoints["memoryllm"]), tmp_path / "table", format="fp32", progress=False)
    placements, load = [], HFLM.__init__

    def load_then_offload_the_embedding(self, **kwargs):
        load(self, **kwargs)
        embedding = self._model.get_input_embeddings()
        embedding.weight = torch.nn.Parameter(torch.empty(embedding.weight.shape, device="meta"))
        embedding._hf_hook = SimpleNamespace(execution_device="cuda:0")
        monkeypatch.setattr(self._model, "load_tols", lambda path, placement, **kwargs: placements.append(placement))

    monkeypatch.setattr(HFLM, "__init__", load_then_offload_the_embedding)
    MemFFNLM(pretrained=str(checkpoints["memoryllm"]), token_lookup=str(tmp_path / "table"), device="cpu",
             dtype="float32")
    assert placements == ["gpu"]


def test_memffn_model_reads_a_table_in_the_evaluated_repo_at_the_evaluated_revision(checkpoints, tmp_path,
                                                                                     monkeypatch):
    """`pretrained=org/m,revision=step1000,token_lookup=org/m` reads the table saved at step1000, not at `main` (whose
    table is from other weights); a table elsewhere is read at its own default revision. (A local folder stands in
    for the Hub repo; the download call is recorded.)"""
    import shutil

    import hf_memffn.lm_eval_model as lm_eval_model
    from hf_memffn.conversion.export import export_tols

    folder = tmp_path / "memoryllm"
    shutil.copytree(checkpoints["memoryllm"], folder)
    export_tols(str(folder), folder, format="fp32", progress=False)
    calls = []
    download = lm_eval_model.local_table_dir
    monkeypatch.setattr(lm_eval_model, "local_table_dir",
                        lambda path, revision=None: (calls.append((path, revision)), download(path, revision))[1])
    load_lm(lm_eval_model.MemFFNLM, folder, revision="step1000", token_lookup=str(folder))
    load_lm(lm_eval_model.MemFFNLM, checkpoints["memoryllm"], revision="step1000", token_lookup=str(folder))
    assert calls == [(str(folder), "step1000"), (str(folder), None)]


LL_PAIRS = [("the key reads", " the value"), ("memory of the layer is ", "a token"), ("", "the head stores"),
            ("a", " key of the memory reads the value")]
DOCUMENTS = ["the key reads the value of memory", "memory", "a layer stores the token of the head " * 3]
PROMPTS = ["the key reads", "memory of the layer", "a", "value is the head of a token"]


def load_lm(cls, folder: Path, **kwargs):
    return cls(pretrained=str(folder), trust_remote_code=True, device="cpu", dtype="float32", **kwargs)


def requests(kind: str, args: list[tuple]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, arg, i) for i, arg in enumerate(args)]


def log_probs(model, ids: list[int]):
    import torch

    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hand_loglikelihood(model, tokenizer, context: str, continuation: str,
                       max_length: int | None = None) -> tuple[float, bool]:
    """`<s>` + context, then the continuation (with the context's trailing spaces) scored token by token; with
    `max_length`, the model reads only the last `max_length` tokens before the last one (the context is cut from the
    left)."""
    stripped = context.rstrip()
    context_ids = [tokenizer.bos_token_id] + tokenizer.encode(stripped, add_special_tokens=False)
    continuation_ids = tokenizer.encode(context[len(stripped):] + continuation, add_special_tokens=False)
    ids = (context_ids + continuation_ids)[-(max_length + 1) if max_length else 0 :]
    rows = log_probs(model, ids[:-1])[-len(continuation_ids) :]
    score = sum(row[token].item() for row, token in zip(rows, continuation_ids))
    return score, rows.argmax(-1).tolist() == continuation_ids


def hand_rolling(model, tokenizer, document: str, max_length: int | None = None) -> float:
    """Every token of the document scored after exactly one `<s>`: in one window, or with `max_length` in windows
    of `max_length` scored tokens, each read after the `max_length` tokens before its last one."""
    ids = [tokenizer.bos_token_id] + tokenizer.encode(document, add_special_tokens=False)
    window = max_length or len(ids)
    score = 0.0
    for first in range(1, len(ids), window):  # (the first scored token of each window)
        end = min(first + window, len(ids))
        rows = log_probs(model, ids[max(0, end - 1 - window) : end - 1])[-(end - first) :]
        score += sum(row[token].item() for row, token in zip(rows, ids[first:end]))
    return score


def hand_greedy(model, tokenizer, prompt: str, max_new_tokens: int) -> list[int]:
    ids, new = tokenizer.encode(prompt), []
    for _ in range(max_new_tokens):
        token = log_probs(model, ids + new)[-1].argmax().item()
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
    return new


def hand_generations(model, tokenizer) -> tuple[list[tuple], list[str]]:
    """`generate_until` requests in two groups (a newline stop and 3 tokens / a stop word taken from the greedy output
    and 6 tokens) and the greedy texts cut before the first stop string."""
    args, expected = [], []
    for prompt in PROMPTS:
        greedy = hand_greedy(model, tokenizer, prompt, 6)
        words = [w for w in (tokenizer.decode([t]) for t in greedy[2:]) if w.strip() and w.isascii()]
        for until, max_gen_toks in ((["\n"], 3), (words[:1] or ["\n"], 6)):
            args.append((prompt, {"until": until, "max_gen_toks": max_gen_toks, "do_sample": False}))
            text = tokenizer.decode(greedy[:max_gen_toks], skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            expected.append(text)
    return args, expected


@pytest.mark.parametrize("arch,lookup", [("flash_mhf", False), ("memoryllm", False), ("memoryllm", True)])
def test_memffn_requests_match_hand_computation(arch, lookup, checkpoints, tmp_path):
    """loglikelihood, loglikelihood_rolling (exactly one `<s>`) and generate_until, at batch sizes 1 and 4."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_memffn.lm_eval_model import MemFFNLM

    folder = checkpoints[arch]
    extra = {}
    if lookup:
        from hf_memffn.conversion.export import export_tols

        export_tols(str(folder), tmp_path / "table", format="fp32", progress=False)
        extra = {"token_lookup": str(tmp_path / "table"), "token_lookup_placement": "cpu"}
    reference = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected_ll = [hand_loglikelihood(reference, tokenizer, *pair) for pair in LL_PAIRS]
    expected_rolling = [hand_rolling(reference, tokenizer, document) for document in DOCUMENTS]
    generation_args, expected_generations = hand_generations(reference, tokenizer)
    for batch_size in (1, 4):
        lm = load_lm(MemFFNLM, folder, batch_size=batch_size, **extra)
        rolling = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in DOCUMENTS]))
        assert rolling == pytest.approx(expected_rolling, abs=1e-4), batch_size
        ll = lm.loglikelihood(requests("loglikelihood", LL_PAIRS))
        assert [s for s, _ in ll] == pytest.approx([s for s, _ in expected_ll], abs=1e-4), batch_size
        assert [g for _, g in ll] == [g for _, g in expected_ll], batch_size
        assert lm.generate_until(requests("generate_until", generation_args)) == expected_generations, batch_size


@pytest.mark.parametrize("arch", ARCHS)
def test_memffn_requests_of_every_architecture_match_hand_computation(arch, checkpoints):
    """Each architecture, in batches of 3 requests of different lengths (right padding for loglikelihoods, left
    padding for generations), with `max_length` below the longest requests: a long context is cut from the left, a
    long document is scored in several windows."""
    from hf_memffn.lm_eval_model import MemFFNLM

    max_length = 16
    lm = load_lm(MemFFNLM, checkpoints[arch], batch_size=3, max_length=max_length)
    pairs = LL_PAIRS + [("the key reads the value of memory " * 4, " the value")]
    documents = DOCUMENTS + ["the head of the layer reads a key " * 6]
    assert len(lm.tok_encode(documents[-1])) > 2 * max_length  # (three windows)
    expected_ll = [hand_loglikelihood(lm.model, lm.tokenizer, *pair, max_length=max_length) for pair in pairs]
    expected_rolling = [hand_rolling(lm.model, lm.tokenizer, document, max_length) for document in documents]
    ll = lm.loglikelihood(requests("loglikelihood", pairs))
    assert [s for s, _ in ll] == pytest.approx([s for s, _ in expected_ll], abs=1e-4)
    assert [g for _, g in ll] == [g for _, g in expected_ll]
    rolling = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in documents]))
    assert rolling == pytest.approx(expected_rolling, abs=1e-4)
    generation_args, expected_generations = hand_generations(lm.model, lm.tokenizer)
    assert lm.generate_until(requests("generate_until", generation_args)) == expected_generations


@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm"])
def test_stock_hf_model_rolling_workaround(arch, checkpoints):
    """The stock `hf` model scores rolling documents after one `<s>` with `add_bos_token=False` (README)."""
    from lm_eval.models.huggingface import HFLM

    lm = load_lm(HFLM, checkpoints[arch], batch_size=2, add_bos_token=False)
    expected = [hand_rolling(lm.model, lm.tokenizer, document) for document in DOCUMENTS]
    rolling = lm.loglikelihood_rolling(requests("loglikelihood_rolling", [(d,) for d in DOCUMENTS]))
    assert rolling == pytest.approx(expected, abs=1e-4)


def test_memffn_model_is_the_stock_hf_model_on_a_llama_but_for_rolling_documents(tmp_path):
    """On transformers' Llama with this package's tokenizer, `memffn` gives the stock `hf` model's loglikelihoods and
    generations, and its rolling scores are the stock model's with `add_bos_token=False` (the README's workaround),
    not its default `<s> <s> text`."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM

    from hf_memffn.lm_eval_model import MemFFNLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    memffn, stock = (load_lm(cls, tmp_path, batch_size=3) for cls in (MemFFNLM, HFLM))
    generation_args = [(prompt, {"until": ["\n"], "max_gen_toks": 4, "do_sample": False}) for prompt in PROMPTS]
    assert memffn.loglikelihood(requests("loglikelihood", LL_PAIRS)) == stock.loglikelihood(
        requests("loglikelihood", LL_PAIRS))
    assert memffn.generate_until(requests("generate_until", generation_args)) == stock.generate_until(
        requests("generate_until", generation_args))
    documents = requests("loglikelihood_rolling", [(d,) for d in DOCUMENTS])
    rolling = memffn.loglikelihood_rolling(documents)
    without_bos = load_lm(HFLM, tmp_path, batch_size=3, add_bos_token=False).loglikelihood_rolling(documents)
    assert rolling == pytest.approx(without_bos, abs=1e-5)
    assert rolling == pytest.approx([hand_rolling(stock.model, stock.tokenizer, d) for d in DOCUMENTS], abs=1e-4)
    assert all(abs(doubled - single) > 1e-3 for doubled, single in zip(stock.loglikelihood_rolling(documents), rolling))


def test_tokenizer_flags_say_it_adds_bos_and_setting_add_eos_keeps_it(checkpoints):
    """The package's tokenizer added `<s>` while it read `add_bos_token=False`, and setting `add_eos_token=True`
    rebuilt its template from those flags without `<s>`. Saved beside a checkpoint and reloaded, it adds `<s>` as
    before (transformers 5.x keeps the template, not the flags); the flags given to `from_pretrained` rebuild the
    template, as lm-eval's `add_bos_token=False` does."""
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = tiny_tokenizer()
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    assert (tokenizer.add_bos_token, tokenizer.add_eos_token) == (True, False)
    bare = tokenizer("the key", add_special_tokens=False).input_ids
    assert bos not in bare and tokenizer("the key").input_ids == [bos, *bare]
    tokenizer.add_eos_token = True
    assert tokenizer("the key").input_ids == [bos, *bare, eos]
    assert tokenizer("the key", add_special_tokens=False).input_ids == bare

    folder = checkpoints["flash_mhf"]
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded("the key").input_ids == [bos, *bare]
    assert loaded("the key", add_special_tokens=False).input_ids == bare
    second = loaded("a value", add_special_tokens=False).input_ids
    assert loaded("the key", "a value").input_ids == [bos, *bare, bos, *second]  # (a pair: `<s>` before each text)
    both = AutoTokenizer.from_pretrained(folder, add_bos_token=True, add_eos_token=True)
    assert (both.add_bos_token, both.add_eos_token) == (True, True) and both("the key").input_ids == [bos, *bare, eos]
    assert load_lm(HFLM, folder, batch_size=1).tok_encode("the key") == [bos, *bare]
    assert load_lm(HFLM, folder, batch_size=1, add_bos_token=False).tok_encode("the key") == bare


def test_cli(checkpoints, task_dir, tmp_path):
    """The `lm_eval` command (it indexes every built-in task first, so one architecture and one task only)."""
    out = tmp_path / "out"
    env = {**os.environ, **OFFLINE_ENV}
    command = [
        sys.executable, "-m", "lm_eval",
        "--model", "hf",
        "--model_args", f"pretrained={checkpoints['flash_mhf']},trust_remote_code=True,dtype=float32",
        "--tasks", PIQA,
        "--include_path", str(task_dir),
        "--limit", str(LIMIT),
        "--batch_size", str(LIMIT),
        "--device", "cpu",
        "--output_path", str(out),
    ]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    [results_file] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(results_file).read_text())["results"]
    assert 0.0 <= results[PIQA]["acc,none"] <= 1.0 and 0.0 <= results[PIQA]["acc_norm,none"] <= 1.0, results


def test_the_command_without_lm_eval_names_the_extra_to_install_in_one_line():
    """`python -m hf_memffn.lm_eval_model` where lm-eval-harness is not installed ended in the import's traceback."""
    completed = run_python(blocked_imports("lm_eval") + (
        "import runpy; runpy.run_module('hf_memffn.lm_eval_model', run_name='__main__', alter_sys=True)"), "--help")
    assert completed.returncode == 1 and "Traceback" not in completed.stderr, completed.stderr[-2000:]
    assert completed.stderr.strip() == ("hf_memffn.lm_eval_model needs lm-eval-harness, which is not installed: "
                                        "pip install 'hf-memffn[eval]' (or pip install lm_eval)")
    completed = run_python(blocked_imports("lm_eval") + "import hf_memffn.lm_eval_model")  # imported: the same words
    assert "ModuleNotFoundError: hf_memffn.lm_eval_model needs lm-eval-harness" in completed.stderr
