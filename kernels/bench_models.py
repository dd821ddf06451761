"""Whole models side by side: transformers' `LlamaForCausalLM` against FlashMHFLlama, MemoryLLM, FlexMemoryLLM and
KVFFN at the presets of `examples/presets.py` (equal parameters), in one run on one GPU.

    PYTHONPATH=. python kernels/bench_models.py --out kernels/results/models
    PYTHONPATH=. python kernels/bench_models.py --out DIR --sizes 370M --compile
    PYTHONPATH=. python kernels/bench_models.py --out DIR --tasks train:370M:llama:eager decode:370M:llama+kvffn:static

Measurements (all of them by default, or the `--tasks` named):
- `train`: a training step (forward + backward, no optimiser) on random tokens at the preset's batch (370M: 8 x 2048,
  1.3B: 4 x 2048; a task can name another, `train:370M:flash_mhf:eager:1`): tokens/s, peak memory and the host's
  time to issue one step (`harness.host_issue_ms`; a step bound by the host takes about that long whatever its
  batch), eager and, with `--compile`, under `torch.compile`; a task can also ask for the compiled step replayed from
  CUDA graphs (`train:370M:flash_mhf:cudagraphs:1`, `torch.compile(mode="reduce-overhead")`). A task that names
  several models (`train:1.3B:llama+flash_mhf:compiled`) builds them all in one process and times them in alternating
  rounds (`--train-rounds` of `--train-round-steps` steps each), so that the GPU's clock, which follows its power draw
  from minute to minute, moves under all of them alike; its rows give the median of the round pairs' ratios to Llama.
- `decode`: `generate()` decode tokens/s at batch 1 and 16 (prompt 128, greedy), eager with the dynamic cache and, with
  `--compile`, with a static cache (which `generate()` compiles with CUDA graphs). Each decoding step is timed after
  the prefill, so the prefill is not counted. At these sizes a step is bound by the host (Python, launches, guards),
  whose speed drifts by 20% from minute to minute: the models of a task (`decode:370M:llama+flash_mhf:static`)
  decode in turn, round by round (`--decode-repeats`); with `--decode-processes` each model decodes in a process of
  its own (compiled models otherwise share the compile cache of `Module.__call__`, which slows the later ones'
  lookups); every other round reverses the order, and `--decode-cpus` pins each process to a CPU once it has
  compiled. Each row gives the median step, the fastest decile's step and the median over rounds of Llama's round
  median divided by the model's, with the quartiles of those ratios. `--decode-profile` profiles each model where it
  ran, after its rounds; `profile_decode:<size>:<arch>` shows a static-cache call's kernels, CUDA-graph launches and
  host time. With `--other-package DIR` (and `--decode-processes`), a task's `<arch>@other` models are built from the
  hf_memffn package in DIR (an earlier commit's) and decode in turn with this checkout's: a change's effect, paired
  round by round.
- `layer`: the FFN block alone at the 370M shape against the SwiGLU MLP of equal parameters and FLOPs: forward +
  backward at 8 x 2048 tokens, and one decoding step (L=1) at batch 1 and 16 (CUDA-graph replay and plain launches);
  `layer:<size>:compiled` times the layers under `torch.compile`, as a compiled model runs them (no decoding step).
- `profile`: torch profiler tables (kernels by CUDA time) of the FlashMHF FFN layer's forward + backward and of one
  eager decoding step of every model, to see where the time goes; the task
  `profile_train:<size>:<arch>[:eager|compiled|cudagraphs[:<batch>]]` profiles one training step of a whole model
  and sums its kernels by family (attention, matmuls, the FlashMHF op, ...).

Ratios are what this benchmark is for: every model runs in the same process on the same GPU, minutes apart.
`--gpus N` runs each task in a process of its own on the next free one of N GPUs, several at once, and merges them
into one report (a task then names Llama beside the models it compares: ratios are taken within a task's GPU; a
decoding task, bound by the host, runs with no other task beside it, so list those last):

    PYTHONPATH=. python kernels/bench_models.py --out DIR --gpus 4 --decode-processes --tasks \
        train:1.3B:llama+flash_mhf+memoryllm+flex_memoryllm+kvffn:compiled layer:370M ...

Everything is written to <out>/models_bench.json (after every measurement, so a run cut short keeps what it
measured, and names the tasks it has not finished), <out>/models_bench.md and <out>/models_bench.png.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import re
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import (  # noqa: E402
    ROOT,
    ClockSampler,
    bench_ms,
    cuda_ms,
    host_issue_ms,
    environment,
    graph_ms,
    log,
    markdown_table,
    measure_on,
    median,
    on_cuda,
    output_folder,
    peak_memory,
    peak_memory_gib,
    read_json,
    refuse_counts_below,
    reset_peak_memory,
    save_figure,
    synchronize,
    write_json,
    write_text,
)

sys.path.insert(0, os.path.join(ROOT, "examples"))
from presets import ARCHITECTURE_NAMES, get_preset  # noqa: E402

TRAIN_BATCH = {"370M": 8, "1.3B": 4, "small": 8, "tiny": 2}
VOCAB_SIZE = 32000
DECODE_BATCHES = (1, 16)
PROMPT_LEN = 128
NEW_TOKENS = 64  # --new-tokens
DECODE_REPEATS = 3  # --decode-repeats
SEQ_LEN = 2048
BUILD_ON = "device"  # --build-on
DECODE_COMPILE_MODE = "reduce-overhead"  # --decode-compile-mode: generate()'s default, CUDA graphs
TRAIN_STEPS = 10
TRAIN_ROUNDS = 10  # --train-rounds: rounds of a training task that names several models (`paired_train_rows`)
TRAIN_ROUND_STEPS = 5  # timed steps of each model per round
TRAIN_MODES = ("eager", "compiled", "cudagraphs")  # train:<size>:<arch>:<mode>; cudagraphs: mode="reduce-overhead"
# "flash_mhf_unfused": FlashMHFLlama with the query norm and the gates as PyTorch operations around the op;
# "<arch>_torch_decoder": the architecture with the decoder's RMSNorms and rotary embeddings as PyTorch operations
# (`decoder_kernels="torch"`, what transformers' Llama runs) instead of the Triton kernels
TORCH_DECODER = "_torch_decoder"
# "kvffn_no_bias": KVFFN without its three biases per layer, `kvffn_bias=False`, a diagnostic of what the bias tensors cost
# (fewer parameters than the other rows)
# "llama_causal_flag": transformers' Llama given sdpa's causal flag instead of the [B, 1, L, L] mask that transformers
# builds while compiling, as our decoder does (training steps without padding only; `causal_flag_attention`)
# "llama_extra_inputs": transformers' Llama with EXTRA_INPUTS_PER_LAYER zero vectors per decoder layer added to the
# layer's output: as many more parameter tensors as KVFFN's biases, whose additions inductor fuses into kernels it
# runs anyway; a diagnostic of what a compiled graph's input costs a decoding step (`add_zero_inputs`)
EXTRA_INPUTS_PER_LAYER = 3
# "flash_mhf_triton_forward": FlashMHFLlama with the op's forward on the Triton kernel where the warp-specialised Gluon
# kernel would run (`flash_mhf_triton.gluon_kernels`)
# "flash_mhf_previous_gate_launch": FlashMHFLlama with the norm/gate backward kernel of its own (also where the Gluon
# dq/dr kernel would run it) launched as before its tf32 sweep (`flash_mhf_layer_triton.gates_backward_launch`)
# "flash_mhf_inline_rotary_tables": FlashMHFLlama whose compiled graph keeps the rotary tables' PyTorch operations,
# which inductor recomputes inside every layer's rotary kernel (`modeling_memffn.ROTARY_TABLES_OPERATOR` off)
# "flash_mhf_separate_gates_backward": FlashMHFLlama with the norm/gate backward as a kernel of its own where the op's
# Gluon dq/dr kernel would run it (`flash_mhf_op.GATES_IN_ROWS_KERNEL` off)
# "flash_mhf_whole_weight_tiles": FlashMHFLlama with every tile of the op's Gluon weight-gradient kernel whole, none of
# a last, partly filled round of programs split into row ranges (`flash_mhf_gluon.SPLIT_WEIGHT_TILES` off)
# "memoryllm_lookup", "flex_memoryllm_lookup": decoding from the model's token lookup table, as a deployment of these
# architectures does: the memory FFN exported as a bf16 table when the model is built, loaded onto the GPU, and the
# memory FFN's weights dropped (`use_token_lookup_table`); decoding only. The table's `kernel="auto"`: its Triton add
# kernel in eager steps, PyTorch operations that inductor fuses under torch.compile. "..._lookup_torch": PyTorch in
# eager steps too (`kernel="torch"`); "..._lookup_triton": the Triton kernel under torch.compile too (`kernel="triton"`)
LOOKUP = "_lookup"
# "<arch>_plain_launch" (our four architectures, any lookup variant too): our Triton and Gluon kernels launched as
# before `hf_memffn.triton_launch` (`tritons_own_launch`): through `kernel[grid](...)` on every call, Triton's binder
# and all, instead of the compiled kernel kept per argument signature, and their grids computed by Triton's `cdiv`
# and `next_power_of_2`; what that costs a step
PLAIN_LAUNCH = "_plain_launch"
# "<arch>_lora" (every architecture, Llama too): the model fine-tuned as PEFT's LoRA does it, adapters of rank
# LORA_RANK on `hf_memffn.LORA_TARGET_MODULES[arch]` (Llama's: its attention and MLP projections), every other weight
# frozen; "flash_mhf_lora_bank_gradients": the same FlashMHFLlama with its sub-network banks (`key_up_value`) still
# requiring a gradient, so its backward runs the weight-gradient kernel a frozen bank skips (`add_lora`)
LORA = "_lora"
LORA_RANK = 16
LORA_ARCHS = tuple(f"{arch}{LORA}" for arch in ARCHITECTURE_NAMES)
BANK_GRADIENTS = "flash_mhf_lora_bank_gradients"
LOOKUP_KERNELS = {"": "auto", "_torch": "torch", "_triton": "triton"}
LOOKUP_ARCHS = tuple(f"{arch}{LOOKUP}{kernel}" for arch in ("memoryllm", "flex_memoryllm") for kernel in LOOKUP_KERNELS)
DEFAULT_ARCHS = (*ARCHITECTURE_NAMES, "flash_mhf_unfused")  # what a run without --archs measures
ARCHS = (*DEFAULT_ARCHS, *(f"{arch}{TORCH_DECODER}" for arch in ARCHITECTURE_NAMES if arch != "llama"), "kvffn_no_bias",
         "llama_causal_flag", "llama_extra_inputs", "flash_mhf_triton_forward",
         "flash_mhf_previous_gate_launch", "flash_mhf_inline_rotary_tables", "flash_mhf_separate_gates_backward",
         "flash_mhf_whole_weight_tiles", *LOOKUP_ARCHS, *LORA_ARCHS, BANK_GRADIENTS)
ARCHS += tuple(f"{arch}{PLAIN_LAUNCH}" for arch in (*ARCHITECTURE_NAMES, *LOOKUP_ARCHS) if arch != "llama")
DISPLAY = {"llama": "Llama (transformers)", "flash_mhf": "FlashMHFLlama", "memoryllm": "MemoryLLM",
           "flex_memoryllm": "FlexMemoryLLM", "kvffn": "KVFFN", "flash_mhf_unfused": "FlashMHFLlama, unfused layer"}
DISPLAY.update({f"{arch}{TORCH_DECODER}": f"{DISPLAY[arch]}, PyTorch norm/rotary" for arch in ARCHITECTURE_NAMES})
DISPLAY[f"kvffn{TORCH_DECODER}"] = "KVFFN, PyTorch norm/rotary and activation"  # (decoder_kernels also decides it)
DISPLAY["kvffn_no_bias"] = "KVFFN without biases (fewer parameters)"
DISPLAY["llama_causal_flag"] = "Llama (transformers) with sdpa's causal flag"
DISPLAY["llama_extra_inputs"] = f"Llama (transformers) with {EXTRA_INPUTS_PER_LAYER} zero parameters per layer"
DISPLAY["flash_mhf_triton_forward"] = "FlashMHFLlama, the op's forward on the Triton kernel"
DISPLAY["flash_mhf_previous_gate_launch"] = "FlashMHFLlama, the norm/gate backward's previous launch"
DISPLAY["flash_mhf_inline_rotary_tables"] = "FlashMHFLlama, rotary tables recomputed in every rotary kernel"
DISPLAY["flash_mhf_separate_gates_backward"] = "FlashMHFLlama, norm/gate backward as a kernel of its own"
DISPLAY["flash_mhf_whole_weight_tiles"] = "FlashMHFLlama, the weight kernel's tiles whole"
DISPLAY.update({f"{arch}{LORA}": f"{DISPLAY[arch]}, LoRA r{LORA_RANK}" for arch in ARCHITECTURE_NAMES})
DISPLAY[BANK_GRADIENTS] = f"FlashMHFLlama, LoRA r{LORA_RANK}, banks computing their gradient"
for _arch in ("memoryllm", "flex_memoryllm"):
    DISPLAY[f"{_arch}{LOOKUP}"] = f"{DISPLAY[_arch]}, token lookup table"
    DISPLAY[f"{_arch}{LOOKUP}_torch"] = f"{DISPLAY[_arch]}, token lookup table, PyTorch add"
    DISPLAY[f"{_arch}{LOOKUP}_triton"] = f"{DISPLAY[_arch]}, token lookup table, Triton add when compiled"
DISPLAY.update({f"{arch}{PLAIN_LAUNCH}": f"{DISPLAY[arch]}, Triton's launch on every call"
                for arch in (*ARCHITECTURE_NAMES, *LOOKUP_ARCHS) if arch != "llama"})
# "<arch>@other" (a decode task with --decode-processes): the model built from the hf_memffn package in
# --other-package DIR (an earlier commit's, `git archive <commit> hf_memffn | tar -x -C DIR`), decoding in turn with
# this checkout's models: a change's effect on decoding, paired round by round
OTHER_PACKAGE = "@other"
OTHER_PACKAGE_DIR = None  # --other-package
DISPLAY.update({f"{arch}{OTHER_PACKAGE}": f"{name}, the other package" for arch, name in list(DISPLAY.items())})


# --------------------------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------------------------
def build_config(architecture: str, size: str, **overrides):
    fields = get_preset(size).config_fields(architecture)
    fields.update(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, pad_token_id=0, **overrides)
    if architecture == "llama":
        from transformers import LlamaConfig

        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": fields.pop("rope_theta")}
        return LlamaConfig(**fields)
    import hf_memffn

    return hf_memffn.ARCHITECTURES[architecture](**fields)


def causal_flag_attention() -> str:
    """Registers "sdpa_causal_flag" with transformers: its own sdpa attention, and a mask function that builds no mask,
    so sdpa gets `is_causal=True`. Valid only for sequences without padding that start an empty cache (what the
    training rows run); anything else raises."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def no_mask(*, q_length, kv_length, attention_mask=None, **kwargs):
        if attention_mask is not None or q_length != kv_length:
            raise ValueError("llama_causal_flag: only for sequences without a padding mask and without a cache")
        return None

    AttentionInterface.register("sdpa_causal_flag", AttentionInterface._global_mapping["sdpa"])
    AttentionMaskInterface.register("sdpa_causal_flag", no_mask)
    return "sdpa_causal_flag"


