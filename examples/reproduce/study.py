"""The papers' comparisons on real text, in one command: every architecture and paper baseline trained from the same
seed on the same tokens with the recipe of examples/pretrain.py (the transformers Trainer), held-out loss at fixed
token counts (the training loss beside it), results as markdown + JSON, loss curves, exact configs.

    python examples/reproduce/prepare_data.py --out .study-data          # once (see its docstring)
    python examples/reproduce/study.py --data .study-data --out study-results
    python examples/reproduce/study.py --dataset NAME [--dataset-config C] --out study-results   # Hub data
    python examples/reproduce/study.py --print-configs --size 370M       # the matched configs and their counts

Models and sizing rules: examples/reproduce/models.py. Runs go in priority order (every model once, then more seeds
of the main comparison, then the KV-FFN ablations); results are rewritten after every run, and `--deadline-minutes`
skips the runs that would not finish in time with `--deadline-margin` to spare (they are listed as skipped);
`--resume` continues a study in `--out` with the runs it lacks, so one study can span several calls (or more seeds
and models added later); `--report` writes the report files again from `--out`'s results.json; `--merge` joins
studies made apart (with one size, budget, learning rate and data) into one in `--out`; `--learning-rate` runs every
model at one peak rate instead of its recipe's (learning_rates.py tabulates studies that differ only in it;
rate_sweep.sh runs one per rate). Output (`--out`): results.json, results.md, loss_curves.png, configs.json, log.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import models as study_models  # noqa: E402
import pretrain  # noqa: E402
import token_shards  # noqa: E402
from models import GROUP_BASELINES, GROUPS, RECIPES, SHAPES  # noqa: E402

# the reports' files (results, verdicts, learning rates) are written whole or not at all: `write_atomic` is the
# package's, which `verdicts` and `learning_rates` import from here
from hf_memffn.atomic_write import atomic_output, write_atomic  # noqa: E402

MAIN_SEED_KEYS = ("llama", "flash_mhf")  # the main comparison: several seeds by default
EVALS_PER_RUN = 8


class Claim(NamedTuple):
    """A paper's claim about two models: `lower` ends with the lower held-out loss, or with `level`, the two end level
    (a difference the paper calls none). `paper` quotes the paper's numbers or words."""
    group: str
    lower: str
    higher: str
    paper: str
    level: bool = False


CLAIMS = (
    Claim("flash-mhf", "flash_mhf", "llama", "3.014 < 3.030"),
    Claim("flash-mhf", "flash_mhf", "flash_mhf_half_head_dim", "3.014 < 3.046 (d_h=128 better than 64)"),
    Claim("flash-mhf", "llama", "flash_mhf_half_head_dim", "3.030 < 3.046 (d_h=64 underfits)"),
    Claim("flash-mhf", "flash_mhf", "flash_mhf_double_head_dim", "3.014 < 3.029 (d_h=128 better than 256)"),
    Claim("flash-mhf", "flash_mhf", "mh_ffn", "3.014 < 3.031"),
    Claim("flash-mhf", "llama", "mh_ffn", "3.030 vs 3.031 (MH-FFN level with SwiGLU)", level=True),
    Claim("flash-mhf", "llama", "dense_moe", "3.030 < 3.062"),
    Claim("flash-mhf", "dense_moe", "pkv", "3.062 < 3.334"),
    Claim("memoryllm", "llama", "memoryllm_total", "dense better at equal total"),
    Claim("memoryllm", "memoryllm_active", "llama", "MemoryLLM better at equal active"),
    Claim("memoryllm", "flex_total", "memoryllm_total", "Flex closes most of the gap"),
    Claim("memoryllm", "flex_active", "llama", "Flex matches or beats dense at equal active"),
    Claim("kv-ffn", "kv_swiglu", "kvffn", "4.927 < 5.161"),
    Claim("kv-ffn", "kvffn", "kv_glu", "5.161 < 5.287"),
    Claim("kv-ffn", "kv_glu", "kv_densenet", "5.287 < 5.324"),
    Claim("kv-ffn", "kv_densenet", "kv_relu", "5.324 < 5.432"),
    Claim("kv-ffn", "kvffn", "kvffn_init_inv_d", "1/sqrt(d) init most stable"),
    Claim("kv-ffn", "kvffn", "kvffn_init_inv_sqrt_h", "1/sqrt(d) init most stable"),
    Claim("kv-ffn", "kvffn", "kvffn_gelu", "SiLU better than GELU by 0.03"),
    Claim("kv-ffn", "kvffn", "kvffn_sum", "product better than sum by 0.12"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    data = p.add_argument_group("data (one of)")
    source = data.add_mutually_exclusive_group()
    source.add_argument("--data", default=None, help="token shards from prepare_data.py (default .study-data)")
    source.add_argument("--dataset", default=None,
                        help="a `datasets` Hub name: shards are prepared into OUT's work folder")
    data.add_argument("--dataset-config", default=None)
    data.add_argument("--text-column", default="text")
    source.add_argument("--text-files", nargs="+", default=None, help="local text files: shards prepared likewise")
    p.add_argument("--out", default="study-results", help="output folder")
    p.add_argument("--size", choices=sorted(SHAPES), default="small", help="model shape and default budget (models.py)")
    p.add_argument("--tokens", type=float, default=None, help="training tokens per model (default: the size's)")
    p.add_argument("--seeds", type=int, default=3, help="seeds of the main comparison (SwiGLU vs FlashMHF)")
    p.add_argument("--seeds-for", choices=("main", "all"), default="main", help="'all': every model gets --seeds seeds")
    p.add_argument("--models", default=None, help="comma-separated model keys to run (default: all; see --print-configs)")
    p.add_argument("--no-ablations", action="store_true", help="skip the KV-FFN ablations")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="held-out tokens per evaluation, in whole blocks, at most the held-out split (default: the "
                        "size's)")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="peak learning rate of every run instead of its recipe's (a check of a model's learning rate; "
                        "its results are not comparable with the recipes': write them to another --out)")
    p.add_argument("--deadline-minutes", type=float, default=None, help="start no run that would end after this")
    p.add_argument("--deadline-margin", type=float, default=0.15,
                   help="a run starts before the deadline only if (1 + this) x its estimated time fits (default 0.15; "
                        "the estimate is the model's last run on this device, else the runs' median time per FLOP)")
    p.add_argument("--work", default=None, help="folder for the runs' checkpoints (default: a temporary folder)")
    p.add_argument("--keep-runs", action="store_true", help="keep every run's folder (final model, train log)")
    p.add_argument("--report", action="store_true",
                   help="write the report files in --out again from its results.json and configs.json, "
                        "without training")
    p.add_argument("--resume", action="store_true",
                   help="continue the study in --out: keep its runs, train only the planned runs it lacks (the size, "
                        "--tokens, --eval-tokens and data must match)")
    p.add_argument("--merge", nargs="+", default=None, metavar="STUDY",
                   help="write one study to --out from these study folders, made apart (on several machines, say) "
                        "with one size, budget, learning rate and data, without training")
    p.add_argument("--print-configs", action="store_true", help="print the matched configs and parameter counts, then exit")
    return p


# --- helpers ------------------------------------------------------------------------------------------------------


# JSON has no NaN or infinity (Python's json writes the bare words NaN and Infinity, which strict readers refuse).
# The study's files are run records (`hf_memffn.run_records`, through pretrain): a number that is not finite is null
# and named under `not_finite`. Files of earlier versions wrote NaN as a bare null (`nan_where_null`) and an infinity
# as one of these texts, which `read_json` still reads.
EARLIER_INFINITY_TEXTS = {"Infinity": math.inf, "-Infinity": -math.inf}


def strict_json(value) -> str:
    """The text of a results file: strict JSON, a number that is not finite null and named under `not_finite`
    (`read_json` reads them back)."""
    return pretrain.run_record_json(value, indent=1) + "\n"


