"""The inference builds of the package's kernels, with and without Triton's specialisation of their size arguments.

    PYTHONPATH=. python kernels/compare_specialisation.py --out DIR [--rounds 5]
    PYTHONPATH=. python kernels/compare_specialisation.py --out DIR --compile-only   # also without a GPU

Triton compiles a kernel again for each new combination of its integer arguments being 1, a multiple of 16, or
neither. Inference launches builds of our kernels whose arguments that follow the number of tokens (rows, sequence
length, how the programs split the work) are left unspecialised (`triton_launch.any_size`, or ``do_not_specialize``
on the kernels that only inference runs): a decoding step, a prompt or a continuous-batching step of a new size
then compiles nothing once one call has run. Training launches the kernels as they are (its shapes are fixed).

The "specialised" set is the inference builds rebuilt without ``do_not_specialize``, swapped in for the package's in
their modules. Two parts:

- compilations: a decoding step's kernels (the decoder's RMSNorm and rotary kernels, the layer's decode kernel) at a
  sequence of token counts, the layer's inference forward of longer batches, and its training forward and backward
  at a few sequence lengths, from a cold in-memory cache: the kernels each set compiles (or loads from Triton's disk
  cache), counted with Triton's JIT hooks, the configurations the autotuned forward benchmarks (once per size
  class: 2048 and 3000 tokens are two classes, 2500 the second again), and the kernels launched for the first time
  (each first launch loads the kernel and builds its launcher: a prompt in the middle of serving should meet none);
- timing (on a GPU): the inference builds at the 370M and 1.3B presets' shapes, each case with both sets in turn over
  ``--rounds`` rounds (``harness.bench_ms``): decoding at 1 and 16 tokens (`compare_triton_builds.py`'s cases), the
  layer's forward of a training step's tokens without gradients (a prompt), and the decoder's RMSNorm and rotary
  kernels at a prompt's and a decoding step's shapes; the outputs of the two sets are compared (equal to the bit,
  or their relative error).

Writes <out>/specialisation.{json,md}. ``--compile-only`` counts the compilations and times nothing; on a machine
without a GPU it compiles for an H100 on CPU tensors, under `compare_triton_builds.py`'s stand-in for Triton's CUDA
driver (shorter sequences; the tests run it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import torch  # noqa: E402
import triton  # noqa: E402

from harness import (  # noqa: E402
    TritonCompilations, bench_ms, environment, log, markdown_table, median, output_folder, refuse_counts_below, rel_err,
    write_report,
)

from compare_triton_builds import (  # noqa: E402
    CASES, Case, compiling_for_hopper, forget_compiled, jit_functions, layer_inputs,
)

from hf_memffn import (  # noqa: E402
    decoder_triton, flash_mhf_gluon, flash_mhf_layer_triton, flash_mhf_op, flash_mhf_triton,
)

KERNEL_MODULES = [decoder_triton, flash_mhf_gluon, flash_mhf_layer_triton, flash_mhf_triton]
SETS = ("specialised", "package")
EPS, GATE_EPS, HEAD_DIM = 1e-5, 1e-6, 128
# the inference forward of a training step's tokens (a prompt), and the decoder's kernels at the 370M preset's shapes
# (hidden 1024, 8 query and 8 key heads of 128): a prompt of 8 x 2048 tokens and a decoding step of 16
INFERENCE_CASES = [f"prefill:{preset}" for preset in ("370M", "1.3B")]
INFERENCE_CASES += [f"{kind}:{tokens}" for kind in ("rms_norm", "rotary") for tokens in ("prefill", "decode")]


def package_kernels() -> dict:
    """{(module, name): kernel} of the package's kernels that leave some argument unspecialised."""
    return {(module, name): value for module in KERNEL_MODULES for name, value in vars(module).items()
            if isinstance(value, triton.runtime.jit.JITFunction)
            and any(param.do_not_specialize for param in value.params)}


def unspecialised_arguments(kernel) -> list[str]:
    return [param.name for param in kernel.params if param.do_not_specialize]


