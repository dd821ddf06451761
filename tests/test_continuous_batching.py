"""Continuous batching (`model.generate_batch`: paged KV cache, the requests of a step flattened into one row) gives
greedy `generate()`'s tokens for the Llama baseline and the four architectures, and a MemoryLLM / FlexMemoryLLM reading
its token lookup table there gets exactly the token ids of the flattened batch: logits equal compute mode's at every
step, with the memory FFN weights dropped."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM

import hf_memffn
from hf_memffn.conversion import export_tols
from hf_memffn.testing import tiny_config

EOS = 2
# A small paged cache and token budget: prompts are prefilled in chunks, and prefill chunks of some requests share a
# step with the decoding tokens of others.
# (transformers 5.17 calls the page size `block_size`; later versions `page_size`)
_PAGE = "page_size" if "page_size" in {f.name for f in dataclasses.fields(ContinuousBatchingConfig)} else "block_size"
CB_CONFIG = {"num_blocks": 16, _PAGE: 16, "max_batch_tokens": 48}
PROMPT_LENGTHS = (5, 37, 9, 23, 3, 14)
MAX_NEW_TOKENS = 10


def build(arch: str):
    torch.manual_seed(0)
    config = tiny_config(arch)
    model = LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)
    return model.eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 320, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generation_config() -> GenerationConfig:
    return GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=EOS, pad_token_id=0)


def greedy_one_by_one(model, inputs) -> list[list[int]]:
    outputs = []
    with torch.no_grad():
        for ids in inputs:
            outputs.append(model.generate(torch.tensor([ids]), generation_config=generation_config())[0, len(ids):].tolist())
    return outputs


def continuous_batching(model, inputs) -> list[list[int]]:
    results = model.generate_batch(inputs, generation_config=generation_config(), progress_bar=False,
                                   continuous_batching_config=ContinuousBatchingConfig(**CB_CONFIG))
    return [results[f"req_{i}"].generated_tokens for i in range(len(inputs))]


@pytest.mark.parametrize("arch", ["llama", *hf_memffn.ARCHITECTURES])
def test_generate_batch_equals_greedy_generate(arch):
    model = build(arch)
    inputs = prompts()
    assert continuous_batching(model, inputs) == greedy_one_by_one(model, inputs)


class BatchRecorder:
    """Records, for every forward of the continuous-batching loop: the flattened input ids, the number of requests
    in the step, the ids the token lookup table was asked for, and the logits."""

    def __init__(self, model):
        self.steps = []
        self.handles = [
            model.register_forward_pre_hook(self._inputs, with_kwargs=True),
            model.lm_head.register_forward_hook(lambda module, args, output: self.steps[-1].update(logits=output.clone())),
        ]
        table = model.model.token_lookup
        if table is not None:
            readout = table.readout
            table.readout = lambda ids: (self.steps[-1].update(table_ids=ids.clone()), readout(ids))[1]

    def _inputs(self, module, args, kwargs):
        self.steps.append({"input_ids": kwargs["input_ids"].clone(), "requests": kwargs["cu_seq_lens_q"].numel() - 1})

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.fixture(scope="module", params=["memoryllm", "flex_memoryllm"])
def exported(request, tmp_path_factory):
    model = build(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    export_tols(model, directory, format="fp32", progress=False)
    return model, directory


PLACEMENTS = ["cpu", "disk", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_token_lookup_table_reads_the_flattened_batch(exported, placement):
    model, directory = exported
    device = "cuda" if placement == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    compute = copy.deepcopy(model).to(device)
    lookup = copy.deepcopy(model).to(device)
    freed = lookup.load_tols(directory, placement=placement, drop_memory_ffn=True) and lookup.model.memory is None
    assert freed and lookup.model.token_lookup.placement == placement
    inputs = prompts()

    recorded = {}
    for name, candidate in (("compute", compute), ("lookup", lookup)):
        recorder = BatchRecorder(candidate)
        try:
            tokens = continuous_batching(candidate, inputs)
        finally:
            recorder.remove()
        recorded[name] = (tokens, recorder.steps)

    tokens, steps = recorded["lookup"]
    assert tokens == recorded["compute"][0] == greedy_one_by_one(model, inputs)
    assert any(step["requests"] > 1 and step["input_ids"].shape[1] > step["requests"] for step in steps), \
        "no step mixed several requests with a prefill: the test would not exercise the flattened layout"
    compute_steps = recorded["compute"][1]
    assert len(steps) == len(compute_steps)
    for step, reference in zip(steps, compute_steps):
        assert torch.equal(step["table_ids"].reshape(-1).cpu(), step["input_ids"].reshape(-1).cpu())
        assert torch.equal(step["input_ids"], reference["input_ids"])
        scale = reference["logits"].abs().max()
        assert (step["logits"] - reference["logits"]).abs().max() <= 1e-5 * scale


def test_token_id_check_reads_nothing_back_while_a_cuda_graph_is_captured(monkeypatch):
    """Continuous batching with CUDA graphs (`ContinuousBatchingConfig(use_cuda_graph=True)`; transformers' default
    with an attention kernel that needs no mask, such as flash attention) captures the model's forward: the range
    check of the token ids, which copies them to the host, failed every request with "Cannot copy between CPU and
    CUDA tensors during CUDA graph capture". (CUDA ids and a capturing stream stood in for on the CPU; the GPU test
    below runs the real capture.)"""
    from hf_memffn.modeling_memffn import check_token_ids

    out_of_range = torch.tensor([[5, 400]])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(ValueError, match="token id 400"):
        check_token_ids(out_of_range, 320)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    check_token_ids(out_of_range, 320)
    with pytest.raises(ValueError, match="input_ids is empty"):  # what needs no read-back is still checked
        check_token_ids(torch.zeros(1, 0, dtype=torch.long), 320)


def test_a_disk_table_under_a_cuda_graph_capture_names_the_placement_and_the_way_out(exported, monkeypatch):
    """The disk placement copies each forward's token ids to the host; continuous batching with CUDA graphs
    (`use_cuda_graph`, transformers' default with flash attention) captures the forward, where CUDA refuses such a
    copy with an error that names neither the table nor what to change. The table refuses first, naming both. (CUDA
    ids and a capturing stream stood in for on the CPU, as above.)"""
    from hf_memffn.token_lookup import TokenLookupError

    model, directory = exported
    table = copy.deepcopy(model).load_tols(directory, placement="disk")
    ids = torch.tensor([[5, 6, 7]])
    expected = table.readout(ids).layer_values(0)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda tensor: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(TokenLookupError, match=r"placement='disk'.*use_cuda_graph=False.*placement='gpu' or "
                                               r"placement='cpu'"):
        table.readout(ids)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert torch.equal(table.readout(ids).layer_values(0), expected)  # not capturing: read as before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", *hf_memffn.ARCHITECTURES, "memoryllm_table"])
def test_generate_batch_with_cuda_graphs_equals_greedy_generate(arch, tmp_path):
    """Every forward captured in CUDA graphs and replayed: greedy `generate()`'s tokens, also from a GPU table."""
    overrides = {"ffn_kernel": "torch"} if arch == "flash_mhf" else {}  # (tiny heads: no Triton kernel takes them)
    torch.manual_seed(0)
    config = tiny_config(arch.removesuffix("_table"), **overrides)
    model = (LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)).cuda().eval()
    inputs = prompts()
    with torch.no_grad():
        expected = [model.generate(torch.tensor([ids], device="cuda"), generation_config=generation_config())
                    [0, len(ids):].tolist() for ids in inputs]
    if arch == "memoryllm_table":
        export_tols(model, tmp_path, format="fp32", progress=False)
        model.load_tols(tmp_path, placement="gpu", drop_memory_ffn=True)
    graphs = ContinuousBatchingConfig(**CB_CONFIG, use_cuda_graph=True)
    results = model.generate_batch(inputs, generation_config=generation_config(), progress_bar=False,
                                   continuous_batching_config=graphs)
    assert [results[f"req_{i}"].error for i in range(len(inputs))] == [None] * len(inputs)
    assert [results[f"req_{i}"].generated_tokens for i in range(len(inputs))] == expected