def infinities_back(value):
    """`value` as read from a file of an earlier version with each text of EARLIER_INFINITY_TEXTS the infinity it
    stands for."""
    if isinstance(value, str):
        return EARLIER_INFINITY_TEXTS.get(value, value)
    if isinstance(value, dict):
        return {key: infinities_back(item) for key, item in value.items()}
    if isinstance(value, list):
        return [infinities_back(item) for item in value]
    return value


def read_json(path: Path):
    """A results file of `strict_json`, each number that is not finite a float again (a file of an earlier version:
    its infinities too; a NaN stays null there: see `nan_where_null`)."""
    return infinities_back(pretrain.read_run_record(path.read_text(encoding="utf-8")))


LOSS_FIELDS = ("heldout_loss", "wiki_loss", "train_loss")


def nan_where_null(run: dict, fields: tuple[str, ...] = LOSS_FIELDS) -> dict:
    """A run as read from results.json (by `read_json`): each loss of `fields` and of its curves that is null there (a
    run that diverged to NaN, in a file of an earlier version, which named no `not_finite`) NaN again; a loss the run
    never measured (no Wikipedia split) stays absent."""
    run = {**run, **{field: math.nan for field in fields if field in run and run[field] is None}}
    for curve in ("train_curve", "eval_curve"):
        if run.get(curve):
            run[curve] = [[tokens, math.nan if loss is None else loss] for tokens, loss in run[curve]]
    return run


def save_figure(figure, path: Path, dpi: int) -> None:
    """Lays a matplotlib figure out, writes it whole to `path` (through a temporary name, `atomic_output`) in the
    format its suffix names, and closes it, whether or not the write succeeds."""
    import matplotlib.pyplot as plt

    try:
        figure.tight_layout()
        with atomic_output(path) as tmp:
            figure.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=dpi)
    finally:
        plt.close(figure)


def config_overrides(fields: dict) -> str:
    return ",".join(f"{key}={json.dumps(value)}" for key, value in fields.items())


def meta_model(model: study_models.StudyModel, shape, vocab_size: int):
    from transformers import AutoModelForCausalLM

    import hf_memffn  # noqa: F401  (registers the architectures)

    config = pretrain.build_config(model.arch, "tiny", vocab_size, **model.config_fields(shape))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def multi_head_ffn_path(config) -> str | None:
    """Which implementation of the fused op a FlashMHF-family FFN runs on this machine (kernels or PyTorch)."""
    if getattr(config, "residual_ffn", None) != "flash_mhf" or config.ffn_variant == "pkv":
        return None
    from hf_memffn.flash_mhf_op import flash_mhf_path

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q = torch.zeros(1, config.ffn_num_heads, 1, config.ffn_head_dim, device=device, dtype=dtype)
    k = torch.zeros(config.ffn_num_kv_heads, config.ffn_num_subnetworks, config.subnetwork_size, config.ffn_head_dim,
                    device=device, dtype=dtype)
    return flash_mhf_path(q, k, impl=config.ffn_kernel)


def describe_models(selected, shape, vocab_size: int) -> dict:
    """Parameter counts, training FLOPs per token and the fused op's path of every selected model."""
    described = {}
    for model in selected:
        built = meta_model(model, shape, vocab_size)
        block = RECIPES[model.recipe].block_size(shape)
        described[model.key] = {
            "counts": study_models.parameter_counts(built),
            "flops_per_token": pretrain.training_flops_per_token(built, block),
            "config": built.config.to_diff_dict(),
            "ffn_path": multi_head_ffn_path(built.config),
        }
    return described


