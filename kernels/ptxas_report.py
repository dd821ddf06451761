"""Registers, spills and serialised products of the Gluon kernels under several ptxas, on a machine without a GPU.

    python kernels/ptxas_report.py --out DIR                               # this checkout's kernels, Triton's ptxas
    python kernels/ptxas_report.py --out DIR --stem NAME --ptxas "PATH_A" "PATH_B --regAllocOptLevel=2" \\
        --kernels weights rows OLD:weights_overlapped "OLD:weights_ws:WEIGHTS_WS_BUFFERS=2"

Each kernel is compiled for sm_90 by the Triton that runs this script (``compile_for_hopper`` of the package's
``flash_mhf_gluon.py``, which needs no GPU), and its PTX is then assembled by every ptxas named, each with its flags,
as Triton would (``-lineinfo -v --gpu-name=sm_90a``). ptxas's report gives the registers per thread, the bytes spilled
to local memory, and whether it serialised the kernel's wgmma products (it does, and says so, when other code may
touch the registers of an unfinished product); the SASS (Triton's ``nvdisasm``) says how many of the spill
instructions sit in the loops that issue the products, where they cost every iteration. The PTX's ``.version`` line
is set to what each ptxas accepts, as Triton sets it for its own.

Which ptxas runs depends on the Triton version: Triton 3.6 assembles sm_90 kernels with the ptxas of CUDA 12.8 it
ships, 3.7 with the same and ``--regAllocOptLevel=2``, 3.8 with CUDA 12.9's and the option, 3.9 with the one of CUDA
13 (its ``ptxas-blackwell``) and the option; another one when
``TRITON_PTXAS_PATH`` (3.6) or ``TRITON_PTXAS_BLACKWELL_PATH`` (3.9) names it. Run under each Triton, the report
separates what its lowering does from what the ptxas does (``kernels/flash_mhf_notes.md``, v29).

A kernel is ``[PACKAGE:]NAME[:SETTING=VALUE,...]``: ``PACKAGE`` a folder holding ``hf_memffn/flash_mhf_gluon.py``
(another commit's, from ``git archive COMMIT hf_memffn | tar -x -C PACKAGE``; default this checkout), ``NAME`` one of
the kernels its ``compile_for_hopper`` knows (this checkout: weights, add_weight_splits, rows, forward,
add_forward_splits, and ``rows_fused_gates``, the dq/dr kernel with the fused layer's norm/gate backward), and the
settings module-level constants of that file set before compiling (e.g. a schedule's stages). Writes
``DIR/<stem>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import inspect
import os
import re
import shlex
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE]

import torch  # noqa: E402
import triton  # noqa: E402

from harness import log, markdown_table, output_folder, write_report  # noqa: E402

CHECKOUT = os.path.join(HERE, "..")
DEFAULT_KERNELS = ["weights", "rows", "rows_fused_gates", "forward"]


def tritons_ptxas() -> str:
    """The ptxas this Triton assembles sm_90 kernels with (``TRITON_PTXAS_PATH`` and the like included)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(90).path


def tritons_ptxas_flags() -> list[str]:
    """The options this Triton adds when it assembles a kernel (3.9: ``--regAllocOptLevel=2``; 3.6: none)."""
    from triton.backends.nvidia.compiler import CUDABackend

    return re.findall(r"'(--regAllocOptLevel=\d+)'", inspect.getsource(CUDABackend.make_cubin))