def _load_throughput_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "bench_continuous_batching.py"
    spec = importlib.util.spec_from_file_location("bench_continuous_batching", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_throughput_benchmark_runs_at_toy_size(tmp_path):
    """examples/bench_continuous_batching.py, as the GPU run uses it, at a toy size on the CPU."""
    import json

    bench = _load_throughput_benchmark()
    bench.main(["--preset", "tiny", "--archs", "llama", "flash_mhf", "memoryllm", "--requests", "4",
                "--prompt-lengths", "3,30", "--new-tokens", "2,6", "--vocab-size", "400", "--num-blocks", "16",
                "--max-batch-tokens", "64", "--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    rows = {row["model"]: row for row in report["results"]}
    assert list(rows) == ["Llama (transformers)", "FlashMHFLlama", "MemoryLLM", "MemoryLLM + lookup table"]
    assert all("error" not in row and row["requests_per_s"] > 0 and row["generated_tokens_per_s"] > 0
               for row in rows.values()), rows
    lookup = rows["MemoryLLM + lookup table"]
    assert lookup["active_parameters"] < rows["MemoryLLM"]["parameters"]  # the memory FFN weights were dropped
    assert rows["FlashMHFLlama"]["flash_mhf_path"].startswith("unfused layer")
    assert report["device"].startswith("CPU") and report["device"] in (tmp_path / "continuous_batching.md").read_text()


def test_throughput_benchmark_sizes_the_cpu_cache_for_its_workload(tmp_path):
    """On the CPU, transformers sizes the paged cache from the machine's whole memory (5.17: 80% of it, less this
    process), whatever other processes hold: the README's smoke run (`--preset tiny --requests 8 --device cpu`) asked
    for some 18 GiB on a 23 GiB machine and was killed; 5.17 given --num-blocks alone sized the tokens per step from
    that memory (14.6 GB). Without them the cache holds the workload, and a step at most all its prompts."""
    bench = _load_throughput_benchmark()

    def config(*options, device="cpu"):
        args = bench.build_parser().parse_args(["--preset", "tiny", *options, "--out", str(tmp_path)])
        return bench.paged_cache_config(args, requests, torch.device(device))

    requests = [([5] * 300, 200), ([5] * 40, 10), ([5] * 256, 1)]
    page = getattr(config(), "page_size", None) or config().block_size
    assert page == 256 and (config().num_blocks, config().max_batch_tokens) == (2 + 1 + 2, 300 + 40 + 256 + 3)
    assert (config("--num-blocks", "7").num_blocks, config("--num-blocks", "7").max_batch_tokens) == (7, 599)
    given_tokens = config("--max-batch-tokens", "32")
    assert (given_tokens.num_blocks, given_tokens.max_batch_tokens) == (5, 32)
    requests = [([5] * 512, 256)] * 64  # the default workload's largest: a step of transformers' default at most
    assert (config().num_blocks, config().max_batch_tokens) == (64 * 3, 8192)
    assert (config(device="cuda").num_blocks, config(device="cuda").max_batch_tokens) == (None, None)  # device memory


def test_throughput_benchmark_rounds_pair_every_model_with_llama(tmp_path):
    """--rounds: every model warmed up once, then timed in turns; each row has its rounds and its ratio to Llama in
    the same round."""
    import json

    bench = _load_throughput_benchmark()
    bench.main(["--preset", "tiny", "--archs", "llama", "kvffn", "--no-token-lookup", "--requests", "3",
                "--prompt-lengths", "3,12", "--new-tokens", "2,4", "--vocab-size", "300", "--num-blocks", "16",
                "--max-batch-tokens", "32", "--device", "cpu", "--rounds", "2", "--synchronised-steps", "2",
                "--profiled-steps", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    llama, kvffn = report["results"]
    # the first two steps of every timed round taken apart (host part and the device's remainder)
    assert all([d["step"] for d in r["steps"]["synchronised"]] == [0, 1] and r["memory_at_start"]["free_gib"] is None
               and "profile" in r["steps"]["synchronised"][0] for r in kvffn["rounds"] + llama["rounds"])
    assert [len(llama["rounds"]), len(kvffn["rounds"])] == [2, 2] and "x_baseline" not in llama
    assert all(r["gc_pauses"]["count"] >= 0 and "tuned" in r["compilations"] for r in kvffn["rounds"])
    # the steps' token counts: a timed round counts as new only those the warm-up and earlier rounds did not meet
    first_met = [kvffn["warmup_steps"]["first_met"]] + [r["steps"]["first_met"] for r in kvffn["rounds"]]
    assert kvffn["warmup_steps"]["steps"] > 0 and all(r["steps"]["steps"] > 0 for r in kvffn["rounds"])
    assert first_met[0] and all(not set(a) & set(b) for i, a in enumerate(first_met) for b in first_met[i + 1:])
    ratios = [r["generated_tokens_per_s"] / b["generated_tokens_per_s"]
              for r, b in zip(kvffn["rounds"], llama["rounds"])]
    assert kvffn["x_baseline"]["rounds"] == ratios
    assert kvffn["x_baseline"]["low"] <= kvffn["x_baseline"]["median"] <= kvffn["x_baseline"]["high"]
    assert kvffn["compilations"]["per_round"] == [0, 0] and kvffn["warmup_compilations"]["count"] == 0  # CPU
    assert "| x Llama |" in (tmp_path / "continuous_batching.md").read_text()
    for wrong in (["--rounds", "0"], ["--synchronised-steps", "-1"], ["--profiled-steps", "1"]):
        with pytest.raises(SystemExit):
            bench.main([*wrong, "--out", str(tmp_path)])



def test_throughput_benchmark_refuses_an_empty_workload_before_building_a_model(tmp_path, capsys):
    """--requests 0 made every model a row "failed: max() arg is an empty sequence", after building it."""
    bench = _load_throughput_benchmark()
    toy = ["--preset", "tiny", "--archs", "llama", "--no-token-lookup", "--device", "cpu", "--out", str(tmp_path)]
    for wrong, message in ((["--requests", "0"], "--requests must be at least 1"),
                           (["--vocab-size", "3"], "--vocab-size must be at least 4"),
                           (["--num-blocks", "0"], "--num-blocks must be at least 1"),
                           (["--max-batch-tokens", "-1"], "--max-batch-tokens must be at least 1")):
        with pytest.raises(SystemExit):
            bench.main([*toy, "--requests", "2", "--new-tokens", "2", *wrong])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "continuous_batching.json").exists()


def test_throughput_benchmark_refuses_an_unknown_preset_before_writing(tmp_path, capsys):
    """--preset Tiny made every model a row "failed: ValueError: preset='Tiny' ..." in the written results, after
    the workloads were drawn, where the other arguments are refused with the usage."""
    bench = _load_throughput_benchmark()
    with pytest.raises(SystemExit):
        bench.main(["--preset", "Tiny", "--archs", "llama", "--no-token-lookup", "--requests", "1", "--device", "cpu",
                    "--out", str(tmp_path / "out")])
    assert "argument --preset: invalid choice: 'Tiny'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_throughput_benchmark_report_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A write that failed left `continuous_batching.json.tmp` beside the results (a fixed temporary name, not
    removed), where `hf_memffn.atomic_write` leaves nothing."""
    import os

    bench = _load_throughput_benchmark()
    monkeypatch.setattr(bench, "to_markdown", lambda report: "| table |\n")
    bench.write_report({"results": []}, str(tmp_path))
    before = (tmp_path / "continuous_batching.json").read_text()

    def rename_fails(source, target):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", rename_fails)
    with pytest.raises(OSError):
        bench.write_report({"results": [{"model": "Llama"}]}, str(tmp_path))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["continuous_batching.json", "continuous_batching.md"]
    assert (tmp_path / "continuous_batching.json").read_text() == before


def test_throughput_benchmark_refuses_token_lookup_without_a_memoryllm(tmp_path, capsys):
    """--token-lookup given with --archs lacking memoryllm ran no lookup-table model and said nothing."""
    bench = _load_throughput_benchmark()
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--archs", "llama", "--token-lookup", "--device", "cpu",
                    "--out", str(tmp_path)])
    assert "--token-lookup runs a MemoryLLM reading a lookup table: it needs memoryllm in --archs, got llama" \
        in capsys.readouterr().err
    assert not (tmp_path / "continuous_batching.json").exists()
    args = bench.build_parser().parse_args(["--archs", "llama", "--out", str(tmp_path)])
    assert args.token_lookup is None  # left out: on exactly when memoryllm is among --archs


def test_throughput_benchmark_exits_1_when_a_model_failed(tmp_path, monkeypatch):
    """A model that failed left its error in its row, and the process exited 0 (cold_cache_first_step.sh then
    reported the run as a success)."""
    import json
    import runpy
    import sys

    bench = _load_throughput_benchmark()  # puts examples/ on the path
    import presets

    def broken(name):
        raise RuntimeError("no such preset today")

    monkeypatch.setattr(presets, "get_preset", broken)
    monkeypatch.setattr(sys, "argv", [bench.__file__, "--preset", "tiny", "--archs", "llama", "--requests", "1",
                                      "--device", "cpu", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(bench.__file__, run_name="__main__")
    assert stop.value.code == 1
    report = json.loads((tmp_path / "continuous_batching.json").read_text())
    assert report["results"] == [{"model": "Llama (transformers)", "error": "RuntimeError: no such preset today"}]

def test_triton_compilations_are_recorded_through_the_jit_hooks(monkeypatch):
    """The benchmarks' record of compilations (kernels/harness.py): Triton calls the cache hook before building a
    kernel and the post-compile hook after; an autotuner benchmarks each configuration through `Autotuner._bench`;
    a compiled kernel's first launch loads it (`CompiledKernel._init_handles`), later ones find it loaded. The hooks,
    the benchmark and the loader in place before are restored."""
    pytest.importorskip("triton")
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.autotuner import Autotuner

    _load_throughput_benchmark()  # puts kernels/ on the path
    from harness import TritonCompilations

    def bench(autotuner, *args, config, **kwargs):  # what Triton's would return: the timings of one configuration
        return [float(config)]

    def init_handles(kernel):  # what Triton's does: load the module once
        kernel.module = kernel.module or "module"

    monkeypatch.setattr(Autotuner, "_bench", bench)
    monkeypatch.setattr(CompiledKernel, "_init_handles", init_handles)
    # compiled kernels as the loader sees them: their JIT function (named by it) and whether a module is loaded
    jit_function = type("JITFunction", (), {})()
    jit_function.__name__ = "_add_forward_splits_kernel"
    source = type("Source", (), {"fn": jit_function})()
    compiled = [type("Compiled", (), {"src": source, "name": "?", "module": module})() for module in (None, "m")]
    saved = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    tuner = type("Tuner", (), {"fn": type("Kernel", (), {"fn": lambda: None, "name": "_forward_kernel"})()})()
    with TritonCompilations() as compilations:
        function = type("Info", (), {"name": "_decode_kernel"})()
        assert knobs.runtime.jit_cache_hook(key="k", repr="_decode_kernel[num_warps=4]()", fn=function) is None
        knobs.runtime.jit_post_compile_hook(key="k", repr="_decode_kernel[num_warps=4]()", fn=function)
        knobs.runtime.jit_post_compile_hook(key="other", repr="_norm_kernel[num_warps=4]()")
        assert [Autotuner._bench(tuner, 1, config=c) for c in (2, 3)] == [[2.0], [3.0]]
        for kernel in (*compiled, compiled[0]):  # the first one loaded at its first launch only; the second was loaded
            CompiledKernel._init_handles(kernel)
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == saved
    assert Autotuner._bench is bench and CompiledKernel._init_handles is init_handles
    assert compilations.summary()["loaded"]["kernels"] == {"_add_forward_splits_kernel": 1}
    summary = compilations.summary()
    assert summary["count"] == 2 and summary["kernels"] == {"_decode_kernel": 1, "_norm_kernel": 1}
    assert compilations.events[0][1] >= 0
    assert summary["tuned"]["configs"] == 2 and summary["tuned"]["kernels"] == {"_forward_kernel": 2}


def test_gc_pauses_are_recorded_while_active():
    """The benchmark's record of Python's garbage collector pauses (kernels/harness.py): each collection inside the
    block, with its generation; the callback is removed after."""
    import gc

    _load_throughput_benchmark()  # puts kernels/ on the path
    from harness import GcPauses

    with GcPauses() as pauses:
        gc.collect()
    gc.collect()
    summary = pauses.summary()
    assert summary["count"] == 1 and summary["per_generation"][2] == 1 and summary["longest_generation"] == 2
    assert summary["longest_s"] == summary["seconds"] >= 0 and pauses._callback not in gc.callbacks


def test_forward_steps_are_recorded_with_their_token_counts():
    """The benchmark's record of a serving loop's steps (kernels/harness.py): every forward call's token count and
    the time to the next call; the token counts met before (``seen``, shared) are not counted as new."""
    _load_throughput_benchmark()  # puts kernels/ on the path
    from harness import ForwardSteps

    class Model(torch.nn.Module):
        def forward(self, input_ids=None, inputs_embeds=None):
            return input_ids if input_ids is not None else inputs_embeds

    module, seen = Model(), {3}
    with ForwardSteps(module, seen) as steps:
        for tokens in (3, 5, 5):
            module(torch.zeros(1, tokens))  # (positionally)
        module(input_ids=torch.zeros(1, 7))
        module(inputs_embeds=torch.zeros(1, 2, 4))
    summary = steps.summary(slowest=2)
    assert summary["steps"] == 5 and summary["token_counts"] == 4 and summary["first_met"] == [2, 5, 7]
    assert seen == {2, 3, 5, 7} and len(summary["slowest"]) == 2
    assert all(seconds >= 0 and collected is None for seconds, _, _, collected in summary["slowest"])
    assert not module._forward_pre_hooks
    import gc

    from harness import GcPauses

    with GcPauses() as pauses, ForwardSteps(module) as steps:
        module(torch.zeros(1, 4))
        gc.collect()
        module(torch.zeros(1, 4))
    (seconds, tokens, new, collected), = steps.summary(gc_pauses=pauses)["slowest"]
    assert tokens == 4 and new and 0 < collected <= seconds  # the collection fell within the first step

    # the first two calls taken apart: host part, the device's remainder, the allocator's counters (zeros on a CPU)
    with ForwardSteps(module, synchronised_steps=2) as steps:
        for tokens in (6, 3, 9):
            module(torch.zeros(1, tokens))
    first, second = steps.summary()["synchronised"]
    assert (first["step"], first["tokens"], second["step"], second["tokens"]) == (0, 6, 1, 3)
    assert 0 <= first["host_s"] <= first["step_s"] and first["device_wait_s"] >= 0
    assert first["num_device_alloc"] == first["num_alloc_retries"] == 0 and not module._forward_hooks
    # the first of them profiled: the module's forward is among the costliest functions
    with ForwardSteps(module, synchronised_steps=2, profiled_steps=1) as steps:
        for tokens in (6, 3):
            module(torch.zeros(1, tokens))
    first, second = steps.summary()["synchronised"]
    assert "profile" not in second and first["profile"]["total_s"] >= 0
    assert any(name.endswith("(forward)") and calls == 1 for name, calls, _, _ in first["profile"]["cumulative"])
    with pytest.raises(ValueError, match="synchronised_steps=-1"):
        ForwardSteps(module, synchronised_steps=-1)
    with pytest.raises(ValueError, match="profiled_steps=2"):
        ForwardSteps(module, synchronised_steps=1, profiled_steps=2)


def test_readme_quotes_the_committed_continuous_batching_run_it_calls_current():
    """The README's serving section names the H100 run of the current code; its table and the row "continuous
    batching" of the table at the top quote that run's ratios to Llama (median, lowest-highest over its rounds). The
    top row had kept an earlier call's ratios after the serving section moved on to a new run."""
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    current = re.search(r"\*\*Results on an H100\*\* \(`(examples/results/continuous_batching_h100_rounds/[\w/]+)`",
                        readme).group(1)
    report = json.loads((root / current / "continuous_batching.json").read_text())
    quoted = {row["model"]: "{median:.2f} ({low:.2f}-{high:.2f})".format(**row["x_baseline"])
              for row in report["results"] if "x_baseline" in row}
    top_row = next(line for line in readme.splitlines() if line.startswith("| continuous batching ("))
    assert f"`{current}`" in top_row
    cells = [cell.strip() for cell in top_row.strip("|").split("|")[1:]]
    columns = ["FlashMHFLlama", "MemoryLLM", "FlexMemoryLLM", "KVFFN"]
    # each cell opens with the run's median (lowest-highest); an earlier call's median may follow in brackets
    assert [re.match(r"[\d.]+ \([\d.]+-[\d.]+\)", cell).group(0) for cell in cells] == [quoted[m] for m in columns]
    serving_rows = {line.split("|")[1].strip().split(" (")[0]: line.split("|")[3].strip()
                    for line in readme.split("**Results on an H100**")[1].split("\n\n")[1].splitlines()[2:]}
    assert {model: serving_rows[model] for model in columns} == {model: quoted[model] for model in columns}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flash_mhf_continuous_batching_runs_the_fused_kernels_on_cuda():
    from hf_memffn.flash_mhf_op import flash_mhf_path

    torch.manual_seed(0)  # FFN heads 128 wide, sub-networks 128 wide: shapes the Triton kernels take
    config = tiny_config("flash_mhf", hidden_size=256, intermediate_size=256, ffn_num_heads=2, ffn_num_kv_heads=2,
                         ffn_num_subnetworks=2, ffn_kernel="triton")
    model = AutoModelForCausalLM.from_config(config).cuda().eval()
    ffn = model.model.layers[0].mlp
    assert flash_mhf_path(torch.empty(1, 2, 1, 128, device="cuda"), ffn.key, impl=ffn.kernel).startswith("triton")
    inputs = prompts()
    with torch.no_grad():
        reference = [model.generate(torch.tensor([ids], device="cuda"), generation_config=generation_config())[0, len(ids):]
                     .tolist() for ids in inputs]
    assert continuous_batching(model, inputs) == reference
