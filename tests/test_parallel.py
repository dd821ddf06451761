"""Tensor and pipeline parallelism through transformers' own machinery, and FSDP2 (`fully_shard`, wrapped as
examples/accelerate/fsdp2.yaml wraps, and transformers' own `DistributedConfig(fsdp_size=2)`), on 2 gloo processes on
the CPU, for every architecture and task head: under TP the causal LM's logits and gradients and each head's outputs
match the single-process model's; under PP the causal LM's logits do, and the other heads are refused; under FSDP2 one
training step updates the weights as one process does on the whole batch (FlashMHF under transformers' FSDP, which
shards while loading, is refused). Where the machine has four cores, transformers' FSDP beside TP and beside
replicas (HSDP) on 4 processes too."""

from __future__ import annotations

import inspect
import json
import os
import subprocess

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import (
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

import hf_memffn
from hf_memffn.testing import REMOTE_CODE_FILES, tiny_config, torchrun_command

pytest.importorskip("transformers.distributed")
from transformers.distributed import DistributedConfig  # noqa: E402

# tiny configs whose split dims divide by 2: attention/KV heads, FFN widths, FlashMHF's sub-network width
ARCHS = sorted(hf_memffn.ARCHITECTURES)
HEADS = {"sequence_classification": AutoModelForSequenceClassification,
         "token_classification": AutoModelForTokenClassification,
         "question_answering": AutoModelForQuestionAnswering}
WORKER = r"""
import inspect
import json
import sys
import torch, torch.distributed as dist
import hf_memffn
from torch.distributed.fsdp import fully_shard
from transformers import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                          AutoModelForTokenClassification)
from transformers.distributed import DistributedConfig

HEADS = {"causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification,
         "token_classification": AutoModelForTokenClassification, "question_answering": AutoModelForQuestionAnswering}


def tp(root, archs, inputs):
    results = {}
    for arch in archs:
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", distributed_config=DistributedConfig(tp_size=2))
        logits = model(inputs["ids"]).logits
        logits.float().square().mean().backward()
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            if grad is not None and hasattr(grad, "full_tensor"):
                grad = grad.full_tensor()
            if grad is not None:
                grads[name] = grad
        sharded = sorted(n for n, p in model.named_parameters() if hasattr(p, "placements")
                         and any(type(pl).__name__ == "Shard" for pl in p.placements))
        results[arch] = {"logits": logits.detach(), "grads": grads, "sharded": sharded}
        for head in HEADS:
            if head != "causal_lm":
                model = HEADS[head].from_pretrained(f"{root}/{arch}_{head}",
                                                    distributed_config=DistributedConfig(tp_size=2))
                with torch.no_grad():
                    output = model(inputs["ids"])
                results[f"{arch}_{head}"] = {key: value for key, value in output.items() if torch.is_tensor(value)}
    # a token lookup table beside sharded weights: loading it checks the fingerprint of the whole tensors
    model = AutoModelForCausalLM.from_pretrained(f"{root}/memoryllm", distributed_config=DistributedConfig(tp_size=2))
    model.load_tols(f"{root}/memoryllm_table", placement="cpu")
    with torch.no_grad():
        results["memoryllm table"] = {"logits": model(inputs["ids"]).logits}
    # refused, with a clear error: FlashMHF's chunked recompute (its backward would recompute the block outside
    # the sharded forward), a KV-FFN width that leaves a rank half a key/value pair, attention heads that do not
    # split over the ranks
    results["refused"] = refusal(lambda: AutoModelForCausalLM.from_pretrained(
        f"{root}/flash_mhf_recompute", distributed_config=DistributedConfig(tp_size=2)))
    results["refused kvffn width"] = refusal(lambda: AutoModelForCausalLM.from_pretrained(
        f"{root}/kvffn_odd_width", distributed_config=DistributedConfig(tp_size=2)))
    results["refused attention heads"] = refusal(lambda: AutoModelForCausalLM.from_pretrained(
        f"{root}/memoryllm_one_kv_head", tp_plan="auto"))
    # and FlashMHF sub-networks whose share of columns on each rank the Triton kernels do not take
    results["refused kernel share"] = refusal(lambda: AutoModelForCausalLM.from_pretrained(
        f"{root}/flash_mhf_triton_narrow", distributed_config=DistributedConfig(tp_size=2)))
    # and the parametrizations of `hf_memffn.adapters` on sharded weights (they would mix a DTensor with its shard)
    from hf_memffn import adapters
    sharded = AutoModelForCausalLM.from_pretrained(f"{root}/flash_mhf", distributed_config=DistributedConfig(tp_size=2))
    results["refused lora"] = refusal(lambda: adapters.add_weight_lora(sharded))
    results["refused int8"] = refusal(lambda: adapters.quantize_weights_int8(sharded))
    return results


def pp(root, archs, inputs):
    results = {}
    for arch in archs:
        model = AutoModelForCausalLM.from_pretrained(f"{root}/{arch}", distributed_config=DistributedConfig(pp_size=2))
        results[arch] = {"logits": model(inputs["ids"]).logits.detach()}

    def load_tols():
        model = AutoModelForCausalLM.from_pretrained(f"{root}/memoryllm",
                                                     distributed_config=DistributedConfig(pp_size=2))
        model.load_tols(f"{root}/memoryllm_table", placement="cpu")

    # refused, with a clear error: token lookup tables, and the heads whose outputs the pipeline cannot pass on
    results["refused"] = refusal(load_tols)
    for arch in archs:
        for head in HEADS:
            if head != "causal_lm":
                results[f"refused {arch}_{head}"] = refusal(lambda: HEADS[head].from_pretrained(
                    f"{root}/{arch}_{head}", distributed_config=DistributedConfig(pp_size=2)))
    return results


def fsdp2(root, archs, inputs):
    # wrap units as accelerate's FSDP2 plugin picks them for examples/accelerate/fsdp2.yaml (the model's
    # `_no_split_modules`), then the root; each rank takes one of the batch's two rows
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy

    results = {}
    for arch in archs:
        for head, auto_class in HEADS.items():
            name = arch if head == "causal_lm" else f"{arch}_{head}"
            model = auto_class.from_pretrained(f"{root}/{name}")
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
            policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
            units = [module for module in model.modules() if policy(module)]
            for unit in units:
                fully_shard(unit)
            fully_shard(model)
            results[name] = {**training_step_on_one_row(model, inputs, head), "units": len(units)}
            if head == "causal_lm":
                save_full_state_dict(model, f"{root}/{arch}_fsdp2_saved")
        # transformers' own FSDP, sharding while it loads: FlashMHF's joined sub-network weights are refused
        load = lambda: AutoModelForCausalLM.from_pretrained(f"{root}/{arch}",
                                                            distributed_config=DistributedConfig(fsdp_size=2))
        if arch == "flash_mhf":
            results["refused flash_mhf fsdp_size"] = refusal(load)
            # replicas only (HSDP's outer dim, where transformers has it): every rank loads whole tensors
            if "dp_replicate_size" in inspect.signature(DistributedConfig).parameters:
                model = AutoModelForCausalLM.from_pretrained(
                    f"{root}/{arch}", distributed_config=DistributedConfig(dp_replicate_size=2))
                results[f"{arch} dp_replicate_size"] = training_step_on_one_row(model, inputs, "causal_lm")
        else:
            results[f"{arch} fsdp_size"] = training_step_on_one_row(load(), inputs, "causal_lm")
    results["memoryllm table mixed precision"] = table_under_mixed_precision(root, inputs)
    return results


def table_under_mixed_precision(root, inputs):
    # a token lookup table loaded before wrapping each layer and the root with bf16 parameters (fsdp2.yaml's
    # mixed_precision), the embedding and memory FFN frozen: each forward's check of the table's inputs sees the
    # gathered bf16 weights, which FSDP2 frees after the backward. Two steps of the rest, then the table's logits and
    # those computed without it
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model = AutoModelForCausalLM.from_pretrained(f"{root}/memoryllm")
    model.load_tols(f"{root}/memoryllm_table", placement="cpu")
    model.model.embed_tokens.requires_grad_(False)
    model.model.memory.requires_grad_(False)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.1)
    row = inputs["ids"][dist.get_rank():dist.get_rank() + 1]
    for _ in range(2):
        model(row, labels=row).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        table_logits = model(inputs["ids"]).logits.float()
        model.unload_tols()
        return {"table": table_logits, "computed": model(inputs["ids"]).logits.float()}


def save_full_state_dict(model, folder):
    # as accelerate saves with fsdp2.yaml's FULL_STATE_DICT (the Trainer's checkpoints, final/): the weights gathered
    # to rank 0, written by the sharded model's save_pretrained
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(folder, state_dict=state_dict)
    dist.barrier()


def fsdp_with_tp_or_replicas(root, archs, inputs):
    # 4 processes, transformers' mesh (pp, dp_replicate, fsdp, tp) with tp the fastest dim: rank // 2 is the fsdp
    # coordinate beside tp, the replica beside fsdp; either way each row goes to two of the four ranks
    results = {}
    for layout in fsdp_layouts:
        name = ",".join(f"{key}=2" for key in layout)
        for arch in archs:
            load = lambda: AutoModelForCausalLM.from_pretrained(f"{root}/{arch}",
                                                                distributed_config=DistributedConfig(**layout))
            if arch == "flash_mhf":
                results[f"refused {arch} {name}"] = refusal(load)
            else:
                results[f"{arch} {name}"] = training_step_on_one_row(load(), inputs, "causal_lm",
                                                                     row=dist.get_rank() // 2)
    return results


def training_step_on_one_row(model, inputs, head, row=None):
    # one SGD step of a sharded model on one row of the batch (this rank's, unless given): the mean loss over the
    # ranks, the weights
    row = dist.get_rank() if row is None else row
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    labels = {key: value[row:row + 1] for key, value in inputs[head].items()}
    loss = model(inputs["ids"][row:row + 1], **labels).loss
    loss.backward()
    optimizer.step()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    weights = {n: p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
               for n, p in model.named_parameters()}
    return {"loss": mean_loss / dist.get_world_size(), "weights": weights}


def refusal(load):
    try:
        load()
    except ValueError as error:
        return str(error)
    return None


modes, root, archs = sys.argv[1].split(","), sys.argv[2], sys.argv[3].split(",")
fsdp_layouts = json.loads(sys.argv[4])  # for fsdp_with_tp_or_replicas
dist.init_process_group("gloo")
torch.manual_seed(0)
inputs = torch.load(f"{root}/inputs.pt")
results = {mode: globals()[mode](root, archs, inputs) for mode in modes}  # (one launch of the two processes)
if dist.get_rank() == 0:
    torch.save(results, f"{root}/results.pt")
dist.destroy_process_group()
"""


def one_training_step(model, inputs: dict, labels: dict) -> tuple[torch.Tensor, dict]:
    """The loss and the weights after one SGD step on the whole batch, in this process."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(inputs["ids"], **labels).loss
    loss.backward()
    optimizer.step()
    return loss.detach(), {name: param.detach().clone() for name, param in model.named_parameters()}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each architecture's causal LM and task heads saved, and what one process computes with them."""
    root = tmp_path_factory.mktemp("parallel")
    torch.manual_seed(0)
    ids = torch.randint(3, 320, (2, 12))
    inputs = {"ids": ids, "causal_lm": {"labels": ids},
              "sequence_classification": {"labels": torch.tensor([0, 2])},
              "token_classification": {"labels": torch.randint(0, 3, (2, 12))},
              "question_answering": {"start_positions": torch.tensor([1, 4]), "end_positions": torch.tensor([3, 9])}}
    torch.save(inputs, root / "inputs.pt")
    expected = {}
    for arch in ARCHS:
        overrides = {"tie_word_embeddings": True} if arch == "kvffn" else {}
        model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
        model.save_pretrained(root / arch)
        logits = model(ids).logits
        logits.float().square().mean().backward()
        expected[arch] = {"logits": logits.detach(),
                          "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}
        model.zero_grad()
        expected[arch]["step"] = one_training_step(model, inputs, inputs["causal_lm"])
        for head, auto_class in HEADS.items():
            torch.manual_seed(0)
            # in eval mode, as from_pretrained leaves the processes' models (no dropout before the token classifier)
            model = auto_class.from_config(tiny_config(arch, num_labels=3, pad_token_id=0)).eval()
            model.save_pretrained(root / f"{arch}_{head}")
            with torch.no_grad():
                output = model(ids)
            expected[f"{arch}_{head}"] = {"outputs": {k: v for k, v in output.items() if torch.is_tensor(v)},
                                          "step": one_training_step(model, inputs, inputs[head])}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_recompute_chunk_tokens=8)).save_pretrained(
        root / "flash_mhf_recompute")
    AutoModelForCausalLM.from_config(tiny_config("kvffn", intermediate_size=127)).save_pretrained(
        root / "kvffn_odd_width")
    AutoModelForCausalLM.from_config(tiny_config("memoryllm", num_key_value_heads=1)).save_pretrained(
        root / "memoryllm_one_kv_head")
    # sub-networks of 48 columns (96 // 2), 24 on each of 2 ranks, for the Triton kernels
    AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_num_heads=1, ffn_num_kv_heads=1,
                                                 ffn_kernel="triton")).save_pretrained(root / "flash_mhf_triton_narrow")
    from hf_memffn.conversion.export import export_tols

    export_tols(root / "memoryllm", root / "memoryllm_table", format="fp32", progress=False)
    (root / "worker.py").write_text(WORKER)
    return root, expected