def specialising_twin(kernel):
    """The same function as a kernel that Triton specialises on every argument."""
    return type(kernel)(kernel.fn, debug=kernel.debug, noinline=kernel.noinline)


@contextlib.contextmanager
def kernel_set(name: str, twins: dict):
    """Within the block the modules launch ``name``'s kernels: "package" (as they are) or "specialised" (the twins)."""
    if name == "package":
        yield
        return
    swapped = list(package_kernels().items())
    for (module, attribute), kernel in swapped:
        setattr(module, attribute, twins[kernel])
    try:
        yield
    finally:
        for (module, attribute), kernel in swapped:
            setattr(module, attribute, kernel)


# --- the cases ----------------------------------------------------------------------------------------------------

def layer_weights(device, heads=8, num_subnetworks=7, subnetwork_size=384, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=torch.bfloat16)

    return (1 + randn(HEAD_DIM, scale=0.2), randn(heads, HEAD_DIM, num_subnetworks, scale=HEAD_DIM**-0.5),
            randn(3 * heads, num_subnetworks, subnetwork_size, HEAD_DIM, scale=HEAD_DIM**-0.5), randn)


def compilation_sequence(device, decode_tokens, forward_tokens, train_lengths, names: dict, heads=8):
    """The calls in order (a decoding step's kernels at each of ``decode_tokens`` tokens: the decoder's RMSNorm and
    rotary kernels and the layer's; the layer's inference forward of one sequence of each of ``forward_tokens``; its
    training forward + backward of two sequences of each of ``train_lengths``): ({call: kernels it compiled},
    {call: configurations an autotuner benchmarked}, {call: kernels it launched for the first time})."""
    norm, router, weights, randn = layer_weights(device, heads)
    compiled, tuned, loaded = {}, {}, {}
    for tokens in decode_tokens:
        width = heads * HEAD_DIM
        angles = randn(1, 1, HEAD_DIM).float()
        with TritonCompilations(names) as record:
            decoder_triton.rms_norm_forward(randn(tokens, 1, width), norm.repeat(heads), EPS, keep_rstd=False)
            with torch.no_grad():
                decoder_triton.rotate_pair(randn(tokens, 1, heads, HEAD_DIM), randn(tokens, 1, heads, HEAD_DIM),
                                           angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16))
            flash_mhf_op._layer_forward_impl(randn(tokens, 1, width), norm, router, weights, HEAD_DIM, EPS, GATE_EPS)
        compiled[f"decode {tokens}"], tuned[f"decode {tokens}"], loaded[f"decode {tokens}"] = _counts(record)
    for tokens in forward_tokens:
        with TritonCompilations(names) as record:
            flash_mhf_op._layer_forward_impl(randn(1, tokens, heads * HEAD_DIM), norm, router, weights, HEAD_DIM, EPS,
                                             GATE_EPS)
        compiled[f"forward {tokens}"], tuned[f"forward {tokens}"], loaded[f"forward {tokens}"] = _counts(record)
    for length in train_lengths:
        p = randn(2, length, heads * HEAD_DIM)
        with TritonCompilations(names) as record:
            saved = flash_mhf_op._layer_forward_keeping_queries(p, norm, router, weights, HEAD_DIM, EPS, GATE_EPS)
            flash_mhf_op._layer_backward_impl(randn(*p.shape), p, norm, router, weights, HEAD_DIM, EPS, GATE_EPS,
                                              saved=saved[1:])
        compiled[f"train 2 x {length}"], tuned[f"train 2 x {length}"], loaded[f"train 2 x {length}"] = _counts(record)
    return compiled, tuned, loaded


def _counts(record: TritonCompilations) -> tuple[dict, int, dict]:
    summary = record.summary()
    return summary["kernels"], summary["tuned"]["configs"], summary["loaded"]["kernels"]