def tritons_nvdisasm() -> str:
    """The nvdisasm shipped with this Triton (it reads the cubins its ptxas writes)."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")


def ptxas_release(path: str) -> str:
    """``12.8`` for the ptxas of CUDA 12.8."""
    text = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release (\d+\.\d+)", text)
    if not found:
        raise RuntimeError(f"--ptxas {path}: no 'release X.Y' in its --version output")
    return found.group(1)


def ptx_isa_version(release: str) -> str:
    """The newest PTX ISA that the ptxas of CUDA ``release`` assembles, as Triton picks it (``8.7`` for 12.8)."""
    from triton.backends.nvidia.compiler import ptx_get_version

    isa = ptx_get_version(release)
    return f"{isa // 10}.{isa % 10}"


def parse_kernel(spec: str) -> dict:
    """``[PACKAGE:]NAME[:SETTING=VALUE,...]`` -> {package, name, settings, label}."""
    parts = spec.split(":")
    package, settings = CHECKOUT, {}
    if len(parts) >= 2 and os.path.isdir(parts[0]):
        package, parts = parts[0], parts[1:]
    if len(parts) == 2:
        for item in parts[1].split(","):
            key, _, value = item.partition("=")
            if not key or not value:
                raise SystemExit(f"--kernels {spec!r}: settings are NAME=VALUE, comma-separated")
            settings[key] = ast.literal_eval(value)
    elif len(parts) != 1:
        raise SystemExit(f"--kernels {spec!r}: expected [PACKAGE:]NAME[:SETTING=VALUE,...]")
    name = parts[0]
    where = "" if os.path.samefile(package, CHECKOUT) else os.path.basename(os.path.normpath(package)) + ":"
    label = where + name + "".join(f" {k}={v}" for k, v in settings.items())
    return {"package": package, "name": name, "settings": settings, "label": label}


def load_gluon_module(package: str, settings: dict):
    """A fresh copy of ``PACKAGE/hf_memffn/flash_mhf_gluon.py`` with settings, as a module of the ``hf_memffn``
    package: it imports torch, triton and (the current file) the compile options of ``hf_memffn.triton_launch``,
    which resolves to this checkout's."""
    path = os.path.join(package, "hf_memffn", "flash_mhf_gluon.py")
    if not os.path.exists(path):
        raise SystemExit(f"no {path}")
    spec = importlib.util.spec_from_file_location(f"hf_memffn.flash_mhf_gluon_{abs(hash((path, str(settings))))}",
                                                  path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # Gluon resolves the kernels' globals through their module
    spec.loader.exec_module(module)
    if not module.GLUON_AVAILABLE:
        raise SystemExit(f"this Triton ({triton.__version__}) lacks the Gluon API of {path}: "
                         f"{module.GLUON_IMPORT_ERROR}")
    for key, value in settings.items():
        if not hasattr(module, key):
            raise SystemExit(f"--kernels: {path} has no setting {key}")
        setattr(module, key, value)
    return module


def compile_ptx(kernel: dict) -> tuple[str, dict]:
    module = load_gluon_module(kernel["package"], kernel["settings"])
    name, options = kernel["name"], {}
    if name == "rows_fused_gates":
        name, options = "rows", {"fused_gates": True}
    if options and "fused_gates" not in inspect.signature(module.compile_for_hopper).parameters:
        raise SystemExit(f"--kernels {kernel['label']}: this package's compile_for_hopper has no fused gates")
    report = module.compile_for_hopper(name, torch.bfloat16, subnetwork_size=384, **options)
    ptx = report["compiled"].asm["ptx"]
    return ptx, {"shared_memory": report["shared_memory"], "wgmma_in_ptx": report["wgmma"]}


def hot_loop_spills(sass: str) -> dict:
    """Spill instructions (``STL``/``LDL``) of a kernel's SASS, counted inside and outside its hot loops: the loops
    (backward branches) that issue tensor-core products (``HGMMA``) and neither hold a smaller such loop nor straddle
    a shorter one. A value spilled before a loop and reloaded after it costs a few instructions per program; one
    spilled inside costs every iteration."""
    address_of, label, instructions = {}, None, []
    for line in sass.splitlines():
        found = re.match(r"\s*\.(L_x_\d+):", line)
        if found:
            label = found.group(1)
            continue
        at = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if at:
            address = int(at.group(1), 16)
            if label is not None:
                address_of[label], label = address, None
            instructions.append((address, at.group(2)))
    loops = []
    for address, text in instructions:
        target = re.search(r"BRA.*`\(\.(L_x_\d+)\)", text)
        if target and target.group(1) in address_of and address_of[target.group(1)] < address:
            loops.append((address_of[target.group(1)], address))

    def products(loop):
        return sum(1 for address, text in instructions if loop[0] <= address <= loop[1] and "HGMMA" in text)

    with_products = [loop for loop in loops if products(loop)]

    def encloses(loop, other):  # holds the other loop's code, or overlaps a shorter one without nesting
        if loop[0] <= other[0] and other[1] <= loop[1]:
            return True
        straddles = loop[0] < other[0] <= loop[1] < other[1] or other[0] < loop[0] <= other[1] < loop[1]
        return straddles and other[1] - other[0] < loop[1] - loop[0]

    # (a backward branch that straddles a shorter product loop is how the partitions of a warp-specialised kernel
    # are laid out, not a loop of its own)
    hot = [loop for loop in with_products
           if not any(other != loop and encloses(loop, other) for other in with_products)]
    spills = [address for address, text in instructions if re.match(r"(@\S+\s+)?(STL|LDL)\b", text)]
    inside = sum(1 for address in spills if any(start <= address <= end for start, end in hot))
    return {"hot_loops": len(hot), "spill_instructions_in_hot_loops": inside,
            "spill_instructions_elsewhere": len(spills) - inside}


def assemble(ptx: str, ptxas: str, flags: list[str], release: str) -> dict:
    """ptxas's -v report of ``ptx`` for sm_90a: registers, spills, whether it serialised the wgmma products; and where
    the spill instructions are (``hot_loop_spills``, from the SASS that Triton's nvdisasm prints)."""
    ptx = re.sub(r"^\.version \d+\.\d+", f".version {ptx_isa_version(release)}", ptx, count=1, flags=re.MULTILINE)
    with tempfile.TemporaryDirectory() as folder:
        source, cubin = os.path.join(folder, "kernel.ptx"), os.path.join(folder, "kernel.cubin")
        with open(source, "w") as handle:
            handle.write(ptx)
        result = subprocess.run([ptxas, "-lineinfo", "-v", *flags, "--gpu-name=sm_90a", source, "-o", cubin],
                                capture_output=True, text=True)
        listing = None
        if result.returncode == 0:
            listing = subprocess.run([tritons_nvdisasm(), "-c", cubin], capture_output=True, text=True)
    text = result.stdout + result.stderr
    if result.returncode != 0:
        return {"error": text.strip()[-500:]}
    if listing.returncode == 0:
        where = hot_loop_spills(listing.stdout)
    else:  # said in the report, not left out silently
        where = {"hot_loops": None, "sass_error": listing.stderr.strip()[-300:]}
    registers = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": max(map(int, registers)) if registers else None,
            "spill_store_bytes": sum(int(s) for s, _ in spills), "spill_load_bytes": sum(int(l) for _, l in spills),
            "wgmma_serialised": "serialized" in text, **where,
            "warnings": [line.strip() for line in text.splitlines() if "warning" in line][:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=output_folder, required=True)
    parser.add_argument("--stem", default="ptxas_report")
    parser.add_argument("--ptxas", nargs="*",
                        help="'PATH [FLAGS]' per ptxas (default: the one Triton uses, with the options it adds)")
    parser.add_argument("--kernels", nargs="*", default=DEFAULT_KERNELS)
    args = parser.parse_args()

    assemblers = []
    for item in args.ptxas or [shlex.join([tritons_ptxas(), *tritons_ptxas_flags()])]:
        path, *flags = shlex.split(item)
        if not os.access(path, os.X_OK):
            raise SystemExit(f"--ptxas {item!r}: {path} is not an executable")
        release = ptxas_release(path)
        assemblers.append({"path": path, "flags": flags, "release": release,
                           "label": " ".join([f"ptxas {release}", *flags])})
    kernels = [parse_kernel(spec) for spec in args.kernels]
    own = " ".join([f"ptxas {ptxas_release(tritons_ptxas())}", *tritons_ptxas_flags()])
    results = {"triton": triton.__version__, "torch": torch.__version__, "tritons_own_ptxas": own,
               "target": "sm_90a (compiled on the CPU, nothing launched)",
               "ptxas": [{k: a[k] for k in ("label", "release", "flags")} for a in assemblers], "kernels": []}
    for kernel in kernels:
        ptx, compiled = compile_ptx(kernel)
        row = {"kernel": kernel["label"], **compiled, "by_ptxas": {}}
        for assembler in assemblers:
            row["by_ptxas"][assembler["label"]] = assemble(ptx, assembler["path"], assembler["flags"],
                                                           assembler["release"])
            log(kernel["label"], "|", assembler["label"], "|", row["by_ptxas"][assembler["label"]])
        results["kernels"].append(row)

    def cell(report: dict) -> str:
        if "error" in report:
            return "fails"
        text = f"{report['registers']} regs, {report['spill_store_bytes']}/{report['spill_load_bytes']} B spilled"
        if "sass_error" in report:
            text += " (no SASS: nvdisasm failed)"
        elif report["hot_loops"] and report["spill_store_bytes"] + report["spill_load_bytes"]:
            text += (f" ({report['spill_instructions_in_hot_loops']} of "
                     f"{report['spill_instructions_in_hot_loops'] + report['spill_instructions_elsewhere']} "
                     "spill instructions in the product loops)")
        return text + (", wgmma serialised" if report["wgmma_serialised"] else "")

    header = ["kernel", "shared memory", *[a["label"] for a in assemblers]]
    rows = [[r["kernel"], r["shared_memory"], *[cell(r["by_ptxas"][a["label"]]) for a in assemblers]]
            for r in results["kernels"]]
    text = "\n".join([f"# Gluon kernels' PTX from Triton {triton.__version__}, assembled for sm_90a on the CPU", "",
                      f"Triton {triton.__version__} itself assembles with {own}. Spilled: bytes of spill stores / "
                      "loads per thread, as ptxas -v reports them.", "",
                      *markdown_table(header, rows)]) + "\n"
    write_report(args.out, args.stem, results, text)


if __name__ == "__main__":
    main()