@pytest.fixture(scope="module")
def parallel_results(checkpoints) -> dict:
    """What the two processes computed under tensor parallelism, pipeline parallelism and FSDP2."""
    root, _ = checkpoints
    return run_workers(root, "tp,pp,fsdp2")


def run_workers(root, modes: str, processes: int = 2, layouts: tuple = ()) -> dict:
    # gloo on the CPU, like the one-process reference (on a GPU machine, rank 1 would ask for a second GPU)
    # the workers import the copy of hf_memffn this test imported, installed or not
    package_root = os.path.dirname(os.path.dirname(hf_memffn.__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    command = torchrun_command(processes, root / "worker.py", modes, root, ",".join(ARCHS), json.dumps(layouts))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return torch.load(root / "results.pt", weights_only=True)


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(checkpoints, parallel_results):
    _, expected = checkpoints
    results = parallel_results["tp"]
    for arch in ARCHS:
        torch.testing.assert_close(results[arch]["logits"], expected[arch]["logits"], rtol=1e-4, atol=1e-5,
                                   msg=lambda m: f"{arch}: {m}")
        for name, grad in expected[arch]["grads"].items():
            torch.testing.assert_close(results[arch]["grads"][name], grad, rtol=1e-3, atol=1e-6,
                                       msg=lambda m: f"{arch} {name}: {m}")
        for head in HEADS:
            outputs = expected[f"{arch}_{head}"]["outputs"]
            assert set(results[f"{arch}_{head}"]) == set(outputs)
            for key, value in outputs.items():
                torch.testing.assert_close(results[f"{arch}_{head}"][key], value, rtol=1e-4, atol=1e-5,
                                           msg=lambda m: f"{arch} {head} {key}: {m}")
    torch.testing.assert_close(results["memoryllm table"]["logits"], expected["memoryllm"]["logits"], rtol=1e-4,
                               atol=1e-5)
    sharded = {arch: results[arch]["sharded"] for arch in ARCHS}
    assert {"model.layers.0.mlp.key_up_value", "model.layers.1.mlp.key_up_value"} <= set(sharded["flash_mhf"])
    assert {"model.memory.gate_proj", "model.memory.down_proj"} <= set(sharded["memoryllm"])
    assert "model.layers.0.mlp.gate_proj.weight" in sharded["flex_memoryllm"]
    assert "model.layers.0.mlp.key_value_proj.weight" in sharded["kvffn"]
    assert "ffn_recompute_chunk_tokens=8 does not work under tensor parallelism" in results["refused"]
    assert "intermediate_size=127 must divide by tp_size=2" in results["refused kvffn width"]
    assert "num_key_value_heads=1 must divide by tp_size=2" in results["refused attention heads"]
    # refused while loading, not at the first forward's kernel check on a share the config never named
    assert "subnetwork_size=48 (intermediate_size // ffn_num_subnetworks) split over tp_size=2 leaves each rank 24 " \
        "columns" in results["refused kernel share"]
    assert "allowed tp_size: 1, 3, or ffn_kernel='torch'" in results["refused kernel share"]
    for key, function in (("refused lora", "add_weight_lora"), ("refused int8", "quantize_weights_int8")):
        message = results[key]
        assert message and message.startswith(f"{function}: ['model.layers.0.mlp.key_up_value'")
        assert "are sharded by tensor parallelism" in message


@pytest.mark.slow
def test_pipeline_parallel_matches_one_process(checkpoints, parallel_results):
    """transformers' pipeline passes only hidden states between stages; MemoryLLM and FlexMemoryLLM get X0 too."""
    _, expected = checkpoints
    results = parallel_results["pp"]
    for arch in ARCHS:
        torch.testing.assert_close(results[arch]["logits"], expected[arch]["logits"], rtol=1e-4, atol=1e-5)
    # later stages have neither the embeddings nor the token ids a table is indexed by
    assert "token lookup tables do not work under pipeline parallelism" in results["refused"]
    # its last stage broadcasts [batch, length, vocab] logits; a classifier's would fail there, the others waiting
    for arch in ARCHS:
        for head, auto_class in HEADS.items():
            error = results[f"refused {arch}_{head}"]
            head_class = auto_class.__name__.removeprefix("AutoModel")  # e.g. ForSequenceClassification
            assert error and f"{head_class} does not work under pipeline parallelism" in error, (arch, head, error)


@pytest.mark.slow
def test_fsdp2_training_step_matches_one_process(checkpoints, parallel_results):
    """FSDP2 shards each wrap unit's weights over the two processes, each of which computes one row of the batch;
    after one step every weight equals the one-process step on both rows (the gradients averaged over the ranks).
    Sharded after loading, as accelerate does, for every architecture and head; sharded while loading, as
    transformers' `DistributedConfig(fsdp_size=2)` does, for the causal LMs but FlashMHF's, which is refused there
    and steps replicated (`dp_replicate_size=2`) where transformers has that. Each causal LM's gathered weights,
    saved by the sharded model as accelerate saves them, carry the model's own code and load back."""
    _, expected = checkpoints
    results = parallel_results["fsdp2"]
    runs = {name: name for arch in ARCHS for name in [arch] + [f"{arch}_{head}" for head in HEADS]}
    runs.update({f"{arch} fsdp_size": arch for arch in ARCHS if arch != "flash_mhf"})
    if "dp_replicate_size" in inspect.signature(DistributedConfig).parameters:
        runs["flash_mhf dp_replicate_size"] = "flash_mhf"
    for run, name in runs.items():
        loss, weights = expected[name]["step"]
        torch.testing.assert_close(results[run]["loss"], loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{run}: {m}")
        assert results[run]["weights"].keys() == weights.keys()
        for key, weight in weights.items():
            torch.testing.assert_close(results[run]["weights"][key], weight, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{run} {key}: {m}")
        if " " not in run:
            # every decoder layer, and MemoryLLM's stacked token memory, is a unit of its own
            assert results[run]["units"] == 2 + run.startswith(("memoryllm", "flex_memoryllm")), run
    # each causal LM saved after its step: its own modeling code and auto_map (not torch's FSDP2 class and file), and
    # the stepped weights load back
    root, _ = checkpoints
    for arch in ARCHS:
        folder = root / f"{arch}_fsdp2_saved"
        assert {p.name for p in folder.glob("*.py")} == REMOTE_CODE_FILES[arch], arch
        auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
        assert auto_map == type(tiny_config(arch)).default_auto_map(), arch
        loaded = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
        for key, weight in expected[arch]["step"][1].items():
            torch.testing.assert_close(loaded[key], weight, rtol=1e-5, atol=1e-7, msg=lambda m: f"{arch} {key}: {m}")
    # a table under bf16 mixed precision trains the rest and reads as the FFNs on X0 computed in bf16 do
    table_run = results["memoryllm table mixed precision"]
    torch.testing.assert_close(table_run["table"], table_run["computed"], rtol=0, atol=2e-2)
    # its checkpoint's key, up and value are joined into one parameter while loading: sharded first, out of order
    assert "does not load under transformers' FSDP (distributed_config with fsdp_size=2)" in \
        results["refused flash_mhf fsdp_size"]


# transformers' two-dimensional meshes with FSDP: TP beside it from 5.18 (5.17 meshes the first tp_size ranks only,
# and the others fail on their first TP layer, its own Llama's too), replicas beside it (HSDP) where it has them
FSDP_LAYOUTS = tuple(
    layout for layout, available in (
        ({"tp_size": 2, "fsdp_size": 2}, Version(transformers.__version__).release >= (5, 18)),
        ({"dp_replicate_size": 2, "fsdp_size": 2},
         "dp_replicate_size" in inspect.signature(DistributedConfig).parameters))
    if available)


@pytest.mark.slow
@pytest.mark.skipif(not FSDP_LAYOUTS, reason="this transformers has no FSDP beside TP or replicas")
@pytest.mark.skipif((os.cpu_count() or 1) < 4, reason="four gloo processes need four cores (the GPU machine has them)")
def test_fsdp_beside_tensor_parallelism_or_replicas_matches_one_process(checkpoints):
    """transformers' FSDP on a two-dimensional mesh of four processes, `DistributedConfig(tp_size=2, fsdp_size=2)` and
    HSDP's `DistributedConfig(dp_replicate_size=2, fsdp_size=2)`: one training step of each causal LM equals the
    one-process step on the whole batch; FlashMHF is refused as under `fsdp_size=2` alone."""
    root, expected = checkpoints
    results = run_workers(root, "fsdp_with_tp_or_replicas", processes=4, layouts=FSDP_LAYOUTS)
    results = results["fsdp_with_tp_or_replicas"]
    assert len(results) == len(FSDP_LAYOUTS) * len(ARCHS)
    for run, result in results.items():
        if run.startswith("refused"):
            assert "does not load under transformers' FSDP" in result, (run, result)
            continue
        loss, weights = expected[run.split()[0]]["step"]
        torch.testing.assert_close(result["loss"], loss, rtol=1e-5, atol=1e-6, msg=lambda m: f"{run}: {m}")
        assert result["weights"].keys() == weights.keys()
        for key, weight in weights.items():
            torch.testing.assert_close(result["weights"][key], weight, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{run} {key}: {m}")


@pytest.mark.parametrize("kernel, device_type, refused", [("auto", "cuda", True), ("triton", "cpu", True),
                                                        ("auto", "cpu", False), ("torch", "cuda", False)])
def test_flash_mhf_refuses_a_column_share_the_kernels_do_not_take(kernel, device_type, refused):
    """Under tensor parallelism each rank runs `subnetwork_size / tp_size` columns of every sub-network: where the
    Triton kernels run them ("auto" on GPUs, the default there), loading refuses a share that is not a multiple of 16
    (48 / 2 = 24 here); the PyTorch reference takes any share."""
    model = AutoModelForCausalLM.from_config(tiny_config("flash_mhf", ffn_num_heads=1, ffn_num_kv_heads=1,
                                                         ffn_kernel=kernel))
    block = model.model.layers[0].mlp

    def check(tp_size):
        block.check_distributed_loading(DistributedConfig(tp_size=tp_size), "FlashMHFLlamaForCausalLM",
                                        device_type=device_type)

    check(3)  # 16 columns on each rank
    if refused:
        with pytest.raises(ValueError, match=r"subnetwork_size=48 .* leaves each rank 24 columns .* allowed tp_size: "
                                             r"1, 3, or ffn_kernel='torch'"):
            check(2)
    else:
        check(2)


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


@pytest.mark.parametrize("arch, fields", [("flash_mhf", {"ffn_variant": "pkv"}), ("kvffn", {"ffn_variant": "densenet"}),
                                          ("memoryllm", {"tie_word_embeddings": True})])
def test_parallel_plans_follow_fields_set_after_the_config_was_built(arch, fields):
    """A field set by hand (`config.update(...)`, `config.ffn_variant = ...`) changes the blocks a model builds: the
    model's plans are those of its blocks, not of the config as it was built (FlashMHF's partial sum on the PKV
    baseline would sum its replicated output over the ranks; KV-FFN's `key_value_proj` is not in DenseNet)."""
    config = tiny_config(arch)
    config.update(fields)
    model = AutoModelForCausalLM.from_config(config)
    expected = AutoModelForCausalLM.from_config(tiny_config(arch, **fields))
    assert model.tp_plan == expected.tp_plan
    assert model.pp_plan == expected.pp_plan