class InferenceCase:
    """Without gradients: the FlashMHF layer's forward of a training step's tokens at a preset's shapes, or the
    decoder's RMSNorm or rotary kernel (queries and keys in one launch) at the 370M preset's."""

    def __init__(self, name: str, device):
        kind, size = name.split(":")
        self.kind = kind
        if kind == "prefill":
            self.p, self.norm, self.router, weights, _ = layer_inputs(size, device)
            self.weights = weights[0]
            return
        batch, length = (8, 2048) if size == "prefill" else (16, 1)
        generator = torch.Generator().manual_seed(0)

        def randn(*shape):
            return torch.randn(*shape, generator=generator).to(device=device, dtype=torch.bfloat16)

        if kind == "rms_norm":
            self.x, self.weight = randn(batch * length, 1024), 1 + randn(1024)
        else:
            self.q, self.k = randn(batch, length, 8, HEAD_DIM), randn(batch, length, 8, HEAD_DIM)
            angles = randn(1, length, HEAD_DIM).float()
            self.cos, self.sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)

    @torch.no_grad()
    def run(self):
        if self.kind == "prefill":
            return [flash_mhf_op._layer_forward_impl(self.p, self.norm, self.router, self.weights, HEAD_DIM, EPS,
                                                     GATE_EPS)]
        if self.kind == "rms_norm":
            return [decoder_triton.rms_norm(self.x, self.weight, EPS)]
        return list(decoder_triton.rotate_pair(self.q, self.k, self.cos, self.sin))

    timed = run


def build_case(name: str, device):
    return InferenceCase(name, device) if name in INFERENCE_CASES else Case(name, device)


def compare_outputs(first, second) -> dict:
    first = [t for t in first if t is not None]
    second = [t for t in second if t is not None]
    equal = all(torch.equal(a, b) for a, b in zip(first, second))
    return {"bit_equal": equal, "rel_err": 0.0 if equal else max(rel_err(a, b) for a, b in zip(first, second))}


