"""DeepSpeed ZeRO-2 / ZeRO-3 on the CPU (one process, gloo), where `deepspeed` is installed; skipped elsewhere.

It does not install from `.[test]`: its source distribution imports torch while building, so pip's isolated build
would fetch a CUDA torch. Install it next to the CPU torch with
`DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed` (ops are then built on first use; none is used here), as
CI does for its transformers 5.17 job.

In a child Python (DeepSpeed keeps process-wide state):
* ZeRO-3 `zero.Init` through transformers (`HfDeepSpeedConfig`): loading a checkpoint of every architecture's causal LM
  and task heads (sequence and token classifiers, question answering) shards every parameter, MemoryLLM's stacked
  `TokenMemory` and FlashMHF's sub-network tensors included; gathering them gives back the saved tensors; one training
  step of the DeepSpeed engine equals a plain PyTorch step;
* the committed `examples/accelerate/ds_zero2.json` / `ds_zero3.json`, their "auto" values filled by the Trainer,
  train a MemoryLLM and a FlashMHFLlama for three steps with the losses of the same Trainer run without DeepSpeed.
And the README's command, `accelerate launch --config_file examples/accelerate/deepspeed_zero{2,3}.yaml
examples/pretrain.py ...`, with one CPU process, against the same recipe run without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_memffn.testing import tiny_config

ROOT = Path(__file__).resolve().parents[1]
CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    # the process group's store on a port the system picks, bound and kept: a fixed port may be held by another run
    # on the machine (a second CI job, a launcher in the other worker), which stopped this one with EADDRINUSE
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    import deepspeed
    from transformers import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                              AutoModelForTokenClassification, Trainer, TrainingArguments)
    from transformers.integrations import HfDeepSpeedConfig

    import hf_memffn
    from hf_memffn.testing import tiny_config

    work, root = sys.argv[1], sys.argv[2]
    results = {"zero3": {}, "trainer": {}}
    # every architecture's causal LM and task heads, each with its labels
    ids = torch.randint(0, 320, (2, 9), generator=torch.Generator().manual_seed(1))
    heads = {"causal_lm": (AutoModelForCausalLM, {"labels": ids}),
             "sequence_classification": (AutoModelForSequenceClassification, {"labels": torch.tensor([0, 2])}),
             "token_classification": (AutoModelForTokenClassification, {"labels": torch.randint(0, 3, (2, 9))}),
             "question_answering": (AutoModelForQuestionAnswering, {"start_positions": torch.tensor([1, 4]),
                                                                   "end_positions": torch.tensor([3, 8])})}
    # (no dropout before the token classifier: the engine's step and the plain one see the same model)
    head_fields = {"num_labels": 3, "pad_token_id": 0, "classifier_dropout": 0.0}
    checkpoints = {}
    for arch in hf_memffn.ARCHITECTURES:
        for head, (auto_class, _) in heads.items():
            torch.manual_seed(0)
            config = tiny_config(arch, **(head_fields if head != "causal_lm" else {}))
            checkpoints[arch, head] = f"{work}/{arch}_{head}"
            auto_class.from_config(config).save_pretrained(checkpoints[arch, head])

    # ZeRO-3 through transformers' zero.Init, then one engine step against plain PyTorch
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "zero_allow_untested_optimizer": True}
    for (arch, head), path in checkpoints.items():
        auto_class, labels = heads[head]
        reference = auto_class.from_pretrained(path)
        keep_alive = HfDeepSpeedConfig(config)
        model = auto_class.from_pretrained(path)
        sharded = {name: list(p.ds_shape) for name, p in model.named_parameters() if hasattr(p, "ds_id") and p.numel() == 0}
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            gathered = {name: (p.detach() - reference.state_dict()[name]).abs().max().item()
                        for name, p in model.named_parameters()}
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                          config=config)
        loss = engine(input_ids=ids, **labels).loss
        engine.backward(loss)
        engine.step()
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        reference_loss = reference(input_ids=ids, **labels).loss
        reference_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            stepped = max((p.detach() - reference.state_dict()[name]).abs().max().item()
                          for name, p in engine.module.named_parameters())
        results["zero3"][f"{arch}/{head}"] = {
            "parameters": [name for name, _ in reference.named_parameters()], "sharded": sharded,
            "gather_max_diff": max(gathered.values()), "loss": loss.item(), "reference_loss": reference_loss.item(),
            "step_max_diff": stepped, "repr": repr(engine.module)[:80],
        }
        del keep_alive, engine

    # the committed configs through the Trainer ("auto" values filled from TrainingArguments)
    ids = torch.randint(0, 320, (8, 16), generator=torch.Generator().manual_seed(2))
    data = [{"input_ids": row, "labels": row} for row in ids]
    for arch in ("memoryllm", "flash_mhf"):
        for name in ("none", "ds_zero2", "ds_zero3"):
            deepspeed_config = None if name == "none" else f"{root}/examples/accelerate/{name}.json"
            args = TrainingArguments(f"{work}/run-{arch}-{name}", deepspeed=deepspeed_config, use_cpu=True,
                                     per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2, logging_steps=1,
                                     save_strategy="no", report_to=[], disable_tqdm=True)
            model = AutoModelForCausalLM.from_pretrained(checkpoints[arch, "causal_lm"])
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
            results["trainer"][f"{arch}/{name}"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            del trainer, model, args
    with open(f"{work}/results.json", "w") as handle:
        json.dump(results, handle)
    """
)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (see this file's docstring)")
    work = tmp_path_factory.mktemp("deepspeed")
    completed = subprocess.run([sys.executable, "-c", CHILD, str(work), str(ROOT)], cwd=ROOT,
                               capture_output=True, text=True, timeout=600,
                               env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads((work / "results.json").read_text())


@pytest.mark.parametrize("head", ["causal_lm", "sequence_classification", "token_classification", "question_answering"])
@pytest.mark.parametrize("arch", ["flash_mhf", "memoryllm", "flex_memoryllm", "kvffn"])
def test_zero3_shards_gathers_and_steps_every_parameter(results, arch, head):
    result = results["zero3"][f"{arch}/{head}"]
    assert sorted(result["sharded"]) == sorted(result["parameters"])  # every parameter sharded, none left whole
    if arch in ("memoryllm", "flex_memoryllm"):
        assert len(result["sharded"]["model.memory.gate_proj"]) == 3  # the stacked [layers, I, d] memory FFN
    if arch == "flash_mhf":
        assert len(result["sharded"]["model.layers.0.mlp.key_up_value"]) == 4  # [3 * H_kv, E, d_e, d_h]
    assert result["gather_max_diff"] == 0.0
    assert abs(result["loss"] - result["reference_loss"]) < 1e-6
    assert result["step_max_diff"] < 1e-6


@pytest.mark.parametrize("arch", ["memoryllm", "flash_mhf"])
@pytest.mark.parametrize("config", ["ds_zero2", "ds_zero3"])
def test_committed_configs_train_like_the_plain_trainer(results, arch, config):
    plain, deepspeed = results["trainer"][f"{arch}/none"], results["trainer"][f"{arch}/{config}"]
    assert len(plain) == len(deepspeed) == 3
    assert max(abs(a - b) for a, b in zip(plain, deepspeed)) < 1e-4, (plain, deepspeed)


def recipe_run(tmp_path, name: str, launcher: list[str]) -> dict:
    import random

    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        rng = random.Random(0)
        words = "the key reads a value from memory while each head stores one token of the layer".split()
        corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))})
                                  + "\n" for _ in range(200)))
    out = tmp_path / name
    recipe = [str(ROOT / "examples" / "pretrain.py"), "--arch", "memoryllm", "--preset", "tiny", "--data-files",
              str(corpus), "--train-tokenizer", "300", "--block-size", "32", "--per-device-batch-size", "4",
              "--logging-steps", "2", "--eval-steps", "4", "--save-steps", "1000", "--max-eval-blocks", "4",
              "--max-steps", "4", "--seed", "0", "--output-dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run([*launcher, *recipe], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-4000:]
    losses = [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines() if '"loss"' in line]
    return {"losses": losses, "summary": json.loads((out / "summary.json").read_text()), "log": completed.stdout}


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="deepspeed is not installed (see this file's docstring)")
    return tmp_path_factory.mktemp("recipe")