def add_zero_inputs(model, per_layer: int) -> None:
    """Gives each decoder layer of transformers' Llama `per_layer` zero parameters of the hidden size, added to the
    layer's output by a forward hook: the logits do not change, a compiled graph has that many more inputs."""
    def add_zeros(module, args, output):
        for index in range(per_layer):
            output = output + getattr(module, f"zero_input_{index}")
        return output

    for layer in model.model.layers:
        for index in range(per_layer):
            layer.register_parameter(f"zero_input_{index}", torch.nn.Parameter(
                torch.zeros(model.config.hidden_size, dtype=model.dtype, device=model.device)))
        layer.register_forward_hook(add_zeros)


def build_model(architecture: str, size: str, device: str, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    attention, extra_inputs = "sdpa", 0
    if architecture == BANK_GRADIENTS or architecture.endswith(LORA):
        base = BANK_GRADIENTS.partition(LORA)[0] if architecture == BANK_GRADIENTS else architecture.removesuffix(LORA)
        return add_lora(build_model(base, size, device, **overrides), base, architecture == BANK_GRADIENTS)
    architecture = architecture.removesuffix(PLAIN_LAUNCH)  # (how it launches is `op_kernels`'s)
    architecture, lookup, lookup_kernel = architecture.partition(LOOKUP)
    if lookup and (lookup_kernel not in LOOKUP_KERNELS or architecture not in ("memoryllm", "flex_memoryllm")):
        raise ValueError(f"architecture {architecture}{lookup}{lookup_kernel}: a lookup variant is one of "
                         f"{', '.join(LOOKUP_ARCHS)}")
    if architecture == "llama_causal_flag":
        architecture, attention = "llama", causal_flag_attention()
    if architecture == "llama_extra_inputs":
        architecture, extra_inputs = "llama", EXTRA_INPUTS_PER_LAYER
    if architecture in KERNEL_VARIANTS:
        architecture = "flash_mhf"
    unfused = architecture == "flash_mhf_unfused"
    if architecture.endswith(TORCH_DECODER):
        architecture = architecture[: -len(TORCH_DECODER)]
        overrides = {**overrides, "decoder_kernels": "torch"}
    if architecture == "kvffn_no_bias":
        architecture, overrides = "kvffn", {**overrides, "kvffn_bias": False}
    config = build_config("flash_mhf" if unfused else architecture, size, **overrides)
    with torch.device(device if BUILD_ON == "device" else "cpu"):  # by default initialised where it runs
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attention)
    for module in model.modules():
        if unfused and hasattr(module, "fused_layer"):
            module.fused_layer = False
    if extra_inputs:
        add_zero_inputs(model, extra_inputs)
    model = model.to(device)
    if lookup:
        use_token_lookup_table(model, LOOKUP_KERNELS[lookup_kernel])
    return model


def add_lora(model, architecture: str, bank_gradients: bool = False):
    """`model` (of `architecture`) wrapped by PEFT's LoRA (rank LORA_RANK, alpha twice that) on that architecture's
    `hf_memffn.LORA_TARGET_MODULES`, every other weight frozen; `bank_gradients`: FlashMHF's sub-network banks
    require a gradient all the same (what their backward cost before a frozen bank skipped its kernel)."""
    from peft import LoraConfig, get_peft_model

    import hf_memffn

    config = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK,
                        target_modules=hf_memffn.LORA_TARGET_MODULES[architecture])
    model = get_peft_model(model, config)
    if bank_gradients:
        banks = [param for name, param in model.named_parameters() if name.endswith("mlp.key_up_value")]
        if not banks:
            raise ValueError(f"{BANK_GRADIENTS}: the model has no FlashMHF sub-network banks")
        for param in banks:
            param.requires_grad_(True)
    return model


def use_token_lookup_table(model, kernel: str) -> None:
    """Exports the memory FFN of `model` (MemoryLLM or FlexMemoryLLM) as a bf16 token lookup table and has the model
    read it from then on: placement "gpu" on a GPU ("cpu" without one), `kernel` as `load_tols` takes it, the memory
    FFN's weights dropped. The table is written to a temporary directory and copied into memory from there."""
    import tempfile

    from hf_memffn.conversion import export_tols

    placement = "gpu" if model.device.type == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="bench_models_table_") as directory:
        export_tols(model, directory, progress=False)
        model.load_tols(directory, placement=placement, kernel=kernel, verify="size", drop_memory_ffn=True)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def decoder_path(model) -> str | None:
    """What the decoder's norms and rotary embeddings run (None for transformers' Llama)."""
    if hasattr(model, "get_base_model"):  # (PEFT's wrapper: its `model` is the adapters' model)
        model = model.get_base_model()
    base = getattr(model, "model", None)
    return base.decoder_path() if hasattr(base, "decoder_path") else None


def ffn_path(model) -> str | None:
    """What the FlashMHF FFN of `model` runs (None for the other architectures)."""
    from hf_memffn.ffn_multihead import FlashMHFFeedForward

    for module in model.modules():
        if isinstance(module, FlashMHFFeedForward):
            return module.path_description()
    return None


def release() -> None:
    """Frees what the last measurement left on the device (its callers drop their references first)."""
    gc.collect()
    if on_cuda():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------------------------------