def time_cases(names, rounds: int, twins: dict, device) -> list[dict]:
    rows = []
    for name in names:
        case = build_case(name, device)
        outputs = {}
        for set_name in SETS:
            with kernel_set(set_name, twins):
                outputs[set_name] = [t.clone() for t in case.run() if t is not None]
        times = {set_name: [] for set_name in SETS}
        for index in range(rounds):
            order = SETS if index % 2 == 0 else SETS[::-1]
            for set_name in order:
                with kernel_set(set_name, twins):
                    times[set_name].append(bench_ms(case.timed))
        ratios = [s / p for s, p in zip(times["specialised"], times["package"])]
        row = {"case": name, **{f"{s}_ms": median(times[s]) for s in SETS}, "rounds_ms": times,
               "speedup": median(ratios), "speedup_low": min(ratios), "speedup_high": max(ratios),
               **compare_outputs(outputs["specialised"], outputs["package"])}
        log(f"{name}: specialised {row['specialised_ms']:.4f} ms, package {row['package_ms']:.4f} ms, "
            f"x{row['speedup']:.3f} ({row['speedup_low']:.3f}-{row['speedup_high']:.3f}), bit-equal {row['bit_equal']}")
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def to_markdown(results: dict) -> str:
    env = results["environment"]
    lines = [f"# Size arguments specialised or not, {env['device']}", "",
             f"torch {env.get('torch')}, triton {env.get('triton')}; compiled for {results.get('compiled_for')}; "
             f"`{results['command']}`", "",
             "## Kernels left unspecialised", ""]
    lines += markdown_table(["kernel", "arguments not specialised"],
                            [[name, ", ".join(args)] for name, args in results["unspecialised"].items()])
    lines += ["", "## Kernels compiled by each call, from a cold in-memory cache", "",
              "A kernel's first launch loads it and builds its launcher (compiled from C source when Triton's disk "
              "cache lacks it); a kernel compiled ahead is loaded with its compilation, so no call should list one "
              "as first launched there but compiled earlier.", ""]
    calls = list(results["compilations"]["package"])
    def cell(set_name, call):
        text = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in results["compilations"][set_name][call].items())
        configs = results.get("tuned", {}).get(set_name, {}).get(call)
        late = [kernel for kernel in results.get("loaded", {}).get(set_name, {}).get(call, {})
                if kernel not in results["compilations"][set_name][call]]
        return (text or "-") + (f"; {configs} configurations tuned" if configs else "") + (
            f"; first launched here, compiled earlier: {', '.join(late)}" if late else "")

    lines += markdown_table(["call", *SETS], [[call, *[cell(s, call) for s in SETS]] for call in calls])
    totals = {s: sum(sum(c.values()) for c in results["compilations"][s].values()) for s in SETS}
    lines += ["", f"Compilations in all: specialised {totals['specialised']}, package {totals['package']} (an "
              "autotuner compiles each configuration as it benchmarks it).", ""]
    if results.get("timing"):
        lines += ["## Time (median over the rounds; x = specialised / package, above 1: the package's is faster)", ""]
        lines += markdown_table(["case", "specialised ms", "package ms", "x (lowest-highest)", "outputs"], [
            [r["case"], f"{r['specialised_ms']:.4f}", f"{r['package_ms']:.4f}",
             f"{r['speedup']:.3f} ({r['speedup_low']:.3f}-{r['speedup_high']:.3f})",
             "equal to the bit" if r["bit_equal"] else f"rel. err. {r['rel_err']:.1e}"] for r in results["timing"]])
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", nargs="+", default=None, help="timed cases (default: all)")
    parser.add_argument("--compile-only", action="store_true",
                        help="count the compilations, time nothing (without a GPU: compiled for an H100 on the CPU)")
    args = parser.parse_args(argv)
    refuse_counts_below(parser, args, rounds=1)
    known = [*[case for case in CASES if case.startswith("decode:")], *INFERENCE_CASES]
    cases = args.cases or known
    unknown = sorted(set(cases) - set(known))
    if unknown:
        parser.error(f"--cases {unknown}: expected some of {', '.join(known)}")
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.compile_only:
        raise SystemExit("timing needs a CUDA GPU (--compile-only counts the compilations without one)")
    device = torch.device("cuda" if on_gpu else "cpu")
    kernels = package_kernels()
    twins = {kernel: specialising_twin(kernel) for kernel in kernels.values()}
    results = {"environment": environment(), "command": "python kernels/compare_specialisation.py "
               + " ".join(sys.argv[1:] if argv is None else argv),
               "unspecialised": {name: unspecialised_arguments(k) for (_, name), k in kernels.items()},
               "compiled_for": "this GPU" if on_gpu else "an H100, on the CPU", "compilations": {}, "tuned": {},
               "loaded": {}}
    # without a GPU each compilation takes seconds on the CPU: fewer calls; the autotuner's benchmark is the stand-in
    # driver's (each configuration compiled and launched once)
    decode_tokens = [1, 2, 3, 16, 17, 33, 64] if on_gpu else [1, 2, 16]
    # 2048, 3000 and 2500 tokens of 8 heads: the autotuned Triton forward (2 ** 14 rows and more, too few row blocks
    # for the Gluon one) in two size classes, the second met twice; 4800: the Gluon forward's 25 row blocks of 192
    # per head, 200 programs, whose last round (68 of 132) is not split; 4096: 176 programs, a last round of 44 split
    forward_tokens = [100, 128, 1000, 2048, 3000, 2500, 4800, 4096, 4097] if on_gpu else [
        100, 128, 2048, 3000, 2500, 4800, 4096, 4097]
    train_lengths = [1000, 1024, 2048] if on_gpu else [496, 500]
    # a twin is named after the build it stands in for
    names = {**jit_functions(KERNEL_MODULES), **{twins[kernel]: name for (_, name), kernel in kernels.items()}}
    for set_name in SETS:
        with kernel_set(set_name, twins), (contextlib.nullcontext() if on_gpu else compiling_for_hopper()):
            forget_compiled(KERNEL_MODULES)  # the set's kernels, from a cold in-memory cache
            (results["compilations"][set_name], results["tuned"][set_name],
             results["loaded"][set_name]) = compilation_sequence(
                device, decode_tokens, forward_tokens, train_lengths, names)
        log(f"{set_name}: {results['compilations'][set_name]}")
    if not args.compile_only:
        results["timing"] = time_cases(cases, args.rounds, twins, device)
    write_report(args.out, "specialisation", results, to_markdown(results))
    print(to_markdown(results))
    return results


if __name__ == "__main__":
    main()