@pytest.fixture(scope="module")
def plain_recipe(recipe_dir):
    return recipe_run(recipe_dir, "plain", [sys.executable])


@pytest.mark.parametrize("stage", ["2", "3"])
def test_readme_accelerate_deepspeed_command_runs_the_recipe(recipe_dir, plain_recipe, stage):
    plain = plain_recipe
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              f"examples/accelerate/deepspeed_zero{stage}.yaml", "--num_processes", "1"]
    zero = recipe_run(recipe_dir, f"zero{stage}", launch)
    assert zero["summary"]["parameters"] == plain["summary"]["parameters"]  # counted whole, not per ZeRO-3 shard
    assert zero["summary"]["parameters"]["total"] > 0 and zero["summary"]["flops_per_token"] == plain["summary"]["flops_per_token"]
    assert len(zero["losses"]) == len(plain["losses"]) == 2
    if stage == "2":  # same initial weights: the same losses
        assert max(abs(a - b) for a, b in zip(zero["losses"], plain["losses"])) < 1e-3, (zero, plain)
    else:  # zero.Init draws the initial weights in another order: same scale, another sample
        assert abs(zero["losses"][0] - plain["losses"][0]) < 0.1 and zero["losses"][-1] < zero["losses"][0]


def test_token_memory_repr_survives_sharded_parameters():
    """ZeRO-3 leaves each parameter an empty placeholder and DeepSpeed prints the model: the printout must not read
    the stacked memory FFN's sizes from the parameters (runs without deepspeed)."""
    model = AutoModelForCausalLM.from_config(tiny_config("memoryllm"))
    for parameter in model.model.memory.parameters():
        parameter.data = torch.empty(0)
    assert "layers=2, hidden_size=64, intermediate_size=128" in repr(model)