# Training step
# --------------------------------------------------------------------------------------------------------------------
def compiled_for_training(model, mode: str):
    """`model` as a training step runs it in `mode` (one of TRAIN_MODES)."""
    if mode == "eager":
        return model
    if mode == "compiled":
        return torch.compile(model)
    # "cudagraphs": inductor's graphs replayed from CUDA graphs (forward and backward), which takes the host's
    # launches out of the step; on a CPU it warns and runs the compiled graphs without them
    return torch.compile(model, mode="reduce-overhead")


def training_step(model, ids, mode: str):
    """One training step of `model` on `ids` (forward, loss, backward; gradients dropped) in `mode`, as a callable."""
    forward = compiled_for_training(model, mode)

    def step():
        if mode == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs may be overwritten
        forward(input_ids=ids, labels=ids).loss.backward()
        for p in model.parameters():
            p.grad = None

    return step


# FlashMHFLlama measured in a context of its own (op_kernels)
KERNEL_VARIANTS = ("flash_mhf_triton_forward", "flash_mhf_previous_gate_launch", "flash_mhf_inline_rotary_tables",
                   "flash_mhf_separate_gates_backward", "flash_mhf_whole_weight_tiles")


def op_kernels(architecture: str):
    """The context a measurement of `architecture` runs in: which kernels FlashMHF's layer runs, and how our Triton
    kernels are launched."""
    from hf_memffn import flash_mhf_gluon, flash_mhf_layer_triton, flash_mhf_op, flash_mhf_triton, modeling_memffn

    if architecture.endswith(PLAIN_LAUNCH):
        return tritons_own_launch()
    if architecture == "flash_mhf_triton_forward":
        return flash_mhf_triton.gluon_kernels("rows", "weights")
    if architecture == "flash_mhf_previous_gate_launch":  # (the norm/gate backward kernel of its own, launched so)
        context = contextlib.ExitStack()
        context.enter_context(switched_off(flash_mhf_op, "GATES_IN_ROWS_KERNEL"))
        context.enter_context(flash_mhf_layer_triton.gates_backward_launch(
            flash_mhf_layer_triton.PREVIOUS_GATES_BACKWARD_LAUNCH))
        return context
    if architecture == "flash_mhf_inline_rotary_tables":  # compiled graphs keep the tables' PyTorch operations
        return switched_off(modeling_memffn, "ROTARY_TABLES_OPERATOR")
    if architecture == "flash_mhf_separate_gates_backward":  # the norm/gate backward as a kernel of its own
        return switched_off(flash_mhf_op, "GATES_IN_ROWS_KERNEL")
    if architecture == "flash_mhf_whole_weight_tiles":  # no tile of the weight kernel split into row ranges
        return switched_off(flash_mhf_gluon, "SPLIT_WEIGHT_TILES")
    return contextlib.nullcontext()


@contextlib.contextmanager
def tritons_own_launch():
    """Within the block, our Triton and Gluon kernels launch as before `hf_memffn.triton_launch`: through
    `kernel[grid](...)` on every call (`CACHED` off), their grids computed by `triton.cdiv` and
    `triton.next_power_of_2`."""
    import triton

    from hf_memffn import decoder_triton, ffn_triton, flash_mhf_layer_triton, flash_mhf_triton, token_lookup_triton
    from hf_memffn import triton_launch

    launchers = (decoder_triton, ffn_triton, flash_mhf_layer_triton, flash_mhf_triton, token_lookup_triton)
    before = [(module, name, getattr(module, name)) for module in launchers for name in ("cdiv", "next_power_of_2")
              if hasattr(module, name)]
    with switched_off(triton_launch, "CACHED"):
        try:
            for module, name, _ in before:
                setattr(module, name, getattr(triton, name))
            yield
        finally:
            for module, name, function in before:
                setattr(module, name, function)


@contextlib.contextmanager
def switched_off(module, flag: str):
    """Within the block, ``module.flag`` is False."""
    before = getattr(module, flag)
    setattr(module, flag, False)
    try:
        yield
    finally:
        setattr(module, flag, before)


def train_row(architecture: str, size: str, mode: str, device: str, batch: int | None = None) -> dict:
    with op_kernels(architecture):
        return _train_row(architecture, size, mode, device, batch)


def warmed_up_step(architecture: str, size: str, mode: str, device: str, ids: torch.Tensor):
    """`architecture`'s model in training mode and its training step on `ids`, run once (which compiles it when
    compiled): (model, step, seconds of that first step)."""
    model = build_model(architecture, size, device)
    model.train()
    step = training_step(model, ids, mode)
    start = time.perf_counter()
    step()
    synchronize()
    return model, step, time.perf_counter() - start


def train_row_fields(architecture: str, size: str, mode: str, model, batch: int, step_ms: float, host_ms: float,
                     peak_gib, first_s: float) -> dict:
    """The fields every training row has."""
    return {"arch": architecture, "size": size, "mode": mode, "batch": batch, "seq_len": SEQ_LEN,
            "params": parameter_count(model), "step_ms": step_ms, "tokens_per_s": batch * SEQ_LEN / step_ms * 1e3,
            "host_ms": host_ms, "peak_gib": peak_gib, "first_step_s": first_s, "ffn_path": ffn_path(model),
            "decoder_path": decoder_path(model)}


def _train_row(architecture: str, size: str, mode: str, device: str, batch: int | None = None) -> dict:
    batch = batch or TRAIN_BATCH[size]
    ids = torch.randint(3, VOCAB_SIZE, (batch, SEQ_LEN), device=device)
    model, step, first_s = warmed_up_step(architecture, size, mode, device, ids)
    reset_peak_memory()
    with ClockSampler() as clock:
        times = cuda_ms(step, TRAIN_STEPS, warmup=2)
    host_ms = median(host_issue_ms(step, TRAIN_STEPS))
    row = {**train_row_fields(architecture, size, mode, model, batch, median(times), host_ms, peak_memory_gib(),
                              first_s), "step_ms_all": times, **clock.summary()}
    model = step = None  # (the step closure holds the compiled model)
    release()
    return row


def paired_train_rows(architectures: list[str], size: str, mode: str, device: str, batch: int | None = None) -> list:
    """One row per model of a task that names several (`train:1.3B:llama+flash_mhf:compiled`): every model is built
    and warmed up (compiled) in this process, then TRAIN_ROUNDS rounds time TRAIN_ROUND_STEPS steps of each model in
    turn, every other round in reverse order, on the same batch. A training step at these sizes is bound by the GPU,
    whose clock follows its power draw and temperature from minute to minute; models timed in alternating rounds of a
    few seconds see the same minutes, so each row also gives the median over rounds of the first model's (Llama's
    where the task has it) round median divided by its own, and the quartiles of those ratios.
    Peak memory is each model's own, from one more step after the rounds (`harness.peak_memory`: its parameters and
    what the step allocates; the other models' weights are not counted)."""
    batch = batch or TRAIN_BATCH[size]
    ids = torch.randint(3, VOCAB_SIZE, (batch, SEQ_LEN), device=device)
    models, steps, warm = {}, {}, {}
    for architecture in architectures:
        with op_kernels(architecture):
            models[architecture], steps[architecture], warm[architecture] = warmed_up_step(
                architecture, size, mode, device, ids)
            steps[architecture]()
    round_times = {architecture: [] for architecture in architectures}
    with ClockSampler() as clock:
        for round_index in range(TRAIN_ROUNDS):
            for architecture in architectures if round_index % 2 == 0 else reversed(architectures):
                with op_kernels(architecture):
                    round_times[architecture].append(cuda_ms(steps[architecture], TRAIN_ROUND_STEPS, warmup=1))
    round_medians = {architecture: [median(times) for times in rounds] for architecture, rounds in round_times.items()}
    baseline = "llama" if "llama" in round_medians else architectures[0]
    rows = []
    for architecture in architectures:
        model = models[architecture]
        with op_kernels(architecture):
            host_ms = median(host_issue_ms(steps[architecture], 3))
            peak = peak_memory(steps[architecture], leaves=list(model.parameters())) if on_cuda() \
                else {"peak_gib": None}
        step_ms = median([t for times in round_times[architecture] for t in times])
        paired = [base / own for base, own in zip(round_medians[baseline], round_medians[architecture])]
        rows.append({
            **train_row_fields(architecture, size, mode, model, batch, step_ms, host_ms, peak["peak_gib"],
                               warm[architecture]),
            "round_median_step_ms": round_medians[architecture],
            "round_paired_baseline": baseline, "round_paired_ratio": median(paired),
            "round_paired_ratio_quartiles": quartiles(paired) if len(paired) >= 4 else None,
            "interleaved_with": [a for a in architectures if a != architecture], **clock.summary()})
    models = steps = model = None
    release()
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------------------------------
class StepClock:
    """A logits processor that notes the time at every decoding step (after the GPU finished it)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        synchronize()
        self.times.append(time.perf_counter())
        return scores


def allow_recompiles() -> None:
    """Every compiled model adds entries to the cache of one code object (`Module.__call__`): room for a whole run's."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)


def dynamo_counts() -> dict:
    """torch.compile's running counts: graphs compiled, and compiled graphs that inductor ran without CUDA graphs
    (under `mode="reduce-overhead"`; it logs the reason as a warning)."""
    from torch._dynamo.utils import counters

    return {"graphs_compiled": counters["stats"].get("unique_graphs", 0),
            "cudagraph_skips": counters["inductor"].get("cudagraph_skips", 0)}


def decode_generator(model, batch: int, static: bool, device: str):
    """Greedy `generate()` from a random prompt of `batch` rows: returns a function of the number of new tokens that
    decodes them and returns the time at the end of the prefill and of every decoding step."""
    from transformers import LogitsProcessorList

    model.eval()
    generation = model.generation_config
    if static and DECODE_COMPILE_MODE != "reduce-overhead":
        from transformers import CompileConfig

        # torch.compile's mode for the static-cache step ("default": the compiled graph without CUDA graphs)
        generation.compile_config = CompileConfig(mode=DECODE_COMPILE_MODE)
    generation.eos_token_id = None
    generation.pad_token_id = 0
    generation.cache_implementation = "static" if static else None
    ids = torch.randint(3, VOCAB_SIZE, (batch, PROMPT_LEN), device=device)

    def generate(new_tokens: int) -> list[float]:
        clock = StepClock()
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, logits_processor=LogitsProcessorList([clock]))
        return clock.times

    return generate