def counts_table(selected, described) -> str:
    rows = ["| model | group | total params | vs baseline | active params | vs baseline | non-embedding | GFLOP/token |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in selected:
        counts = described[model.key]["counts"]
        base_key = GROUP_BASELINES[model.group]
        base = described.get(base_key, {}).get("counts")
        ratio = (lambda k: f"{100 * (counts[k] / base['total'] - 1):+.1f}%") if base else (lambda k: "")
        rows.append(f"| {model.label} | {model.group} | {counts['total']:,} | {ratio('total')} | {counts['active']:,} | "
                    f"{ratio('active')} | {counts['non_embedding']:,} | {described[model.key]['flops_per_token'] / 1e9:.3f} |")
    return "\n".join(rows)


def read_study(out: Path) -> dict:
    """results.json of the study in `out`, each run with its saved config from configs.json."""
    previous = read_json(out / "results.json")
    previous["runs"] = [nan_where_null(run) for run in previous["runs"]]
    if "repeats" in previous:  # (a repeat's Wikipedia loss is null where its run measured none as well)
        previous["repeats"] = [nan_where_null(repeat, ("heldout_loss",)) for repeat in previous["repeats"]]
    configs_path = out / "configs.json"
    saved = json.loads(configs_path.read_text(encoding="utf-8"))["models"] if configs_path.is_file() else {}
    for run in previous["runs"]:  # results.json leaves each run's saved config to configs.json
        if run["model"] in saved:
            run["config"] = saved[run["model"]]["config"]
    paths = previous.get("ffn_paths", {})
    previous["described"] = {key: {"counts": previous["parameters"][key], "ffn_path": paths.get(key),
                                   "config": saved.get(key, {}).get("config", {})} for key in previous["order"]}
    return previous


def rewrite_report(out: Path) -> dict:
    """--report: results.md, results.json, configs.json and loss_curves.png written again from the study in `out`
    (after a change to the report's format), without training."""
    if not (out / "results.json").is_file():
        raise ValueError(f"--report: no study in --out={str(out)!r} (results.json is missing)")
    state = read_study(out)
    write_outputs(state, out)
    print(f"rewrote {out}/results.md, results.json, loss_curves.png, configs.json from {len(state['runs'])} runs")
    return state


def load_previous(out: Path, size: str, tokens: int, eval_tokens: int, learning_rate: float | None,
                  data: dict) -> dict | None:
    """The study already in `out` (for --resume), refused unless it was made with the same size, budget, learning
    rate and data."""
    path = out / "results.json"
    if not path.is_file():
        print(f"--resume: no {path} yet, starting the study there")
        return None
    previous = read_study(out)
    settings = {"size": size, "tokens": tokens, "eval_tokens": eval_tokens, "learning_rate": learning_rate}
    refuse_other_settings(previous, path, settings, data, "--resume", "this call has",
                          "resume with the same value or choose another --out", "resume with the same --data")
    return previous


def refuse_other_settings(study: dict, path: Path, settings: dict, data: dict, option: str, other: str,
                          same_value: str, same_data: str) -> None:
    """Refuses the study in `path` unless it was made with these settings (size, budget, learning rate) and data."""
    for field, value in settings.items():
        if study.get(field) != value:
            raise ValueError(f"{option}: {path} was made with {field}={study.get(field)!r}, {other} "
                             f"{field}={value!r}; {same_value}")
    old_data = {k: (v.get("tokens"), v.get("sha256")) for k, v in study["data"]["splits"].items()}
    new_data = {k: (v.get("tokens"), v.get("sha256")) for k, v in data["splits"].items()}
    if old_data != new_data or study["data"]["tokenizer"] != data["tokenizer"]:
        raise ValueError(f"{option}: {path} was made from other data (splits {old_data}, tokenizer "
                         f"{study['data']['tokenizer']}); {same_data}")


def merge_studies(sources: list[Path], out: Path, command: str) -> dict:
    """--merge: one study in `out` from studies made apart with one size, budget, learning rate and data (each part
    of a study on its own machine, say). Each model and seed keeps its first run, in the order of `sources`; a later
    run of the same model and seed is kept as a repeat: the report lists it beside the kept run, which shows how far
    two runs of one seed end apart (the GPU's kernels are not bitwise deterministic). A run or call found in two of
    the studies (one continued from a copy of the other) is the same one, kept once: a run is told from another by its
    run_id (and, in studies made before runs had one, by all its fields, its timings too)."""
    if len(sources) < 2:
        raise ValueError(f"--merge: name two or more study folders, got {[str(s) for s in sources]}")
    for source in sources:
        if not (source / "results.json").is_file():
            raise ValueError(f"--merge: {str(source)!r} holds no study (results.json is missing)")
        if source.resolve() == out.resolve():
            raise ValueError(f"--merge: --out={str(out)!r} is one of the studies merged; choose a new folder")
    if (out / "results.json").exists():
        raise ValueError(f"--merge: --out={str(out)!r} already holds a study; choose a new folder")
    studies = [read_study(source) for source in sources]
    first = studies[0]
    settings = {field: first.get(field) for field in ("size", "tokens", "eval_tokens", "learning_rate")}
    for source, study in zip(sources[1:], studies[1:]):
        refuse_other_settings(study, source, settings, first["data"], "--merge", f"{sources[0]} with",
                              "merge studies of one size, budget and learning rate", "merge studies of one data")

    def unique(values) -> list:
        return list(dict.fromkeys(values))

    def add_new(items: list, new: list) -> None:
        items += [item for item in new if item not in items]

    kept: dict[tuple[str, int], dict] = {}
    repeats, calls, merges = [], [], []
    for source, study in zip(sources, studies):
        study_calls, study_merges = provenance(study)
        add_new(calls, study_calls)
        add_new(merges, study_merges)
        add_new(repeats, study.get("repeats", []))
        for run in study["runs"]:
            first_run = kept.setdefault((run["model"], run["seed"]), run)
            if run != first_run:
                add_new(repeats, [{"model": run["model"], "seed": run["seed"], "heldout_loss": run["heldout_loss"],
                                   "wiki_loss": run.get("wiki_loss"), "device": run.get("device"),
                                   "study": str(source)}])
    known = {key: study for study in reversed(studies) for key in study["order"]}
    order = [m.key for m in study_models.study_models(SHAPES[first["size"]]) if m.key in known]
    done = {f"{model}/seed{seed}" for model, seed in kept}
    state = {
        **first, "command": command, "merged_from": [str(source) for source in sources], "earlier_calls": calls,
        "earlier_merges": merges, "device": ", ".join(unique(study["device"] for study in studies)),
        "bf16": all(study["bf16"] for study in studies),
        "torch": ", ".join(unique(study["torch"] for study in studies)),
        "transformers": ", ".join(unique(study["transformers"] for study in studies)),
        "order": order, **{field: {key: known[key][field][key] for key in order}
                           for field in ("described", "labels", "groups", "paper")},
        "ablations": [key for key in order if key in known[key]["ablations"]],
        "plan": unique(label for study in studies for label in study["plan"]),
        "runs": list(kept.values()), "repeats": repeats,
        "skipped": unique(label for study in studies for label in study["skipped"] if label not in done),
        "elapsed_seconds": 0.0,
    }
    out.mkdir(parents=True, exist_ok=True)
    write_outputs(state, out)
    logs = [f"===== merged from {source}: its log.txt\n" + (source / "log.txt").read_text(encoding="utf-8")
            for source in sources if (source / "log.txt").is_file()]
    write_atomic(out / "log.txt", "".join(logs))
    print(f"merged {len(state['runs'])} runs ({len(repeats)} repeated) from {len(sources)} studies into {out}")
    return state


def estimated_run_seconds(model_key: str, cost: float, last_seconds: dict[str, float],
                          seconds_per_flop: list[float], margin: float) -> float | None:
    """How long a run of `cost` FLOPs is taken to need before the deadline: (1 + margin) x the model's last run on this
    device (its first run includes compilation and autotuning, so this errs long), else x the median time per FLOP of
    the runs so far; None with no run to go by."""
    if model_key in last_seconds:
        return (1 + margin) * last_seconds[model_key]
    if seconds_per_flop:
        return (1 + margin) * statistics.median(seconds_per_flop) * cost
    return None


def run_plan(selected, seeds: int, seeds_for: str) -> list[tuple[study_models.StudyModel, int]]:
    """Every main model with seed 0, then the extra seeds, then the ablations (seed 0), then their extra seeds."""
    main = [m for m in selected if not m.ablation]
    ablations = [m for m in selected if m.ablation]
    extra_seeded = main if seeds_for == "all" else [m for m in main if m.key in MAIN_SEED_KEYS]
    plan = [(m, 0) for m in main]
    plan += [(m, seed) for seed in range(1, seeds) for m in extra_seeded]
    plan += [(m, 0) for m in ablations]
    if seeds_for == "all":
        plan += [(m, seed) for seed in range(1, seeds) for m in ablations]
    return plan


def heldout_loss(model, blocks, batch_size: int, device) -> float:
    """Mean next-token loss over the blocks, in the precision the Trainer used (bf16 autocast on GPUs)."""
    model.eval()
    total, count = 0.0, 0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    with torch.no_grad(), autocast:
        for start in range(0, len(blocks), batch_size):
            ids = pretrain.collate_blocks([blocks[i] for i in range(start, min(start + batch_size, len(blocks)))])
            ids = ids["input_ids"].to(device)
            total += model(input_ids=ids, labels=ids).loss.item() * ids.shape[0]
            count += ids.shape[0]
    return total / count


def evaluated_tokens(split_tokens: int, block: int, eval_tokens: int) -> int:
    """The held-out tokens one evaluation reads (examples/pretrain.py's `--max-eval-blocks`): `eval_tokens` in whole
    blocks, at least one, and no more blocks than the split holds (its tail shorter than a block is never read)."""
    return min(max(1, eval_tokens // block), split_tokens // block) * block


def evaluated_tokens_text(runs: list[dict], eval_tokens: int) -> str:
    """The held-out tokens the runs' evaluations read (one count per sequence length), for a report; `eval_tokens`
    (the setting) where no run records its count (studies written before the runs did)."""
    counts = sorted({run["eval_tokens"] for run in runs if "eval_tokens" in run}, reverse=True) or [eval_tokens]
    return " or ".join(f"{count:,}" for count in counts)


def out_of_domain_loss(final: Path, data_dir: Path, block: int, batch: int, eval_tokens: int) -> float | None:
    """Loss of the saved model (reloaded from disk) on the Wikipedia held-out split, when the data has one."""
    if not token_shards.split_path(data_dir, "heldout_wiki").is_file():
        return None
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).to(device)
    blocks = token_shards.load_blocks(data_dir, block, "heldout_wiki")
    return heldout_loss(model, blocks.select(range(min(len(blocks), max(1, eval_tokens // block)))), batch, device)


def read_curves(log_path: Path, tokens_per_step: int) -> tuple[list, list]:
    train, evals = [], []
    for line in log_path.read_text(encoding="utf-8").splitlines():
        record = pretrain.read_run_record(line)  # (a loss that is not finite, null in the file, a float again)
        tokens = record["step"] * tokens_per_step
        if "loss" in record:
            train.append([tokens, round(record["loss"], 4)])
        if "eval_loss" in record and (not evals or evals[-1][0] != tokens):
            evals.append([tokens, round(record["eval_loss"], 4)])
    return train, evals


# --- one run ------------------------------------------------------------------------------------------------------


def train_one(model: study_models.StudyModel, seed: int, shape, tokens: int, args, data_dir: Path, work: Path,
              log_handle) -> dict:
    recipe = RECIPES[model.recipe]
    learning_rate = args.learning_rate or recipe.learning_rate
    block = recipe.block_size(shape)
    batch = max(1, shape.tokens_per_step // block)
    tokens_per_step = batch * block
    steps = max(1, round(tokens / tokens_per_step))
    eval_steps = max(1, steps // EVALS_PER_RUN)
    run_dir = work / f"{model.key}-seed{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        "--arch", model.arch, "--preset", "tiny", "--config-overrides", config_overrides(model.config_fields(shape)),
        "--data-dir", str(data_dir), "--block-size", str(block), "--per-device-batch-size", str(batch),
        "--max-steps", str(steps), "--learning-rate", str(learning_rate),
        "--min-learning-rate", str(recipe.min_learning_rate), "--warmup-ratio", str(recipe.warmup_ratio),
        "--weight-decay", str(recipe.weight_decay), "--max-grad-norm", str(recipe.max_grad_norm),
        "--logging-steps", str(max(1, steps // 50)), "--eval-steps", str(eval_steps),
        "--max-eval-blocks", str(max(1, args.eval_tokens // block)), "--save-steps", str(10**9),
        "--seed", str(seed), "--output-dir", str(run_dir),
    ]
    started = time.perf_counter()
    with contextlib.redirect_stdout(log_handle), contextlib.redirect_stderr(log_handle):
        print(f"\n===== {model.key} seed {seed}: examples/pretrain.py {' '.join(argv)}", flush=True)
        summary = pretrain.main(argv)
        wiki_loss = out_of_domain_loss(Path(summary["final_model"]), data_dir, block, batch, args.eval_tokens)
    train_curve, eval_curve = read_curves(run_dir / "train_log.jsonl", tokens_per_step)
    result = {
        "model": model.key, "seed": seed, "run_id": uuid.uuid4().hex, "steps": summary["global_step"],
        "tokens": summary["global_step"] * tokens_per_step,
        "tokens_per_step": tokens_per_step, "block_size": block, "learning_rate": learning_rate,
        "heldout_loss": summary["eval_loss"],
        "eval_tokens": evaluated_tokens(token_shards.read_meta(data_dir)["splits"]["heldout"]["tokens"], block,
                                        args.eval_tokens),
        "train_loss": summary["train_loss"], "tokens_per_second": summary.get("tokens_per_second"),
        "peak_memory_gib": summary.get("peak_memory_gib"), "train_seconds": summary["train_seconds"],
        "train_curve": train_curve, "eval_curve": eval_curve, "device": summary["device"], "bf16": summary["bf16"],
    }
    final = Path(summary["final_model"])
    config_path = final / "config.json"
    result["config"] = json.loads(config_path.read_text(encoding="utf-8"))
    if wiki_loss is not None:
        result["wiki_loss"] = wiki_loss
    if not args.keep_runs:
        shutil.rmtree(run_dir, ignore_errors=True)
    result["wall_seconds"] = round(time.perf_counter() - started, 2)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


# --- results ------------------------------------------------------------------------------------------------------


def sample_stdev(values: list[float]) -> float | None:
    """The sample standard deviation: None under two values, NaN where one is not finite (a run whose loss diverged
    to NaN or infinity; `statistics.stdev` raises on those)."""
    if len(values) < 2:
        return None
    return statistics.stdev(values) if all(math.isfinite(value) for value in values) else math.nan


def perplexity(loss: float) -> float:
    """exp(loss); infinity where that is beyond a float (a run that diverged to a finite loss above 709, where
    `math.exp` raised and the study stopped writing its results)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def aggregate(runs: list[dict]) -> dict:
    by_model: dict[str, list[dict]] = {}
    for run in runs:
        by_model.setdefault(run["model"], []).append(run)
    summary = {}
    for key, model_runs in by_model.items():
        losses = [r["heldout_loss"] for r in model_runs]
        # (a run too short to time a step, its first being untimed, has no rate: None, not 0)
        measured = [r["tokens_per_second"] for r in model_runs if r["tokens_per_second"]]
        entry = {
            "seeds": [r["seed"] for r in model_runs],
            "heldout_loss_mean": statistics.fmean(losses),
            "heldout_loss_std": sample_stdev(losses),
            "heldout_loss_min": min(losses), "heldout_loss_max": max(losses),
            "perplexity": perplexity(statistics.fmean(losses)),
            "tokens_per_second": statistics.fmean(measured) if measured else None,
            "peak_memory_gib": max((r["peak_memory_gib"] for r in model_runs if r["peak_memory_gib"] is not None), default=None),
            "train_seconds": statistics.fmean([r["train_seconds"] for r in model_runs]),
            "wall_seconds": statistics.fmean([r["wall_seconds"] for r in model_runs]),
        }
        wiki = [r["wiki_loss"] for r in model_runs if "wiki_loss" in r]
        if wiki:
            entry["wiki_loss_mean"] = statistics.fmean(wiki)
            entry["wiki_loss_std"] = sample_stdev(wiki)
        summary[key] = entry
    return summary


def paired_difference(runs: list[dict], lower: str, higher: str,
                      loss: str = "heldout_loss") -> tuple[int, float | None, float | None]:
    """loss(higher) - loss(lower) over the seeds both ran (a seed fixes the order of the training batches): the number
    of seeds, the mean difference and its standard error (None under two seeds). ``loss`` names the run's field:
    "heldout_loss" (held-out text of the training corpus) or "wiki_loss" (the out-of-domain held-out set)."""
    losses: dict[str, dict[int, float]] = {}
    for run in runs:
        if run.get(loss) is not None:
            losses.setdefault(run["model"], {})[run["seed"]] = run[loss]
    seeds = sorted(set(losses.get(lower, {})) & set(losses.get(higher, {})))
    differences = [losses[higher][s] - losses[lower][s] for s in seeds]
    if not differences:
        return 0, None, None
    spread = sample_stdev(differences)
    error = spread / math.sqrt(len(differences)) if spread is not None else None
    return len(differences), statistics.fmean(differences), error


DIVERGED = "diverged: no verdict"


def verdict(lower: dict, higher: dict,
            paired: tuple[int, float | None, float | None] = (0, None, None), level: bool = False) -> tuple[float, str]:
    """How the paper's ordering (lower < higher) fares, or with `level` its claim that the two end level (a resolved
    difference names the model ahead as "{lower}" or "{higher}", for the caller to fill in). With three or more
    common seeds, by the paired difference: resolved when it exceeds twice its standard error. Otherwise by the
    difference of the means against twice the larger seed standard deviation; where either model ran one seed, whose
    spread is unknown, never resolved; a difference of zero is a tie, neither order. Where a run diverged (a loss of
    NaN or infinity) there is no verdict: its loss says nothing of the ordering, either way."""
    delta = higher["heldout_loss_mean"] - lower["heldout_loss_mean"]
    seeds, paired_delta, error = paired
    if not math.isfinite(delta) or (paired_delta is not None and not math.isfinite(paired_delta)):
        return delta, DIVERGED
    if seeds >= 3 and error is not None:
        resolved, sign = abs(paired_delta) > 2 * error, paired_delta
    else:
        spreads = (lower["heldout_loss_std"], higher["heldout_loss_std"])
        if None in spreads:
            if level:
                return delta, "undecided (one seed)"
            if delta == 0:  # (equal losses: neither order)
                return delta, "tied (one seed)"
            return delta, "reproduced (one seed)" if delta > 0 else "not reproduced (one seed)"
        resolved, sign = abs(delta) > 2 * max(spreads), delta
    if level:
        ahead = "{lower}" if sign > 0 else "{higher}"
        return delta, f"not level: {ahead} ahead" if resolved else "level, within seed noise"
    if resolved:
        return delta, "reproduced" if sign > 0 else "not reproduced"
    if sign == 0:  # (equal losses: neither order)
        return delta, "tied, within seed noise"
    return delta, "same order, within seed noise" if sign > 0 else "reversed, within seed noise"


def verdict_is_resolved(text: str) -> bool:
    """Whether a text of `verdict`'s calls the difference resolved, either way (a level claim's "not level: X ahead"
    too; a verdict from one seed, or of a run that diverged, never)."""
    return text in ("reproduced", "not reproduced") or text.startswith("not level")


def diverged_runs(summary: dict, labels: dict, runs: list[dict], keys: tuple[str, ...]) -> list[str]:
    """The runs of the models `keys` whose held-out loss is NaN or infinite, as "FlashMHF seed 1"; a model whose mean
    is not finite with no such run among `runs` is named alone."""
    diverged = [run for run in runs if run["model"] in keys and run.get("heldout_loss") is not None
                and not math.isfinite(run["heldout_loss"])]
    unnamed = [key for key in keys if not math.isfinite(summary[key]["heldout_loss_mean"])
               and key not in {run["model"] for run in diverged}]
    return [f"{labels[run['model']]} seed {run['seed']}" for run in diverged] + [labels[key] for key in unnamed]


def claims_table(summary: dict, labels: dict, runs: list[dict] = ()) -> list[dict]:
    """A row per paper's ordering between two models of `summary`, with its verdict; where a run of either model
    diverged, the verdict is "diverged: no verdict" and names those runs (`diverged`)."""
    rows = []
    for group, lower, higher, paper, level in CLAIMS:
        if lower in summary and higher in summary:
            paired = paired_difference(list(runs), lower, higher)
            delta, text = verdict(summary[lower], summary[higher], paired, level=level)
            diverged = diverged_runs(summary, labels, list(runs), (lower, higher)) if text == DIVERGED else []
            if diverged:
                text = f"{DIVERGED} ({', '.join(diverged)})"
            if level:
                text = text.format(lower=labels[lower], higher=labels[higher])
            row = {"group": group, "claim": f"{labels[lower]} {'level with' if level else '<'} {labels[higher]}",
                   "lower": lower, "higher": higher, "paper": paper, "delta": delta, "verdict": text,
                   "paired_seeds": paired[0]}
            if diverged:
                row["diverged"] = diverged
            # (unrounded: the tables print three places, and a value rounded here first could print one unit off)
            if paired[1] is not None:
                row["paired_delta"] = paired[1]
            if paired[2] is not None:
                row["paired_standard_error"] = paired[2]
            # the same ordering on the out-of-domain held-out set, reported beside the verdict (which is in-domain)
            wiki_seeds, wiki_delta, wiki_error = paired_difference(list(runs), lower, higher, loss="wiki_loss")
            if wiki_error is not None:
                row.update(wiki_paired_seeds=wiki_seeds, wiki_paired_delta=wiki_delta,
                           wiki_paired_standard_error=wiki_error)
            rows.append(row)
    keys = ("llama", "memoryllm_total", "flex_total")
    if all(k in summary for k in keys):
        dense, memory, flex = (summary[k]["heldout_loss_mean"] for k in keys)
        gap_row = {"group": "memoryllm", "claim": "share of MemoryLLM's gap to dense that Flex closes (equal total)",
                   "paper": "most of it"}
        diverged = diverged_runs(summary, labels, list(runs), keys)
        if diverged:
            rows.append({**gap_row, "delta": math.nan, "verdict": f"{DIVERGED} ({', '.join(diverged)})",
                         "diverged": diverged})
        elif memory > dense:
            closed = (memory - flex) / (memory - dense)
            rows.append({**gap_row, "delta": round(closed, 3),
                         "verdict": "reproduced" if closed > 0.5 else "not reproduced"})
    return rows


def claims_rows(claims: list[dict], rates: dict[str, str] | None = None) -> list[str]:
    """The markdown table of `claims_table`'s rows; with `rates` (model key -> its learning rate as text), a column
    saying at which rate each of the two models ran."""
    def paired_text(claim: dict, prefix: str = "") -> str:
        if claim.get(f"{prefix}paired_standard_error") is None:
            return "-"
        return (f"{claim[f'{prefix}paired_delta']:+.3f} ± {claim[f'{prefix}paired_standard_error']:.3f} "
                f"({claim[f'{prefix}paired_seeds']})")

    rate_header, rate_rule = ("lr (left / right) | ", "---:|") if rates else ("", "")
    lines = [f"| group | paper's ordering | paper | {rate_header}Δ here | paired Δ ± s.e. (seeds) | verdict | "
             "Wikipedia: paired Δ ± s.e. (seeds) |",
             f"|---|---|---|{rate_rule}---:|---:|---|---:|"]
    for c in claims:
        rate_cell = ""
        if rates:  # (the row of the share of a gap compares three models, not two)
            rate_cell = (f"{rates[c['lower']]} / {rates[c['higher']]}" if "lower" in c else "-") + " | "
        lines.append(f"| {c['group']} | {c['claim']} | {c['paper']} | {rate_cell}{c['delta']:+.3f} | "
                     f"{paired_text(c)} | {c['verdict']} | {paired_text(c, 'wiki_')} |")
    return lines


def fmt(value, digits=3):
    return "-" if value is None else f"{value:.{digits}f}"


def rate_of(tokens_per_second: float | None) -> str:
    """Training tokens/s as the report prints it; "-" where no step was timed."""
    return "-" if tokens_per_second is None else f"{tokens_per_second:,.0f}"


def fmt_tokens(tokens: int) -> str:
    return f"{tokens / 1e6:.3g}M" if tokens >= 100_000 else f"{tokens / 1e3:.3g}k"


def panel_keys(state: dict, group: str) -> tuple[list[str], list[str]]:
    """(keys drawn, reference keys drawn faint) of one results table / plot panel."""
    main = [k for k in state["order"] if state["groups"][k] == group.removesuffix(" ablations")]
    if group == "kv-ffn ablations":
        return [k for k in main if k in state["ablations"]], ["kvffn"]
    keys = [k for k in main if k not in state["ablations"]]
    return keys, (["llama"] if group == "memoryllm" else [])


def provenance(study: dict) -> tuple[list[dict], list[str]]:
    """The calls that trained a study's runs (command, device, seconds) and the `--merge` commands that joined them: a
    merged study's own command trained nothing, so it counts as a merge, not a call."""
    calls, merges = list(study.get("earlier_calls", [])), list(study.get("earlier_merges", []))
    if study.get("merged_from"):
        merges.append(study["command"])
    else:
        calls.append({k: study[k] for k in ("command", "device", "elapsed_seconds")})
    return calls, merges


def calls_markdown(state: dict) -> list[str]:
    """The commands that made the study: one, several continuing it with --resume, or the calls of merged studies."""
    def listed(calls):
        return [f"  {i + 1}. on {call['device']}, {call['elapsed_seconds']:.0f} s: `{call['command']}`"
                for i, call in enumerate(calls)]

    if state.get("merged_from"):
        earlier = [f"- of those, studies merged earlier with `{command}`"
                   for command in state.get("earlier_merges", [])]
        return [f"- merged with `{state['command']}` from {len(state['merged_from'])} studies, made in these "
                f"{len(state['earlier_calls'])} calls (in each study, each call after the first continuing it with "
                "`--resume`):", *listed(state["earlier_calls"]), *earlier]
    if state.get("earlier_calls"):
        how = "in studies joined by the merges below, each continued with `--resume`" if state.get("earlier_merges") \
            else "each after the first continuing the study with `--resume`"
        merges = [f"- studies merged with `{command}`" for command in state.get("earlier_merges", [])]
        return [f"- {len(state['earlier_calls']) + 1} calls, {how}:", *listed([*state["earlier_calls"], state]),
                *merges]
    return [f"- command: `{state['command']}`"]


def repeats_markdown(state: dict) -> list[str]:
    """The runs repeated with a seed already run (merged studies), beside the runs the tables keep."""
    kept = {(run["model"], run["seed"]): run for run in state["runs"]}
    pairs = [(kept[(repeat["model"], repeat["seed"])], repeat) for repeat in state.get("repeats", [])]
    return repeat_pairs_markdown(pairs, state["labels"], "in another of the studies merged here")


def repeat_pairs_markdown(pairs: list[tuple[dict, dict]], labels: dict, where: str, rate_text=None) -> list[str]:
    """(kept run, repeat) pairs of one model and seed (and peak learning rate: a column, written by `rate_text`, where
    that is given): both losses and their difference, and both runs' devices where any repeat ran on another device
    than its kept run; `where` says where the repeats come from."""
    if not pairs:
        return []
    with_rate = rate_text is not None
    across_devices = any(run.get("device") != repeat.get("device") for run, repeat in pairs)
    what = "run-to-run non-determinism of the GPU's kernels alone"
    if across_devices:
        what += "; where the devices differ (last column), the two devices' differences are in it too"
    columns = [("model", "---"), *([("lr", "---:")] if with_rate else []), ("seed", "---:"), ("kept run", "---:"),
               ("repeat", "---:"), ("repeat - kept", "---:"), ("Wikipedia: repeat - kept", "---:"),
               ("repeat's study", "---")]
    columns += [("kept on / repeat on", "---")] if across_devices else []
    same = "model, learning rate, seed" if with_rate else "model, seed"
    lines = ["## Runs repeated with the same seed", "",
             f"The same {same} and order of batches run again, {where}; the tables above keep the first run. Where "
             f"both ran on one device and software, their difference is the {what}.", "",
             "| " + " | ".join(name for name, _ in columns) + " |", "|" + "|".join(align for _, align in columns) + "|"]
    for run, repeat in pairs:
        wiki = "-" if repeat.get("wiki_loss") is None or run.get("wiki_loss") is None else \
            f"{repeat['wiki_loss'] - run['wiki_loss']:+.3f}"
        cells = [labels[repeat["model"]], *([rate_text(repeat["learning_rate"])] if with_rate else []),
                 str(repeat["seed"]), f"{run['heldout_loss']:.3f}", f"{repeat['heldout_loss']:.3f}",
                 f"{repeat['heldout_loss'] - run['heldout_loss']:+.3f}", wiki, repeat["study"]]
        cells += [f"{run.get('device') or '?'} / {repeat.get('device') or '?'}"] if across_devices else []
        lines.append("| " + " | ".join(cells) + " |")
    summary = repeat_summary_lines(pairs)
    return [*lines, "", *([*summary, ""] if summary else [])]


def repeat_summary_lines(pairs: list[tuple[dict, dict]]) -> list[str]:
    """One line per pair of devices with two or more repeats: how far the repeats moved from their kept runs (mean
    and sample standard deviation of repeat - kept, the largest |repeat - kept|), on held-out and Wikipedia loss."""
    by_devices: dict[tuple, list[tuple[dict, dict]]] = {}
    for run, repeat in pairs:
        by_devices.setdefault((run.get("device") or "?", repeat.get("device") or "?"), []).append((run, repeat))
    lines = []
    for (kept_on, repeat_on), group in by_devices.items():
        if len(group) < 2:
            continue
        where = f"kept on {kept_on}, repeated on {repeat_on}" if kept_on != repeat_on else f"both on {kept_on}"
        parts = []
        for key, name in (("heldout_loss", "held-out"), ("wiki_loss", "Wikipedia")):
            gaps = [repeat[key] - run[key] for run, repeat in group
                    if repeat.get(key) is not None and run.get(key) is not None]
            if len(gaps) >= 2:
                parts.append(f"{name} {statistics.fmean(gaps):+.3f} ± {sample_stdev(gaps):.3f} "
                             f"(largest {max(abs(gap) for gap in gaps):.3f})")
        if parts:
            lines.append(f"- {len(group)} repeats {where}: repeat - kept, mean ± sample standard deviation, "
                         + "; ".join(parts) + ".")
    return lines


def results_markdown(state: dict) -> str:
    summary, described, labels = state["summary"], state["described"], state["labels"]
    lines = [
        "# Reproduction study: FFN-as-memory architectures on real text", "",
        f"- device: {state['device']}; precision: {'bf16 autocast' if state['bf16'] else 'fp32'}; "
        f"{state['torch']}; {state['transformers']}",
        *calls_markdown(state),
        f"- data: {state['data']['source']['name']} ({state['data']['source']['licence']}); train stream "
        f"{state['data']['splits']['train']['tokens']:,} tokens, held-out {state['data']['splits']['heldout']['tokens']:,}"
        + (f", out-of-domain held-out (Wikipedia leads) {state['data']['splits']['heldout_wiki']['tokens']:,}"
           if "heldout_wiki" in state["data"]["splits"] else "")
        + f"; tokenizer: byte-level BPE of {state['data']['tokenizer']['vocab_size']} trained on the training split",
        *(f"- {labels[k]}: {described[k]['ffn_path']}" for k in state["order"] if described[k].get("ffn_path")),
        f"- size `{state['size']}`: {state['tokens']:,} training tokens per model, {state['shape']['tokens_per_step']:,} "
        f"tokens per step, held-out loss over {evaluated_tokens_text(state['runs'], state['eval_tokens'])} tokens at "
        f"{EVALS_PER_RUN} points and at the end",
        "- recipes: " + "; ".join(f"**{name}**: {RECIPES[name].source}" for name in RECIPES)
        + (f"; **every run here at peak learning rate {state['learning_rate']:g} instead of its recipe's**"
           if state.get("learning_rate") else ""),
        f"- runs done: {len(state['runs'])} of {len(state['plan'])}; wall time "
        f"{state['elapsed_seconds'] + sum(c['elapsed_seconds'] for c in state.get('earlier_calls', [])):.0f} s"
        + (f"; skipped (deadline): {', '.join(state['skipped'])}" if state["skipped"] else ""), "",
        "Held-out loss: mean over seeds ± sample standard deviation (n seeds); ppl = exp(mean loss). Compare models "
        "within a table (the KV-FFN group trains with another recipe and 2048-token sequences).", "",
    ]
    for group, title in GROUPS.items():
        keys = [k for k in state["order"] if state["groups"][k] == group and k in summary]
        if not keys:
            continue
        base = GROUP_BASELINES[group]
        if base in summary and base not in keys:
            keys.insert(0, base)
        lines += [f"## {title}", "",
                  "| model | total params | active params | held-out loss | n | ppl | Δ vs baseline | Wikipedia loss | "
                  "tokens/s | peak GiB | train s | paper |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for key in keys:
            entry, counts = summary[key], described[key]["counts"]
            delta = entry["heldout_loss_mean"] - summary[base]["heldout_loss_mean"] if base in summary else None
            std = f" ± {entry['heldout_loss_std']:.3f}" if entry["heldout_loss_std"] is not None else ""
            lines.append(
                f"| {labels[key]} | {counts['total']:,} | {counts['active']:,} | {entry['heldout_loss_mean']:.3f}{std} | "
                f"{len(entry['seeds'])} | {entry['perplexity']:.1f} | {'-' if key == base else fmt(delta)} | "
                f"{fmt(entry.get('wiki_loss_mean'))} | {rate_of(entry['tokens_per_second'])} | "
                f"{fmt(entry['peak_memory_gib'], 2)} | {entry['train_seconds']:.1f} | {state['paper'][key]} |")
        lines.append("")
    claims = claims_table(summary, labels, state["runs"])
    if claims:
        # (the diverged verdict is explained only in a report that has one)
        diverged = (" 'Diverged: no verdict': a run of either model (named) ended with a NaN or infinite loss, which "
                    "decides nothing either way." if any(c["verdict"].startswith(DIVERGED) for c in claims) else "")
        lines += ["## The papers' orderings at this scale", "",
                  "Δ = loss(right) - loss(left) of the means: positive when the paper's ordering holds; a claim "
                  "that two models end 'level with' each other holds when their difference is within seed noise. "
                  "Paired Δ: the same difference over the seeds both models ran (a seed fixes the order of the "
                  "training batches), "
                  "± its standard error. 'Within seed noise': with three or more common seeds, |paired Δ| is at most "
                  "twice its standard error; otherwise |Δ| is at most twice the larger seed standard deviation. "
                  "The verdict is the held-out text's; the last column is the same paired difference on the "
                  "out-of-domain held-out set (Wikipedia), where the runs measured it." + diverged, "",
                  *claims_rows(claims), ""]
    lines += repeats_markdown(state)
    lines += curves_markdown(state, summary)
    return "\n".join(lines) + "\n"


def training_loss_at_evaluations(run: dict) -> dict[int, float]:
    """The mean of a run's logged training losses since its evaluation before, at each of its evaluations (since the
    start at the first); an evaluation with no training loss logged since the one before is left out."""
    means, start = {}, 0
    for point, _ in run["eval_curve"]:
        window = [loss for tokens, loss in run["train_curve"] if start < tokens <= point]
        if window:
            means[point] = statistics.fmean(window)
        start = point
    return means


def curves_markdown(state: dict, summary: dict) -> list[str]:
    """The held-out loss at each evaluation, and beside it the training loss over the stretch of training before it,
    each a mean over seeds: where the training loss falls below the held-out loss, a model has begun to learn the
    training text by heart (a stream read several times)."""
    held_out: dict[str, dict[int, list[float]]] = {}
    training: dict[str, dict[int, list[float]]] = {}
    for key in state["order"]:
        for run in state["runs"]:
            if run["model"] == key and run["eval_curve"]:
                for tokens, loss in run["eval_curve"]:
                    held_out.setdefault(key, {}).setdefault(tokens, []).append(loss)
                for tokens, loss in training_loss_at_evaluations(run).items():
                    training.setdefault(key, {}).setdefault(tokens, []).append(loss)
    if not held_out:
        return []
    points = sorted({tokens for curve in held_out.values() for tokens in curve})
    header = ["| model | n | " + " | ".join(fmt_tokens(t) for t in points) + " |", "|---|---:|" + "---:|" * len(points)]

    def rows(curves: dict[str, dict[int, list[float]]]) -> list[str]:
        return [f"| {state['labels'][key]} | {len(summary[key]['seeds'])} | "
                + " | ".join(fmt(statistics.fmean(curve[t])) if t in curve else "-" for t in points) + " |"
                for key, curve in curves.items()]

    lines = ["## Held-out loss at fixed token counts (mean over seeds)", "", *header, *rows(held_out)]
    if training:
        lines += ["", "## Training loss at the same token counts (mean over seeds)", "",
                  "Each cell: the mean of the training losses logged since the evaluation before (since the start at "
                  "the first). Below the held-out loss above, the model has begun to learn the training text by heart.",
                  "", *header, *rows(training)]
    return lines


def plot_curves(state: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss_curves.png")
        return False
    done = {r["model"] for r in state["runs"] if r["eval_curve"]}
    panels = [g for g in (*GROUPS, "kv-ffn ablations") if set(panel_keys(state, g)[0]) & done]
    if not panels:
        return False
    columns = min(2, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 4.8 * rows), squeeze=False)
    for axis in axes.flat[len(panels):]:
        axis.set_visible(False)
    for axis, panel in zip(axes.flat, panels):
        keys, references = panel_keys(state, panel)
        finals = []
        for key in references + keys:
            runs = [r for r in state["runs"] if r["model"] == key and r["eval_curve"]]
            if not runs:
                continue
            length = min(len(r["eval_curve"]) for r in runs)
            tokens = [runs[0]["eval_curve"][i][0] / 1e6 for i in range(length)]
            losses = [[r["eval_curve"][i][1] for r in runs] for i in range(length)]
            reference = key in references
            line, = axis.plot(tokens, [statistics.fmean(v) for v in losses], ":" if reference else "-", marker="o",
                              markersize=3, color="grey" if reference else None, alpha=0.8 if reference else 1.0,
                              label=f"{state['labels'][key]} (n={len(runs)})" + (" [reference]" if reference else ""))
            if len(runs) > 1:
                axis.fill_between(tokens, [min(v) for v in losses], [max(v) for v in losses], color=line.get_color(), alpha=0.2)
            final = statistics.fmean(losses[-1])
            if math.isfinite(final):  # (a run that diverged to NaN or infinity ends off the scale)
                finals.append(final)
        axis.set_title(panel)
        axis.set_xlabel("training tokens (M)")
        axis.set_ylabel("held-out loss")
        if finals:
            axis.set_ylim(min(finals) - 0.2, max(finals) + 1.0)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"held-out loss (mean over seeds, band: min-max), {state['device']}, size {state['size']}")
    save_figure(figure, path, dpi=100)
    return True


def write_outputs(state: dict, out: Path) -> None:
    state["summary"] = aggregate(state["runs"])
    state["claims"] = claims_table(state["summary"], state["labels"], state["runs"])
    public = {k: v for k, v in state.items() if k not in ("described",)}
    public["parameters"] = {k: v["counts"] for k, v in state["described"].items()}
    public["ffn_paths"] = {k: v["ffn_path"] for k, v in state["described"].items() if v["ffn_path"]}
    public["runs"] = [{k: v for k, v in run.items() if k != "config"} for run in state["runs"]]
    write_atomic(out / "results.json", strict_json(public))
    write_atomic(out / "results.md", results_markdown(state))
    configs = {
        "shape": state["shape"], "recipes": {name: vars(recipe) for name, recipe in RECIPES.items()},
        "models": {key: {"label": state["labels"][key], "group": state["groups"][key],
                         "parameters": state["described"][key]["counts"],
                         "config": next((r["config"] for r in state["runs"] if r["model"] == key and "config" in r),
                                        state["described"][key]["config"])}
                   for key in state["order"]},
        "data": state["data"],
    }
    write_atomic(out / "configs.json", json.dumps(configs, indent=1) + "\n")
    plot_curves(state, out / "loss_curves.png")


# --- main ---------------------------------------------------------------------------------------------------------


class Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for stream in self.streams:
            stream.write(text)
            stream.flush()

    def flush(self):
        for stream in self.streams:
            stream.flush()


def select_models(args, shape):
    selected = study_models.study_models(shape)
    if args.no_ablations:
        selected = [m for m in selected if not m.ablation]
    if args.models is not None:
        wanted = [k.strip() for k in args.models.split(",") if k.strip()]
        known = [m.key for m in selected]
        if not wanted:  # (no run to plan)
            raise ValueError(f"--models: {args.models!r} names no model; name one or more of {known}, comma-separated")
        unknown = [k for k in wanted if k not in known]
        if unknown:
            raise ValueError(f"--models: {unknown} not among {known}")
        selected = [m for m in selected if m.key in wanted]
    return selected


def prepare_from_source(args, work: Path) -> Path:
    import prepare_data

    out = work / "data"
    source = ["--source", "hub", "--dataset", args.dataset, "--text-column", args.text_column] if args.dataset else \
        ["--source", "text-files", "--text-files", *args.text_files]
    if args.dataset_config:
        source += ["--dataset-config", args.dataset_config]
    prepare_data.main(["--out", str(out), "--overwrite", *source])
    return out


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    shape = SHAPES[args.size]
    if args.print_configs:
        selected = select_models(args, shape)
        described = describe_models(selected, shape, shape.vocab_size)
        print(f"size {shape.name} (vocabulary {shape.vocab_size}):\n" + counts_table(selected, described))
        return described
    def options_given(*taken: str) -> list[str]:
        return [f"--{name.replace('_', '-')}" for name, value in vars(args).items()
                if name not in taken and value != parser.get_default(name)]

    if args.merge:
        if args.report or args.resume:
            raise ValueError("--merge writes a new study to --out: give it without --report and --resume")
        # the merged study's settings are its sources': an option that would train or select differently is refused
        given = options_given("merge", "out")
        if given:
            raise ValueError(f"--merge takes only --out and the study folders; {', '.join(given)} would change "
                             "nothing: the merged study keeps its sources' runs and settings")
        argv = sys.argv[1:] if argv is None else list(argv)
        return merge_studies([Path(p) for p in args.merge], Path(args.out),
                             " ".join(["python", "examples/reproduce/study.py", *argv]))
    if args.report:
        given = options_given("report", "out")
        if given:
            raise ValueError(f"--report takes only --out; {', '.join(given)} would change nothing: the report is "
                             "written from the study's own runs and settings")
        return rewrite_report(Path(args.out))
    for name in ("dataset_config", "text_column"):
        if getattr(args, name) != parser.get_default(name) and not args.dataset:
            raise ValueError(f"--{name.replace('_', '-')} applies to --dataset only (a `datasets` Hub name), "
                             "which is not given")
    if not args.deadline_margin >= 0:
        raise ValueError(f"--deadline-margin must be 0 or more (0.15: 15% over a run's estimated time), "
                         f"got {args.deadline_margin}")
    if args.learning_rate is not None and not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be a positive number, got {args.learning_rate}")
    floor = max(recipe.min_learning_rate for recipe in RECIPES.values())
    if args.learning_rate is not None and args.learning_rate < floor:
        raise ValueError(f"--learning-rate must be at least {floor:g}, the rate the recipes' cosine decay ends at "
                         f"(below it the rate would climb), got {args.learning_rate:g}")
    if args.deadline_minutes is not None and not args.deadline_minutes > 0:
        raise ValueError(f"--deadline-minutes must be a positive number of minutes, got {args.deadline_minutes}")
    if args.seeds < 1:
        raise ValueError(f"--seeds must be 1 or more, got {args.seeds}")
    if args.tokens is not None and not args.tokens >= 1:
        raise ValueError(f"--tokens must be 1 or more training tokens per model, got {args.tokens}")
    if args.eval_tokens is not None and args.eval_tokens < 1:
        raise ValueError(f"--eval-tokens must be 1 or more held-out tokens per evaluation, got {args.eval_tokens}")
    if not shape.trainable:
        raise ValueError(f"--size={args.size!r} is a paper shape for --print-configs; trainable sizes: "
                         f"{[s for s, v in SHAPES.items() if v.trainable]}")
    # what can be checked without training is checked before --out is made, so a refused call leaves no folder
    select_models(args, shape)
    if not (args.dataset or args.text_files):
        token_shards.read_meta(Path(args.data or ".study-data"), option="--data")
    out = Path(args.out)
    if not args.resume and (out / "results.json").exists():
        raise ValueError(f"--out={str(out)!r} holds a study (results.json): pass --resume to add to it, --report to "
                         "write its report again, or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="memffn-study-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    log_handle = (out / "log.txt").open("a" if args.resume else "w", encoding="utf-8")
    console = sys.stdout
    sys.stdout = Tee(console, log_handle)
    try:
        return _study(args, shape, out, work, log_handle, started, sys.argv[1:] if argv is None else list(argv))
    finally:
        sys.stdout = console
        log_handle.close()
        if not args.work and not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)


def _study(args, shape, out: Path, work: Path, log_handle, started: float, argv: list[str]) -> dict:
    import transformers

    if args.dataset or args.text_files:
        data_dir = prepare_from_source(args, work)
    else:
        data_dir = Path(args.data or ".study-data")
    data = token_shards.read_meta(data_dir, option="--data")
    vocab_size = 64 * math.ceil(data["tokenizer"]["vocab_size"] / 64)
    tokens = int(args.tokens or shape.tokens)
    args.eval_tokens = args.eval_tokens or shape.eval_tokens
    selected = select_models(args, shape)
    previous = load_previous(out, shape.name, tokens, args.eval_tokens, args.learning_rate, data) \
        if args.resume else None
    done = {(r["model"], r["seed"]) for r in previous["runs"]} if previous else set()
    # the models to describe and report: this call's and every model the study in --out already ran
    wanted = {m.key for m in selected} | {key for key, _ in done}
    reported = [m for m in study_models.study_models(shape) if m.key in wanted]
    described = describe_models(reported, shape, vocab_size)
    plan = run_plan(selected, args.seeds, args.seeds_for)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    earlier_plan = [label for label in (previous or {}).get("plan", [])
                    if label not in {f"{m.key}/seed{s}" for m, s in plan}]
    earlier_calls, earlier_merges = provenance(previous) if previous else ([], [])
    state = {
        "command": " ".join(["python", "examples/reproduce/study.py", *argv]),
        "earlier_calls": earlier_calls, "earlier_merges": earlier_merges,
        "device": device, "bf16": torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        "torch": f"torch {torch.__version__}", "transformers": f"transformers {transformers.__version__}",
        "size": shape.name, "shape": {**vars(shape), "tokens_per_step": shape.tokens_per_step}, "tokens": tokens,
        "eval_tokens": args.eval_tokens, "learning_rate": args.learning_rate, "data": data, "described": described,
        "order": [m.key for m in reported], "labels": {m.key: m.label for m in reported},
        "groups": {m.key: m.group for m in reported}, "paper": {m.key: m.paper for m in reported},
        "ablations": [m.key for m in reported if m.ablation],
        "plan": earlier_plan + [f"{m.key}/seed{s}" for m, s in plan],
        "runs": list(previous["runs"]) if previous else [],
        "repeats": previous.get("repeats", []) if previous else [],
        "skipped": [], "elapsed_seconds": 0.0,
    }
    print(f"study: size {shape.name}, {tokens:,} tokens per model, {len(plan)} runs on {device} ({state['torch']}, "
          f"{state['transformers']}); data {data_dir} ({data['splits']['train']['tokens']:,} training tokens)")
    for key, entry in described.items():
        if entry["ffn_path"]:
            print(f"  {key}: {entry['ffn_path']}")
    if tokens > data["splits"]["train"]["tokens"]:
        print(f"note: {tokens:,} tokens per model is more than the {data['splits']['train']['tokens']:,} of the "
              "training stream: it repeats")
    if args.eval_tokens > data["splits"]["heldout"]["tokens"]:
        print(f"note: {args.eval_tokens:,} held-out tokens per evaluation (--eval-tokens) is more than the "
              f"{data['splits']['heldout']['tokens']:,} of the held-out split: each evaluation reads the whole split "
              "(in whole blocks), and the report gives the count read")
    print(counts_table(selected, described), flush=True)
    if previous:
        print(f"--resume: {len(done)} runs already in {out / 'results.json'}; "
              f"{sum((m.key, s) not in done for m, s in plan)} of this call's {len(plan)} planned runs left to train")
    # the deadline's estimates start from the earlier runs on this device
    seconds_per_flop = [r["wall_seconds"] / (described[r["model"]]["flops_per_token"] * tokens)
                        for r in state["runs"] if r.get("device") == device]
    last_seconds = {r["model"]: r["wall_seconds"] for r in state["runs"] if r.get("device") == device}
    for index, (model, seed) in enumerate(plan):
        if (model.key, seed) in done:
            print(f"[{index + 1}/{len(plan)}] {model.key} seed {seed}: already done")
            continue
        elapsed = time.perf_counter() - started
        cost = described[model.key]["flops_per_token"] * tokens
        estimate = estimated_run_seconds(model.key, cost, last_seconds, seconds_per_flop, args.deadline_margin)
        if args.deadline_minutes and estimate is not None and elapsed + estimate > 60 * args.deadline_minutes:
            state["skipped"].append(f"{model.key}/seed{seed}")
            print(f"[{index + 1}/{len(plan)}] {model.key} seed {seed}: skipped (would end at about "
                  f"{(elapsed + estimate) / 60:.1f} min, deadline {args.deadline_minutes} min)")
            continue
        result = train_one(model, seed, shape, tokens, args, data_dir, work, log_handle)
        seconds_per_flop.append(result["wall_seconds"] / cost)
        last_seconds[model.key] = result["wall_seconds"]
        state["runs"].append(result)
        state["elapsed_seconds"] = time.perf_counter() - started
        wiki = f", Wikipedia {result['wiki_loss']:.3f}" if "wiki_loss" in result else ""
        print(f"[{index + 1}/{len(plan)}] {model.key} seed {seed}: held-out loss {result['heldout_loss']:.3f}{wiki}; "
              f"{result['tokens']:,} tokens, train {result['train_seconds']:.1f} s "
              f"({rate_of(result['tokens_per_second'])} tokens/s), run {result['wall_seconds']:.1f} s, "
              f"peak {fmt(result['peak_memory_gib'], 2)} GiB; elapsed {state['elapsed_seconds']:.0f} s", flush=True)
        write_outputs(state, out)
    state["elapsed_seconds"] = time.perf_counter() - started
    write_outputs(state, out)
    print(f"done in {state['elapsed_seconds']:.0f} s: {out}/results.md, results.json, loss_curves.png, configs.json, log.txt")
    return state


if __name__ == "__main__":
    from hf_memffn.cli import interruption_exit, sigterm_raises_terminated

    try:
        with sigterm_raises_terminated():  # (a scheduler's SIGTERM, too, removes the work folder on its way out)
            main()
    except KeyboardInterrupt as stop:
        raise interruption_exit("study.py", stop, "; --resume continues the study from its last finished run") \
            from None
