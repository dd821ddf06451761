"""Tensor and pipeline parallelism through transformers' own machinery, on 2 gloo processes on the CPU: every
architecture's logits (and FlashMHF's and MemoryLLM's gradients under TP) match the single-process model's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_memffn
from hf_memffn.testing import tiny_config

pytest.importorskip("transformers.distributed")

# tiny configs whose split dims divide by 2: attention/KV heads, FFN widths, FlashMHF's sub-network width
ARCHS = sorted(hf_memffn.ARCHITECTURES)
WORKER = r"""
import json, sys
import torch, torch.distributed as dist
import hf_memffn
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig


def run(mode, root, archs, ids):
    results = {}
    for arch in archs:
        sizes = {"tp_size": 2} if mode == "tp" else {"pp_size": 2}
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", distributed_config=DistributedConfig(**sizes))
        logits = model(ids).logits
        results[arch] = {"logits": logits.detach().tolist()}
        if mode == "tp":
            logits.float().square().mean().backward()
            grads = {}
            for name, param in model.named_parameters():
                grad = param.grad
                if grad is not None and hasattr(grad, "full_tensor"):
                    grad = grad.full_tensor()
                if grad is not None:
                    grads[name] = grad.tolist()
            results[arch]["grads"] = grads
            results[arch]["sharded"] = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements")
                                              and any(type(pl).__name__ == "Shard" for pl in p.placements))
    # refused, with a clear error: FlashMHF's chunked recompute under TP, token lookup tables under PP
    try:
        if mode == "tp":
            AutoModelForCausalLM.from_pretrained(f"{root}/flash_mhf_recompute",
                                                 distributed_config=DistributedConfig(tp_size=2))
        else:
            model = AutoModelForCausalLM.from_pretrained(f"{root}/memoryllm",
                                                         distributed_config=DistributedConfig(pp_size=2))
            model.load_tols(f"{root}/memoryllm_table", placement="cpu")
        results["refused"] = None
    except ValueError as error:
        results["refused"] = str(error)
    return results


modes, root, archs = sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(",")
dist.init_process_group("gloo")
torch.manual_seed(0)
ids = torch.load(f"{root}/ids.pt")
results = {mode: run(mode, root, archs, ids) for mode in modes}  # (one launch of the two processes for both)
if dist.get_rank() == 0:
    with open(f"{root}/results.json", "w") as handle:
        json.dump(results, handle)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    torch.manual_seed(0)
    ids = torch.randint(3, 320, (2, 12))
    torch.save(ids, root / "ids.pt")
    expected = {}
    for arch in ARCHS:
        overrides = {"tie_word_embeddings": True} if arch == "kvffn" else {}
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
        model.save_pretrained(root / arch)
        logits = model(ids).logits
        logits.float().square().mean().backward()
        expected[arch] = (logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=8)).save_pretrained(
        root / "flash_mhf_recompute")
    from hf_memffn.conversion.export import export_tols

    export_tols(root / "memoryllm", root / "memoryllm_table", format="fp32", progress=False)
    (root / "worker.py").write_text(WORKER)
    return root, expected


@pytest.fixture(scope="module")
def parallel_results(checkpoints) -> dict:
    """What the two processes computed under tensor parallelism ("tp") and under pipeline parallelism ("pp")."""
    root, _ = checkpoints
    return run_workers(root, "tp,pp")


def run_workers(root, modes: str) -> dict:
    # gloo on the CPU, like the one-process reference (on a GPU machine, rank 1 would ask for a second GPU)
    # the workers import the copy of hf_memffn this test imported, installed or not
    package_root = os.path.dirname(os.path.dirname(hf_memffn.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
               str(free_port()), str(root / "worker.py"), modes, str(root), ",".join(ARCHS)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "results.json").read_text())


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(checkpoints, parallel_results):
    _, expected = checkpoints
    results = parallel_results["tp"]
    for arch in ARCHS:
        logits, grads = expected[arch]
        torch.testing.assert_close(torch.tensor(results[arch]["logits"]), logits, rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{arch}: {m}")
        for name, grad in grads.items():
            torch.testing.assert_close(torch.tensor(results[arch]["grads"][name]), grad, rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"{arch} {name}: {m}")
    sharded = {arch: results[arch]["sharded"] for arch in ARCHS}
    assert {"model.layers.0.mlp.key_up_value", "model.layers.1.mlp.key_up_value"} <= set(sharded["flash_mhf"])
    assert {"model.memory.gate_proj", "model.memory.down_proj"} <= set(sharded["memoryllm"])
    assert "model.layers.0.mlp.gate_proj.weight" in sharded["flex_memoryllm"]
    assert "model.layers.0.mlp.key_value_proj.weight" in sharded["kvffn"]
    # its backward would recompute the block outside the sharded forward
    assert "ffn_recompute_chunk_tokens=8 does not work under tensor parallelism" in results["refused"]


@pytest.mark.slow
def test_pipeline_parallel_matches_one_process(checkpoints, parallel_results):
    """transformers' pipeline passes only hidden states between stages; MemoryLLM and FlexMemoryLLM get X0 too."""
    _, expected = checkpoints
    results = parallel_results["pp"]
    for arch in ARCHS:
        torch.testing.assert_close(torch.tensor(results[arch]["logits"]), expected[arch][0], rtol=1e-4, atol=1e-5)
    # later stages have neither the embeddings nor the token ids a table is indexed by
    assert "token lookup tables do not work under pipeline parallelism" in results["refused"]


@pytest.mark.parametrize("arch", ARCHS)
def test_parallel_plans_name_existing_modules_and_are_not_saved(arch, tmp_path):
    config = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(config)
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    generic = {".".join("*" if part.isdigit() else part for part in name.split(".")) for name in names}
    assert model.tp_plan and model.pp_plan
    for key in list(model.tp_plan) + list(model.pp_plan):
        assert key in generic, key
    if config.token_memory_size is not None:
        assert "inputs_embeds" in config.base_model_pp_plan["layers"][0]
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "base_model_tp_plan" not in saved and "base_model_pp_plan" not in saved