class LocalDecoder:
    """A model decoding in this process (the models of a task share the process, its compile cache included)."""

    def __init__(self, architecture: str, size: str, device: str, static: bool):
        self.model = build_model(architecture, size, device)
        self.architecture, self.device, self.static, self.generators = architecture, device, static, {}

    def start_warm_up(self, batch: int):
        """`warm_up` now; returns the function that gives its result (`ProcessDecoder` runs it in the background)."""
        result = self.warm_up(batch)
        return lambda: result

    def warm_up(self, batch: int) -> dict:
        """Compiles (for a static cache) and runs the shape of `batch` once: seconds taken, graphs compiled and
        CUDA-graph captures skipped."""
        counts = dynamo_counts()
        self.generators[batch] = decode_generator(self.model, batch, self.static, self.device)
        start = time.perf_counter()
        with op_kernels(self.architecture):
            self.generators[batch](NEW_TOKENS if self.static else 4)
        return {"warmup_s": time.perf_counter() - start,
                "compiled_call": getattr(self.model, "_compiled_call", None) is not None,
                **{key: value - counts[key] for key, value in dynamo_counts().items()}}

    def steps(self, batch: int) -> list[float]:
        """Seconds of each decoding step of one timed `generate()` call (the prefill is not a step)."""
        with op_kernels(self.architecture):
            times = self.generators[batch](NEW_TOKENS)
        return [b - a for a, b in zip(times, times[1:])]

    def profile(self, batch: int) -> dict:
        """Kernel and host tables of one timed `generate()` call at `batch`, in the state the timed rounds left."""
        return kernel_table(lambda: self.steps(batch), steps=1, top=25)

    def pin(self, cpu: int) -> int:
        """Every thread of this process on CPU `cpu` from now on (after the warm-up, whose compilation wants all of
        them); returns `cpu`."""
        pin_process(cpu)
        return cpu

    def close(self) -> None:
        self.model = self.generators = None


def paired_ratio_cell(row: dict) -> str:
    """A decode or training row's paired-round ratio for the report: "1.03 (0.93-1.16)", with " x <model>" when the
    rounds were paired with a model other than Llama (a task without Llama pairs with its first model), and "-" for a
    model other than Llama that decoded alone. Reads results files written before the baseline was recorded
    (`round_paired_ratio_to_llama`) too."""
    ratio = row.get("round_paired_ratio", row.get("round_paired_ratio_to_llama"))
    baseline = row.get("round_paired_baseline", "llama")
    if ratio is None or (baseline != "llama" and not row.get("interleaved_with", True)):
        return "-"  # (a model decoding alone, paired with itself)
    cell = f"{ratio:.2f}"
    if row["arch"] != baseline and row.get("round_paired_ratio_quartiles"):
        cell += " ({:.2f}-{:.2f})".format(*row["round_paired_ratio_quartiles"])
    if baseline != "llama":
        cell += f" x {DISPLAY.get(baseline, baseline)}"
    return cell


def quartiles(values) -> tuple[float, float]:
    """The first and third quartiles of `values` (the middle half lies between them)."""
    import statistics

    first, _, third = statistics.quantiles(values, n=4)
    return first, third


def pin_process(cpu: int) -> None:
    """Every thread of this process (the Python thread that decodes and the CUDA driver's) on CPU `cpu`."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), {cpu})
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def parse_cpu_list(text: str) -> list[int]:
    """CPU ids of a Linux CPU list such as "0-7,16-23"; a ValueError for a part that is neither a CPU nor a range,
    or for a range from high to low, which names no CPU (a typo, not a wish to leave CPUs out)."""
    cpus = []
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        first, last = int(first), int(last or first)
        if last < first:
            raise ValueError(f"CPU range {part!r} runs from high to low")
        cpus += range(first, last + 1)
    return cpus


def decode_cpus(spec: str | None) -> list[int] | None:
    """The CPUs that `--decode-cpus` names: None (no pinning), "gpu" (the CPUs of the NUMA node of the process's first
    visible GPU, as the kernel lists them for its PCI device), or a list such as "8-13" or "8,9,10"."""
    if spec is None:
        return None
    allowed = os.sched_getaffinity(0)
    if spec != "gpu":
        try:
            cpus = parse_cpu_list(spec)
        except ValueError:
            cpus = []
        if not cpus:
            raise ValueError(f"--decode-cpus={spec!r} is not 'gpu' or a CPU list such as '8-13' or '8,9,10'")
        unavailable = [cpu for cpu in cpus if cpu not in allowed]
        if unavailable:
            raise ValueError(f"--decode-cpus={spec!r}: CPU {', '.join(map(str, unavailable))} not among the CPUs "
                             f"available to this process ({', '.join(map(str, sorted(allowed)))})")
        return cpus
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()  # (nvidia-smi does not read it)
    try:
        bus_id = subprocess.run(["nvidia-smi", f"--id={gpu}", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as error:
        raise RuntimeError(f"--decode-cpus=gpu: nvidia-smi did not name GPU {gpu}'s PCI device: {error}") from None
    domain, rest = bus_id.split(":", 1)  # nvidia-smi writes an 8-digit domain, sysfs a 4-digit one
    path = f"/sys/bus/pci/devices/{int(domain, 16):04x}:{rest.lower()}/local_cpulist"
    with open(path, encoding="utf-8") as handle:
        cpus = parse_cpu_list(handle.read())
    cpus = [cpu for cpu in cpus if cpu in allowed]
    if not cpus:
        raise RuntimeError(f"--decode-cpus=gpu: none of the CPUs in {path} is available to this process")
    return cpus


def _decoder_worker(connection, architecture: str, size: str, device: str, static: bool, settings: dict) -> None:
    """A `LocalDecoder` in a process of its own, driven by `ProcessDecoder` through `connection`; an "@other" model
    imports hf_memffn from OTHER_PACKAGE_DIR (this process has not imported it yet)."""
    globals().update(settings)
    if architecture.endswith(OTHER_PACKAGE):
        if "hf_memffn" in sys.modules:
            raise RuntimeError("hf_memffn was imported before the other package could be put first on the path")
        sys.path.insert(0, OTHER_PACKAGE_DIR)
        architecture = architecture.removesuffix(OTHER_PACKAGE)
    measure_on(device)
    allow_recompiles()
    decoder = LocalDecoder(architecture, size, device, static)
    connection.send("ready")
    while True:
        command, argument = connection.recv()  # a batch size, or the CPU of "pin"
        if command == "stop":
            return
        try:
            connection.send(("ok", getattr(decoder, command)(argument)))
        except Exception as exc:  # noqa: BLE001 - the driver reports it and goes on with the other models
            connection.send(("error", f"{architecture}: {exc!r}"))


class ProcessDecoder:
    """A model decoding in a process of its own (`--decode-processes`): no compile cache shared with the other
    models, as a user runs one model, while the driver still has the models take turns. The processes build their
    models and compile at the same time (only the timed calls take turns)."""

    def __init__(self, architecture: str, size: str, device: str, static: bool):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # (CUDA cannot be forked)
        self.architecture = architecture
        self.connection, child = context.Pipe()
        settings = {"SEQ_LEN": SEQ_LEN, "NEW_TOKENS": NEW_TOKENS, "BUILD_ON": BUILD_ON,
                    "DECODE_COMPILE_MODE": DECODE_COMPILE_MODE, "OTHER_PACKAGE_DIR": OTHER_PACKAGE_DIR}
        self.process = context.Process(target=_decoder_worker, args=(child, architecture, size, device, static, settings))
        self.process.start()
        self.started = False  # the "ready" message is read by the first command, so that the models build together

    def _send(self, command: str, batch: int) -> None:
        if not self.started:
            if self.connection.recv() != "ready":
                raise RuntimeError(f"the decoding process of {self.architecture} did not start")
            self.started = True
        self.connection.send((command, batch))

    def _receive(self):
        status, value = self.connection.recv()
        if status != "ok":
            raise RuntimeError(value)
        return value

    def _call(self, command: str, batch: int):
        self._send(command, batch)
        return self._receive()

    def start_warm_up(self, batch: int):
        self._send("warm_up", batch)
        return self._receive

    def warm_up(self, batch: int) -> dict:
        return self._call("warm_up", batch)

    def steps(self, batch: int) -> list[float]:
        return self._call("steps", batch)

    def profile(self, batch: int) -> dict:
        return self._call("profile", batch)

    def pin(self, cpu: int) -> int:
        return self._call("pin", cpu)

    def close(self) -> None:
        if self.process.is_alive():
            self.connection.send(("stop", 0))
        self.process.join(timeout=60)


def decode_rows(decoders: dict, size: str, batch: int, static: bool, profile: bool = False,
                cpus: list[int] | None = None) -> tuple[list[dict], dict]:
    """One row per model of `decoders` ({architecture: LocalDecoder or ProcessDecoder}) at `batch`: each is warmed up
    (compiled, for a static cache), then DECODE_REPEATS rounds time one `generate()` call of every model in turn, so
    that the host's slow and fast minutes (decoding at these sizes is bound by the host) fall on all of them alike;
    every other round runs the models in reverse order, so that a steady drift does not favour the first. With
    `cpus`, each model's process decodes on one of those CPUs (`--decode-cpus`; pinned after the warm-up).
    The median step over all rounds is reported, each round's median beside it. With `profile`, each model then
    profiles one more call where it ran (`--decode-profile`): the kernel and host tables behind the row. Models in
    processes of their own warm up at the same time, so their warm-up seconds overlap."""
    pending = {architecture: decoder.start_warm_up(batch) for architecture, decoder in decoders.items()}
    warm = {architecture: result() for architecture, result in pending.items()}
    pinned = {architecture: decoder.pin(cpus[index % len(cpus)])  # (main() allows cpus with processes only)
              for index, (architecture, decoder) in enumerate(decoders.items())} if cpus else {}
    reset_peak_memory()
    round_steps = {architecture: [] for architecture in decoders}
    for round_index in range(DECODE_REPEATS):
        order = list(decoders) if round_index % 2 == 0 else list(reversed(decoders))
        for architecture in order:
            round_steps[architecture].append(decoders[architecture].steps(batch))
    round_medians = {architecture: [median(steps) for steps in rounds] for architecture, rounds in round_steps.items()}
    # the model each row's rounds are paired with: Llama where the task has it, otherwise the task's first model
    baseline = "llama" if "llama" in round_medians else next(iter(round_medians))
    row_mode = "eager" if not static else (
        "static+compiled" if DECODE_COMPILE_MODE == "reduce-overhead" else "static+compiled, no CUDA graphs")
    rows = []
    for architecture, rounds in round_steps.items():
        all_steps = sorted(step for steps in rounds for step in steps)
        step_s = median(all_steps)
        # the baseline's step over this model's, round by round (the two calls seconds apart), then their median
        paired = [base / own for base, own in zip(round_medians[baseline], round_medians[architecture])]
        separate = isinstance(decoders[architecture], ProcessDecoder)
        rows.append({
            "arch": architecture, "size": size, "batch": batch, "mode": row_mode,
            "decode_tokens_per_s": batch / step_s, "ms_per_step": step_s * 1e3,
            "round_median_ms_per_step": [t * 1e3 for t in round_medians[architecture]],
            "p10_ms_per_step": all_steps[len(all_steps) // 10] * 1e3,  # the fastest decile's bound: less host noise
            "round_paired_baseline": baseline,
            "round_paired_ratio": median(paired) if paired else None,
            # the middle half of the round pairs' ratios: how far one pair can be from the median
            "round_paired_ratio_quartiles": quartiles(paired) if len(paired) >= 4 else None,
            # (the models of a task share this process's peak unless each has its own process)
            "peak_gib": peak_memory_gib() if len(decoders) == 1 and not separate else None,
            **warm[architecture],  # warm-up seconds, graphs compiled, CUDA-graph captures skipped
            "interleaved_with": [a for a in decoders if a != architecture],
            "own_process": separate,
            "cpu": pinned.get(architecture),  # the CPU its process decoded on (--decode-cpus), None if not pinned
            "host_load_1min": os.getloadavg()[0]})
    mode = "static" if static else "eager"
    profiles = {f"decode_{size}_{architecture}_{mode}_b{batch}_in_task": decoder.profile(batch)
                for architecture, decoder in decoders.items()} if profile else {}
    return rows, profiles


def profile_decode_rows(size: str, device: str, architecture: str, batch: int = 1) -> dict:
    """Kernel and host tables of one static-cache compiled `generate()` call (NEW_TOKENS tokens, after a warm-up call
    that compiles): whether the decoding steps replay CUDA graphs, and where the GPU and the host spend a step."""
    decoder = LocalDecoder(architecture, size, device, static=True)
    decoder.warm_up(batch)  # compiles and captures
    table = kernel_table(lambda: decoder.steps(batch), steps=1, top=25)
    decoder.close()
    release()
    return {f"decode_{size}_{architecture}_static_b{batch}_generate_{NEW_TOKENS}_tokens": table}


# --------------------------------------------------------------------------------------------------------------------
# One FFN layer
# --------------------------------------------------------------------------------------------------------------------
def ffn_layers(size: str, device: str) -> tuple[dict, int]:
    """The FFN block of each architecture's decoder layer at `size`, and SwiGLU MLPs of equal parameters."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_memffn import FlashMHFLlamaModel, KVFFNModel
    from hf_memffn.ffn import SwiGLUFeedForward

    torch.manual_seed(0)
    layers = {}
    flash_config = build_config("flash_mhf", size)
    layers["FlashMHF"] = FlashMHFLlamaModel.build_residual_ffn(flash_config)
    layers["FlashMHF, unfused layer"] = copy.deepcopy(layers["FlashMHF"])
    layers["FlashMHF, unfused layer"].fused_layer = False
    for name in LAYER_KERNELS:
        layers[name] = copy.deepcopy(layers["FlashMHF"])
    flash_params = sum(p.numel() for p in layers["FlashMHF"].parameters())
    width = 64 * round(flash_params / (3 * flash_config.hidden_size * 64))  # a tensor-core friendly width
    layers[f"SwiGLU d_ff={width} (~ FlashMHF params)"] = SwiGLUFeedForward(flash_config.hidden_size, width)
    layers["KV-FFN"] = KVFFNModel.build_residual_ffn(build_config("kvffn", size))
    layers["KV-FFN, PyTorch activation"] = copy.deepcopy(layers["KV-FFN"])
    layers["KV-FFN, PyTorch activation"].kernels = "torch"  # act(keys) * values as PyTorch operations
    llama_config = build_config("llama", size)
    layers[f"Llama MLP d_ff={llama_config.intermediate_size}"] = LlamaMLP(llama_config)
    for module in layers.values():
        with torch.no_grad():
            for name, param in module.named_parameters():
                param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.02)
        module.to(device, torch.bfloat16)
    return layers, flash_config.hidden_size


# the same module, timed in the op_kernels context of an architecture
LAYER_KERNELS = {"FlashMHF, the op's forward on the Triton kernel": "flash_mhf_triton_forward",
                 "FlashMHF, the norm/gate backward's previous launch": "flash_mhf_previous_gate_launch",
                 "FlashMHF, norm/gate backward as a kernel of its own": "flash_mhf_separate_gates_backward",
                 "FlashMHF, the weight kernel's tiles whole": "flash_mhf_whole_weight_tiles"}


def layer_rows(size: str, device: str, compiled: bool = False) -> list[dict]:
    """Each FFN layer of `ffn_layers` timed alone: forward, forward + backward, and one decoding step. `compiled`
    (the task `layer:<size>:compiled`): the layers as a compiled model runs them, each under `torch.compile` (the
    SwiGLU MLPs' SiLU and product fused by inductor; FlashMHF's custom operators as they are), forward and
    forward + backward only, and without the kernel variants of `LAYER_KERNELS`."""
    rows = []
    layers, hidden = ffn_layers(size, device)
    tokens = TRAIN_BATCH[size] * SEQ_LEN
    x = torch.randn(TRAIN_BATCH[size], SEQ_LEN, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    for name, module in layers.items():
        if compiled and name in LAYER_KERNELS:
            continue
        params = list(module.parameters())
        call = torch.compile(module) if compiled else module

        def train():
            call(x).backward(grad)

        with op_kernels(LAYER_KERNELS.get(name, "flash_mhf")):
            with torch.no_grad():
                forward_ms = bench_ms(lambda: call(x))
            train_ms = bench_ms(train, grad_to_none=[x, *params])
        row = {"layer": name, "size": size, "mode": "compiled" if compiled else "eager", "tokens": tokens,
               "params": sum(p.numel() for p in params), "forward_ms": forward_ms, "train_ms": train_ms}
        for batch in DECODE_BATCHES:
            if compiled:
                row[f"decode_b{batch}_graph_us"] = row[f"decode_b{batch}_launch_us"] = None
                continue
            step = torch.randn(batch, 1, hidden, device=device, dtype=torch.bfloat16)
            with torch.no_grad():
                graph = graph_ms(lambda: module(step))
                row[f"decode_b{batch}_graph_us"] = None if graph is None else graph * 1e3
                row[f"decode_b{batch}_launch_us"] = bench_ms(lambda: module(step)) * 1e3
        log(f"layer {name}{', compiled' if compiled else ''}: fwd {forward_ms:.3f} ms, fwd+bwd {train_ms:.3f} ms, "
            f"decode b1 {fmt(row['decode_b1_graph_us'])} us (graph) {fmt(row['decode_b1_launch_us'])} us (launches)")
        rows.append(row)
        call = None  # (a compiled module holds its graphs)
    return rows


# --------------------------------------------------------------------------------------------------------------------
# Profiles
# --------------------------------------------------------------------------------------------------------------------
# Kernel families of a profile, by name (first match wins): where a whole training step spends its GPU time.
KERNEL_FAMILIES = (
    ("decoder norm/rotary (Triton)", ("_rms_norm_", "_rotary_kernel")),  # before "_forward_kernel" matches the norm's
    ("FlashMHF op", ("_forward_kernel", "_rows_gradients_kernel", "_weight_gradients_kernel", "_backward_rows_kernel",
                     "_backward_weights_kernel")),
    ("FlashMHF norm/gates", ("_queries_and_gates",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("softmax/cross-entropy", ("softmax", "nll_loss", "cross_entropy")),
    ("matmul (cuBLAS)", ("nvjet", "gemm", "cutlass", "xmma", "cublas", "Kernel2")),
    ("elementwise/reduction/copy", ("elementwise", "reduce", "copy", "Memset", "Memcpy", "fill", "index", "embedding",
                                    "cat", "where", "scatter", "gather")),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    for family, patterns in KERNEL_FAMILIES:
        if any(pattern.lower() in lowered for pattern in patterns):
            return family
    return "other"


def kernel_table(fn, steps: int, top: int = 25) -> dict:
    """CUDA kernels of `steps` calls of `fn`, by total CUDA time: [(name, calls, total us)], the totals, and the time
    per kernel family (`KERNEL_FAMILIES`)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    use_cuda = on_cuda()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    kernel_type = torch.autograd.DeviceType.CUDA if use_cuda else torch.autograd.DeviceType.CPU
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels, graph_launches = {}, 0
    for event in prof.events():
        graph_launches += event.name == "cudaGraphLaunch"
        if event.device_type == kernel_type:
            name = event.name[:120]
            calls, total = kernels.get(name, (0, 0.0))
            kernels[name] = (calls + 1, total + (event.device_time if use_cuda else event.cpu_time))
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])
    host = sorted(prof.key_averages(), key=lambda event: -event.self_cpu_time_total)[:12]
    families = {}
    for name, (_, total) in kernels.items():
        family = kernel_family(name)
        families[family] = families.get(family, 0.0) + total / steps
    return {"steps": steps, "wall_us_per_step": wall_us / steps,
            "families_us_per_step": dict(sorted(families.items(), key=lambda item: -item[1])),
            "kernel_us_per_step": sum(t for _, t in kernels.values()) / steps,
            "kernels_per_step": sum(c for c, _ in kernels.values()) / steps,
            "cuda_graph_launches_per_step": graph_launches / steps,
            "top": [(name, calls / steps, total / steps) for name, (calls, total) in ranked[:top]],
            # where the host spends its time (eager decoding is bound by it): operators by self CPU time
            "host_top": [(event.key[:120], event.count / steps, event.self_cpu_time_total / steps) for event in host]}


def profile_train_rows(size: str, device: str, architecture: str, mode: str = "eager",
                       batch: int | None = None) -> dict:
    """Kernel table of one training step (forward + backward) of `architecture` at `size` in `mode` (one of
    TRAIN_MODES), at the preset's batch or `batch` sequences."""
    model = build_model(architecture, size, device)
    model.train()
    ids = torch.randint(3, VOCAB_SIZE, (batch or TRAIN_BATCH[size], SEQ_LEN), device=device)
    step = training_step(model, ids, mode)
    for _ in range(1 if mode == "eager" else 3):  # warm-up (compilation, autotuning, allocator, graph recording)
        step()
    table = kernel_table(step, steps=2, top=40)
    model = step = None  # (the step closure holds the compiled model)
    release()
    return {f"train_step_{size}_{architecture}" + ("" if mode == "eager" else f"_{mode}")
            + (f"_b{batch}" if batch else ""): table}


def profile_rows(size: str, device: str, archs) -> dict:
    out = {}
    layers, hidden = ffn_layers(size, device)
    flash = layers["FlashMHF"]
    x = torch.randn(TRAIN_BATCH[size], SEQ_LEN, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    out["flash_mhf_layer_fwd_bwd"] = kernel_table(lambda: flash(x).backward(grad), steps=3)
    layers = flash = x = grad = None  # (the timed closure holds them)
    release()
    for architecture in archs:
        model = build_model(architecture, size, device)
        model.eval()
        ids = torch.randint(3, VOCAB_SIZE, (1, PROMPT_LEN), device=device)
        from transformers import DynamicCache

        from hf_memffn.modeling_memffn import CACHE_KWARG  # (the cache argument's name in this transformers)

        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            model(input_ids=ids, **{CACHE_KWARG: cache}, use_cache=True)
            token = ids[:, -1:]
            length = [PROMPT_LEN]

            def decode_step():
                position = torch.tensor([[length[0]]], device=device)
                model(input_ids=token, **{CACHE_KWARG: cache}, position_ids=position, use_cache=True)
                length[0] += 1

            out[f"decode_step_b1_{architecture}"] = kernel_table(decode_step, steps=5, top=15)
        model = cache = None  # (the step closure holds them)
        release()
    return out


# --------------------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def ratio_to_llama(rows, key, match) -> dict:
    """{id(row): row[key] / Llama's} for the rows whose `match` (and GPU and task, where a run on several GPUs recorded
    them) a Llama row shares."""
    def where(r):
        return r.get("gpu"), r.get("task") if r.get("interleaved_with") else None, match(r)

    base = {where(r): r[key] for r in rows if r["arch"] == "llama"}
    return {id(r): r[key] / base[where(r)] for r in rows if where(r) in base}


def report(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Whole-model benchmark on {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, transformers {env['transformers']}; bf16 weights, sdpa "
             f"attention, random tokens, vocabulary {VOCAB_SIZE}. Ratios are to transformers' `LlamaForCausalLM` of "
             "the same preset in the same run.", ""]
    if results.get("gpus"):
        lines += [f"Each task ran in a process of its own on one of {len(results['gpus'])} GPUs ("
                  + ", ".join(f"{gpu}: {name}" for gpu, name in sorted(results["gpus"].items()))
                  + "), several at once; ratios to Llama are within a task's GPU.", ""]
    train = results.get("train", [])
    if train:
        ratios = ratio_to_llama(train, "tokens_per_s", lambda r: (r["size"], r["mode"], r["batch"]))
        lines += ["## Training step (forward + backward)", "", "host ms: the host's time to issue one step, started "
                  "on an idle GPU (a step bound by the host takes about that long whatever its batch).", ""]
        paired = any(r.get("round_paired_ratio") for r in train)
        if paired:
            round_steps = results.get("args", {}).get("train_round_steps", TRAIN_ROUND_STEPS)
            lines += ["Models of one task (`train:<size>:llama+flash_mhf:<mode>`) took turns in rounds of "
                      f"{round_steps} steps; \"by round pairs\": "
                      "the median over rounds of Llama's round median step divided by the model's (quartiles). "
                      "Their peak memory is each model's own (the other models' weights not counted).", ""]
        on_gpus = any("gpu" in r for r in train)
        lines += markdown_table(
            ["size", "mode", "model", "params (M)", "batch x L", "tokens/s", "x Llama",
             *(["x Llama by round pairs"] if paired else []), "step ms", "host ms", "peak GiB",
             *(["GPU"] if on_gpus else [])],
            [[r["size"], r["mode"], DISPLAY[r["arch"]], f"{r['params'] / 1e6:.0f}", f"{r['batch']} x {r['seq_len']}",
              f"{r['tokens_per_s'] / 1e3:.1f}k", fmt(ratios.get(id(r)), ".2f"),
              *([paired_ratio_cell(r)] if paired else []), f"{r['step_ms']:.1f}",
              fmt(r.get("host_ms")), fmt(r["peak_gib"]), *([fmt(r.get("gpu"), "d")] if on_gpus else [])]
             for r in train])
        lines.append("")
    decode = results.get("decode", [])
    if decode:
        ratios = ratio_to_llama(decode, "decode_tokens_per_s", lambda r: (r["size"], r["mode"], r["batch"]))
        new_tokens = results.get("args", {}).get("new_tokens", NEW_TOKENS)
        lines += [f"## Decoding with `generate()` (greedy, prompt {PROMPT_LEN}, {new_tokens} new tokens)", ""]
        lines += markdown_table(
            ["size", "mode", "batch", "model", "tokens/s", "ms/step", "x Llama",
             "x Llama (or the named model), median of round pairs (quartiles)",
             "p10 ms/step", "ms/step by round", "graphs compiled / CUDA-graph skips"],
            [[r["size"], r["mode"], r["batch"], DISPLAY[r["arch"]] + (", own process" if r.get("own_process") else "")
              + (f", CPU {r['cpu']}" if r.get("cpu") is not None else ""),
              f"{r['decode_tokens_per_s']:.0f}",
              f"{r['ms_per_step']:.2f}", fmt(ratios.get(id(r)), ".2f"),
              paired_ratio_cell(r),
              fmt(r.get("p10_ms_per_step"), ".2f"),
              " / ".join(f"{t:.2f}" for t in r.get("round_median_ms_per_step", [])) or "-",
              f"{r['graphs_compiled']} / {r['cudagraph_skips']}" if "cudagraph_skips" in r else "-"] for r in decode])
        lines.append("")
    layer = results.get("layer", [])
    if layer:
        lines += ["## One FFN layer", "", "Forward + backward over the preset's training tokens; decoding one token "
                  "(CUDA-graph replay / plain launches; not timed for a compiled layer).", ""]
        lines += markdown_table(
            ["size", "tokens", "layer", "params (M)", "fwd ms", "fwd+bwd ms", "decode b1 us", "decode b16 us",
             "b1 launches us"],
            [[r["size"], r["tokens"], r["layer"] + (", `torch.compile`" if r.get("mode") == "compiled" else ""),
              f"{r['params'] / 1e6:.2f}", f"{r['forward_ms']:.3f}", f"{r['train_ms']:.3f}",
              fmt(r["decode_b1_graph_us"]), fmt(r["decode_b16_graph_us"]), fmt(r["decode_b1_launch_us"])]
             for r in layer])
        lines.append("")
    for name, table in results.get("profile", {}).items():
        lines += [f"## Profile: {name}", "",
                  f"{table['kernels_per_step']:.0f} kernels, {table['kernel_us_per_step']:.0f} us of kernels in "
                  f"{table['wall_us_per_step']:.0f} us of wall time per step"
                  + (f", {table['cuda_graph_launches_per_step']:.0f} CUDA-graph launches"
                     if table.get("cuda_graph_launches_per_step") else "") + ".", ""]
        if table.get("families_us_per_step"):
            lines += markdown_table(["kernel family", "us/step", "share of kernel time"],
                                    [[family, f"{t:.0f}", f"{t / table['kernel_us_per_step']:.1%}"]
                                     for family, t in table["families_us_per_step"].items()])
            lines.append("")
        lines += markdown_table(["kernel", "calls/step", "us/step"],
                                [[f"`{k}`", f"{c:.0f}", f"{t:.1f}"] for k, c, t in table["top"]])
        lines.append("")
        if table.get("host_top"):
            lines += markdown_table(["host operator (self CPU time)", "calls/step", "us/step"],
                                    [[f"`{k}`", f"{c:.0f}", f"{t:.1f}"] for k, c, t in table["host_top"]])
            lines.append("")
    if results.get("errors"):
        lines += ["## Errors", ""] + [f"- {e}" for e in results["errors"]] + [""]
    if results.get("skipped") or results.get("unfinished"):
        lines += ["## Tasks not measured", ""]
        lines += [f"- {task}: skipped, past `--deadline-s`" for task in results.get("skipped", [])]
        lines += [f"- {task}: not finished when this was written" for task in results.get("unfinished", [])]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (label, model, ratio to Llama): the paired rounds' median where the rows were paired with Llama, else the ratio
    # of the throughputs to the Llama row of the same task's GPU (`ratio_to_llama`)
    groups = []
    train, decode = results.get("train", []), results.get("decode", [])
    ratios = {**ratio_to_llama(train, "tokens_per_s", lambda r: (r["size"], r["mode"], r["batch"])),
              **ratio_to_llama(decode, "decode_tokens_per_s", lambda r: (r["size"], r["mode"], r["batch"]))}

    def to_llama(r):  # (rounds paired with another model than Llama, with or without LoRA, give no ratio to Llama)
        baseline = r.get("round_paired_baseline", "llama")
        paired = r.get("round_paired_ratio") if baseline in ("llama", f"llama{LORA}") else None
        return ratios.get(id(r)) if paired is None else paired

    for r in train:
        batch = "" if r["batch"] == TRAIN_BATCH.get(r["size"]) else f" b{r['batch']}"
        groups.append((f"train {r['size']}{batch} {r['mode']}", r["arch"], to_llama(r)))
    for r in decode:
        groups.append((f"decode {r['size']} b{r['batch']} {r['mode']}", r["arch"], to_llama(r)))
    groups = [group for group in groups if group[2] is not None]
    if not groups:
        return
    labels = list(dict.fromkeys(g for g, _, _ in groups))
    # in ARCHS's order, each `<arch>@other` model (another package's, not in ARCHS) beside its architecture
    archs = sorted({arch for _, arch, _ in groups},
                   key=lambda arch: (ARCHS.index(arch.removesuffix(OTHER_PACKAGE)), arch.endswith(OTHER_PACKAGE)))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(labels)) + 3, 4.5))
    width = 0.8 / len(archs)
    for i, arch in enumerate(archs):
        values = {g: v for g, a, v in groups if a == arch}
        xs = [j + i * width for j, g in enumerate(labels) if g in values]
        ax.bar(xs, [values[g] for g in labels if g in values], width, label=DISPLAY[arch])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("throughput / Llama")
    ax.set_title(f"Whole models against transformers' Llama, {results['environment']['device']}")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if any(r.get("round_paired_ratio") for r in (*train, *decode)):
        ax.text(1.01, 0.0, "models timed in alternating\nrounds: median of the\nrounds' ratios",
                transform=ax.transAxes, fontsize=7, va="bottom")
    fig.tight_layout()
    save_figure(fig, path)


def save(results: dict, out: str) -> None:
    write_json(os.path.join(out, "models_bench.json"), results)
    write_text(os.path.join(out, "models_bench.md"), report(results))


def finish(results: dict, out: str) -> dict:
    """The run's last save, its plot and its table printed."""
    save(results, out)
    try:
        plot(results, os.path.join(out, "models_bench.png"))
    except Exception as exc:  # noqa: BLE001
        log(f"plot failed: {exc!r}")
    log(report(results))
    return results


# --------------------------------------------------------------------------------------------------------------------
def default_tasks(args) -> list[str]:
    """The run's measurements, most important first (`--deadline-s` drops the tail when time runs out)."""
    tasks = [f"layer:{args.sizes[0]}"]
    for size in args.sizes:
        tasks += [f"train:{size}:{arch}:eager" for arch in args.archs]
    for size in args.decode_sizes:  # the models of a size decode in turn, round by round (`decode_rows`)
        tasks.append(f"decode:{size}:{'+'.join(args.archs)}:eager")
    if args.compile:
        for size in args.compile_sizes:
            tasks.append(f"decode:{size}:{'+'.join(args.archs)}:static")
            tasks += [f"train:{size}:{arch}:compiled" for arch in args.archs]
    tasks.append(f"profile:{args.sizes[0]}")
    return tasks


_MODES = "|".join(TRAIN_MODES)
TASK_FORMS = {  # each kind of task: its form as the help and errors write it, and as a pattern of the whole task
    "layer": ("layer:<size>[:compiled]", r"layer:(?P<size>[^:]+)(:compiled)?"),
    "profile": ("profile:<size>", r"profile:(?P<size>[^:]+)"),
    "profile_decode": ("profile_decode:<size>:<arch>[:<batch>]",
                       r"profile_decode:(?P<size>[^:]+):(?P<archs>[^:+]+)(:[1-9]\d*)?"),
    "profile_train": (f"profile_train:<size>:<arch>[:{_MODES}[:<batch>]]",
                      rf"profile_train:(?P<size>[^:]+):(?P<archs>[^:+]+)(:({_MODES})(:[1-9]\d*)?)?"),
    "train": (f"train:<size>:<arch>[+<arch>...]:{_MODES}[:<batch>]",
              rf"train:(?P<size>[^:]+):(?P<archs>[^:]+):({_MODES})(:[1-9]\d*)?"),
    "decode": ("decode:<size>:<arch>[+<arch>...]:eager|static",
               r"decode:(?P<size>[^:]+):(?P<archs>[^:]+):(eager|static)"),
}


def check_task(task: str, args=None) -> None:
    """Raises a ValueError naming the task and the form it breaks, or the options it needs that `args` (the run's
    options, where given) lacks; `main` checks every task before any runs, so that a mistyped last task does not end
    a long run."""
    kind = task.split(":")[0]
    if kind not in TASK_FORMS:
        raise ValueError(f"unknown task {task!r}: a task is one of {', '.join(f for f, _ in TASK_FORMS.values())}")
    form, pattern = TASK_FORMS[kind]
    match = re.fullmatch(pattern, task)
    if match is None:
        raise ValueError(f"task {task!r}: expected {form}")
    try:
        get_preset(match["size"])
    except ValueError as error:
        raise ValueError(f"task {task!r}: {error}") from None
    # the layer and profile tasks, and a training task without a batch of its own, take the preset's `TRAIN_BATCH`
    batch_given = kind in ("train", "profile_train") and re.search(r":\d+$", task)
    if kind in ("layer", "profile", "train", "profile_train") and not batch_given and match["size"] not in TRAIN_BATCH:
        own = ", or the task's own batch" if kind in ("train", "profile_train") else ""
        raise ValueError(f"task {task!r}: preset {match['size']} has no training batch here; allowed: "
                         f"{', '.join(TRAIN_BATCH)}{own}")
    architectures = match.groupdict().get("archs")
    named = architectures.split("+") if architectures else []
    repeated = sorted({architecture for architecture in named if named.count(architecture) > 1})
    if repeated:  # (decoding would keep one row of it, training would time it twice a round)
        raise ValueError(f"task {task!r}: {', '.join(repeated)} named more than once")
    for architecture in named:
        if architecture.removesuffix(OTHER_PACKAGE) not in ARCHS:
            raise ValueError(f"task {task!r}: architecture {architecture!r} is not one of {', '.join(ARCHS)} (a "
                             f"decode task's {OTHER_PACKAGE} suffix aside)")
        if architecture.endswith(OTHER_PACKAGE) and kind != "decode":
            raise ValueError(f"task {task!r}: an {OTHER_PACKAGE} model decodes only")
        if architecture.endswith(OTHER_PACKAGE) and args is not None and not (
                getattr(args, "decode_processes", False) and OTHER_PACKAGE_DIR):
            raise ValueError(f"task {task!r}: an {OTHER_PACKAGE} model needs --decode-processes and --other-package")
        if LOOKUP in architecture and kind in ("train", "profile_train"):
            raise ValueError(f"task {task!r}: a lookup variant ({', '.join(LOOKUP_ARCHS)}) decodes only; its memory "
                             "FFN's weights are dropped")


def run_task(task: str, args, results: dict) -> None:
    check_task(task, args)
    part, size, *rest = task.split(":")
    device = args.device
    if part == "layer":
        results["layer"] += layer_rows(size, device, compiled=rest == ["compiled"])
    elif part == "profile":
        results["profile"].update(profile_rows(size, device, args.archs))
    elif part == "profile_decode":
        architecture, *batch = rest
        results["profile"].update(profile_decode_rows(size, device, architecture, int(batch[0]) if batch else 1))
    elif part == "profile_train":
        architecture, *mode = rest
        mode, batch = (mode + [None])[:2] if mode else ("eager", None)
        results["profile"].update(profile_train_rows(size, device, architecture, mode, int(batch) if batch else None))
    elif part == "train":
        architecture, mode, *batch = rest
        architectures = architecture.split("+")
        batch = int(batch[0]) if batch else None
        rows = (paired_train_rows(architectures, size, mode, device, batch) if len(architectures) > 1
                else [train_row(architecture, size, mode, device, batch)])
        for row in rows:
            row["task"] = task
            results["train"].append(row)
            paired = f", paired rounds {paired_ratio_cell(row)}" if row.get("round_paired_ratio") else ""
            log(f"train {size} {mode} {row['arch']} batch {row['batch']}: {row['tokens_per_s'] / 1e3:.1f}k tokens/s, "
                f"step {row['step_ms']:.1f} ms (host {row['host_ms']:.1f} ms to issue), peak {fmt(row['peak_gib'])} "
                f"GiB{paired}")
    elif part == "decode":
        architectures, mode = rest
        decoder_class = ProcessDecoder if args.decode_processes else LocalDecoder
        decoders = {architecture: decoder_class(architecture, size, device, mode == "static")
                    for architecture in architectures.split("+")}
        try:
            for batch in args.decode_batches:
                rows, profiles = decode_rows(decoders, size, batch, mode == "static", args.decode_profile,
                                             args.decode_cpu_list)
                results["profile"].update(profiles)
                for row in rows:
                    row["task"] = task
                    results["decode"].append(row)
                    rounds = ", ".join(f"{t:.2f}" for t in row["round_median_ms_per_step"])
                    log(f"decode {size} {row['mode']} b{batch} {row['arch']}: {row['decode_tokens_per_s']:.0f} "
                        f"tokens/s ({row['ms_per_step']:.2f} ms/step; rounds {rounds})")
        finally:
            for decoder in decoders.values():
                decoder.close()
            del decoders
            release()


# --------------------------------------------------------------------------------------------------------------------
# Several GPUs: each task in a process of its own
# --------------------------------------------------------------------------------------------------------------------
FAILED_TASKS_EXIT = 1  # the exit status of a run whose report lists failed tasks (its files written all the same)
# the options that only choose the default tasks: `--tasks` names its own, so they are refused beside it
TASK_CHOOSING_OPTIONS = ("sizes", "compile", "decode_sizes", "compile_sizes")
# what each task's process is not given as is
NOT_FORWARDED = ("help", "out", "tasks", "gpus", "deadline_s", *TASK_CHOOSING_OPTIONS)


def forwarded_options(parser, args) -> list[str]:
    """The command-line options of `args` that differ from the defaults, for a task's own process."""
    options = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in NOT_FORWARDED or value == action.default:
            continue
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            options.append(flag)
        elif isinstance(value, list):
            options += [flag, *map(str, value)]
        else:
            options += [flag, str(value)]
    return options


def bound_by_host(task: str) -> bool:
    """Whether a task times steps that the host bounds (decoding): `--gpus` runs such a task with no other beside it."""
    return task.split(":")[0] in ("decode", "profile_decode")


def visible_device(gpu: int) -> str:
    """CUDA_VISIBLE_DEVICES for a process that is to see only the `gpu`-th of this process's GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[gpu].strip() if visible else str(gpu)


def run_on_gpus(tasks: list[str], args, parser) -> dict:
    """Runs every task in a process of its own (`<out>/tasks/<index>/`, its log beside it) on the next free one of
    `args.gpus` GPUs, in the order given, and merges what they measured, in task order, into one report. Each row notes
    its GPU; ratios to Llama are taken only between rows of one GPU (a task names Llama beside the models it compares).
    Decoding tasks run alone (`bound_by_host`): other tasks' compilation would take the host's CPUs from their steps.
    A task is not started after `--deadline-s`; the report is rewritten whenever a task finishes."""
    started = time.perf_counter()
    work = os.path.join(args.out, "tasks")
    os.makedirs(work, exist_ok=True)
    options = forwarded_options(parser, args)
    pending, running, finished = list(enumerate(tasks)), {}, {}
    while pending or running:
        for gpu in range(args.gpus):
            if gpu in running or not pending:
                continue
            # a decoding task is bound by the host: it runs alone, not beside another task's compilation
            if running and (bound_by_host(pending[0][1]) or any(bound_by_host(t) for _, t, *_ in running.values())):
                break
            elapsed = time.perf_counter() - started
            if args.deadline_s is not None and elapsed > args.deadline_s:
                finished.update({index: (task, None, None, "skipped") for index, task in pending})
                pending = []
                break
            index, task = pending.pop(0)
            out = os.path.join(work, f"{index:02d}")
            with contextlib.suppress(FileNotFoundError):  # an earlier run's, which a failed process would leave
                os.remove(os.path.join(out, "models_bench.json"))
            log_file = open(out + ".log", "w")  # noqa: SIM115 - closed when the process ends
            command = [sys.executable, os.path.abspath(__file__), "--out", out, "--tasks", task, *options]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible_device(gpu)}
            log(f"[{elapsed:.0f} s] GPU {gpu}: {task}")
            running[gpu] = (index, task, out, log_file,
                            subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env))
        for gpu, (index, task, out, log_file, process) in list(running.items()):
            if process.poll() is None:
                continue
            log_file.close()
            del running[gpu]
            path = os.path.join(out, "models_bench.json")
            child = None
            if os.path.exists(path):
                child = read_json(path)
            with open(out + ".log") as handle:
                lines = handle.read().splitlines()
            for line in lines:
                if line.startswith(("train ", "decode ", "FAILED")):
                    log(f"  GPU {gpu}: {line}")
            # (a process whose task failed writes the error into its results and ends with FAILED_TASKS_EXIT)
            recorded = child is not None and (process.returncode == 0 or (
                process.returncode == FAILED_TASKS_EXIT and child["errors"]))
            status = "ok" if recorded else f"exit code {process.returncode}: " + " | ".join(lines[-5:])[-400:]
            log(f"[{time.perf_counter() - started:.0f} s] GPU {gpu} finished {task}: {status}")
            finished[index] = (task, gpu, child, status)
            save(merge_task_results(tasks, finished, args), args.out)
        time.sleep(0.5)
    return finish(merge_task_results(tasks, finished, args), args.out)


def merge_task_results(tasks: list[str], finished: dict, args) -> dict:
    """One results dict from the task processes' ({index: (task, gpu, results or None, status)}), in task order."""
    merged = {"environment": None, "args": {**vars(args), "tasks": tasks}, "tasks": tasks, "train": [], "decode": [],
              "layer": [], "profile": {}, "errors": [], "skipped": [], "gpus": {},
              "unfinished": [task for index, task in enumerate(tasks) if index not in finished]}
    for index in sorted(finished):
        task, gpu, child, status = finished[index]
        if status == "skipped":
            merged["skipped"].append(task)
            continue
        if child is None:
            merged["errors"].append(f"{task}: {status}")
            continue
        merged["environment"] = merged["environment"] or child["environment"]
        merged["gpus"][str(gpu)] = child["environment"]["device"]
        for part in ("train", "decode", "layer"):
            merged[part] += [{**row, "gpu": gpu, "task": task} for row in child[part]]
        for name, table in child["profile"].items():
            merged["profile"][name if name not in merged["profile"] else f"{name} (task {index})"] = table
        merged["errors"] += child["errors"]
        if status != "ok":
            merged["errors"].append(f"{task}: {status}")
    merged["environment"] = merged["environment"] or environment()
    return merged


def main(argv=None) -> dict:
    global SEQ_LEN, NEW_TOKENS, BUILD_ON, DECODE_REPEATS, DECODE_COMPILE_MODE, TRAIN_ROUNDS, TRAIN_ROUND_STEPS
    global OTHER_PACKAGE_DIR
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True, help="directory for models_bench.{json,md,png}")
    parser.add_argument("--sizes", nargs="+", default=["370M", "1.3B"], help="presets of examples/presets.py")
    parser.add_argument("--archs", nargs="+", default=list(DEFAULT_ARCHS), choices=ARCHS)
    parser.add_argument("--compile", action="store_true", help="also time compiled training and static-cache decoding")
    parser.add_argument("--decode-sizes", nargs="+", default=["370M"], help="presets timed in the decode part")
    parser.add_argument("--compile-sizes", nargs="+", default=["370M"], help="presets timed compiled")
    parser.add_argument("--tasks", nargs="+", help="explicit measurements, e.g. layer:370M[:compiled] "
                        "train:370M:llama:eager decode:370M:llama+flash_mhf:static (models joined by + decode in "
                        "turn) profile:370M profile_train:370M:flash_mhf[:eager|compiled|cudagraphs[:1]] (one "
                        "training step by kernel family) "
                        "profile_decode:370M:flash_mhf[:16] (one static-cache generate() call at batch 1 [16]) "
                        "(default: all of the above options); every task is checked before the first runs")
    parser.add_argument("--deadline-s", type=float, default=None, help="start no measurement after this many seconds")
    parser.add_argument("--seq-len", type=int, default=2048, help="training sequence length")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per generate() call")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES),
                        help="batch sizes of the decode rows")
    parser.add_argument("--decode-processes", action="store_true",
                        help="each model of a decode task decodes in a process of its own (its own compile cache, as "
                             "a user runs one model); the models still take turns")
    parser.add_argument("--decode-profile", action="store_true",
                        help="after its timed rounds, each model of a decode task profiles one more call where it ran "
                             "(its own process with --decode-processes)")
    parser.add_argument("--decode-cpus", default=None,
                        help="with --decode-processes: pin each decoding process (after its warm-up) to one CPU of this "
                             "list ('8-13', '8,9,10'), or of the GPU's NUMA node with 'gpu'; the host's part of a "
                             "step then depends less on where the scheduler puts it")
    parser.add_argument("--other-package", default=None,
                        help="a directory holding another hf_memffn package (an earlier commit's): decode tasks' "
                             f"<arch>{OTHER_PACKAGE} models are built from it, each in its own process "
                             "(--decode-processes)")
    parser.add_argument("--decode-compile-mode", default="reduce-overhead", choices=["reduce-overhead", "default"],
                        help="torch.compile mode of static-cache decoding: generate()'s default with CUDA graphs, or "
                             "'default', the compiled graph launched without them (where a step's host time goes)")
    parser.add_argument("--decode-repeats", type=int, default=3,
                        help="rounds of timed generate() calls per decode row (the step median is taken over all)")
    parser.add_argument("--build-on", default="device", choices=["device", "cpu"],
                        help="where models are initialised before they move to --device (cpu: as the baseline run did; "
                             "slower to build, kept to tell whether construction on the device changes eager decoding)")
    parser.add_argument("--train-rounds", type=int, default=TRAIN_ROUNDS,
                        help="rounds of a training task that names several models "
                             "(train:1.3B:llama+flash_mhf:compiled)")
    parser.add_argument("--train-round-steps", type=int, default=TRAIN_ROUND_STEPS,
                        help="timed steps of each model per round of such a task")
    parser.add_argument("--gpus", type=int, default=1,
                        help="run the tasks on this many GPUs at once, each task in a process of its own on the next "
                             "free GPU, and write one report of all of them (ratios stay within a task's GPU)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a smoke run of the script itself (wall-clock times; the tests use it)")
    args = parser.parse_args(argv)
    # (--new-tokens: a decoding step is the time between two tokens)
    refuse_counts_below(parser, args, train_rounds=1, train_round_steps=1, gpus=1, decode_repeats=1, seq_len=1,
                        new_tokens=2, decode_batches=1)
    if args.deadline_s is not None and not args.deadline_s >= 0:  # (a NaN compares false: it would skip nothing)
        parser.error(f"--deadline-s must be 0 or more seconds, got {args.deadline_s}")
    if args.device == "cuda" and torch.cuda.is_available() and args.gpus > torch.cuda.device_count():
        parser.error(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} CUDA devices")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures GPUs (--device cpu only smoke-tests the script)")
    if args.decode_cpus is not None and not args.decode_processes:
        parser.error("--decode-cpus pins the decoding processes: it needs --decode-processes")
    try:
        args.decode_cpu_list = decode_cpus(args.decode_cpus)  # (checked before any model is built)
    except (ValueError, RuntimeError) as error:
        parser.error(str(error))
    if args.other_package is not None:
        if not os.path.isfile(os.path.join(args.other_package, "hf_memffn", "__init__.py")):
            parser.error(f"--other-package {args.other_package!r} holds no hf_memffn/__init__.py")
        OTHER_PACKAGE_DIR = os.path.abspath(args.other_package)
    measure_on(args.device)
    allow_recompiles()
    SEQ_LEN, NEW_TOKENS, BUILD_ON, DECODE_REPEATS = args.seq_len, args.new_tokens, args.build_on, args.decode_repeats
    DECODE_COMPILE_MODE, TRAIN_ROUNDS, TRAIN_ROUND_STEPS = (args.decode_compile_mode, args.train_rounds,
                                                            args.train_round_steps)
    if args.tasks:
        given = [name for name in TASK_CHOOSING_OPTIONS if getattr(args, name) != parser.get_default(name)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            parser.error(f"{flags} choose the default tasks; with --tasks, name the sizes and modes in the tasks "
                         "themselves (e.g. train:1.3B:flash_mhf:compiled)")
    tasks = args.tasks or default_tasks(args)
    for task in tasks:
        try:
            check_task(task, args)
        except ValueError as error:
            parser.error(f"--tasks: {error}")
    if args.gpus > 1:
        return run_on_gpus(tasks, args, parser)
    # "unfinished": the tasks not yet measured nor skipped, so that the files of a run cut short say what they lack
    results = {"environment": environment(), "args": vars(args), "tasks": tasks, "train": [], "decode": [],
               "layer": [], "profile": {}, "errors": [], "skipped": [], "unfinished": list(tasks)}
    started = time.perf_counter()
    for task in tasks:
        results["unfinished"].remove(task)
        elapsed = time.perf_counter() - started
        if args.deadline_s is not None and elapsed > args.deadline_s:
            results["skipped"].append(task)
            continue
        log(f"[{elapsed:.0f} s] {task}")
        try:
            run_task(task, args, results)
        except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
            log(f"FAILED {task}: {exc!r}")
            traceback.print_exc()
            results["errors"].append(f"{task}: {exc!r}"[:500])
            release()
        save(results, args.out)
    return finish(results, args.out)


if __name__ == "__main__":
    sys.exit(FAILED_TASKS_EXIT if main()["errors"] else 0)
