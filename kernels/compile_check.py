"""Compile the fused FlashMHF layer's Triton kernels for a GPU architecture on a machine without a GPU.

    python kernels/compile_check.py                  # sm_90 (H100/H200), every case below; ~3 min on 2 CPU cores
    python kernels/compile_check.py --arch 80 --quick

Nothing is launched: each kernel of `hf_memffn/flash_mhf_layer_triton.py` is compiled ahead of time (Triton's
`triton.compile` with a `GPUTarget`, the ptxas that ships with Triton) for every dtype, head size, gate width and flag
combination below, with the block sizes the launchers pick. A lowering error, or a launch that would need more shared
memory than the target has, shows up here instead of in a GPU call. Prints one line per compilation (shared memory
in bytes, registers per thread and local memory per thread, which is where ptxas spills, read from the cubin with
the cuobjdump that ships with Triton) and exits 1 when any compilation fails or does not fit.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from hf_memffn import decoder_triton, ffn_triton  # noqa: E402
from hf_memffn import flash_mhf_layer_triton as layer  # noqa: E402
from hf_memffn.triton_launch import COMPILE_OPTIONS  # noqa: E402

# Shared memory one program may use (the opt-in maximum per block), by compute capability.
SHARED_MEMORY = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
ELEMENT_SIZE = {"bf16": 2, "fp16": 2, "fp32": 4}
# (head_dim, num_subnetworks): the presets' shapes, E=3 (not a power of two) and E=1 (no router needed)
SHAPES = [(128, 8), (64, 16), (256, 4), (128, 3), (64, 1)]
SUBNETWORK_SIZES = (64, 256)


def resource_usage(cubin: bytes) -> dict:
    """Registers and local memory (bytes per thread: spills) of a compiled kernel, from ``cuobjdump -res-usage``."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        listing = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True)
    found = re.search(r"REG:(\d+) .*LOCAL:(\d+)", listing.stdout)
    if listing.returncode or not found:
        raise RuntimeError("cuobjdump -res-usage gave no REG/LOCAL line: "
                           f"{listing.stdout[-300:]}{listing.stderr[-300:]}")
    return {"registers": int(found.group(1)), "local": int(found.group(2))}


def build(kernel, arch: int, pointers: dict, scalars: dict, constants: dict, num_warps: int = 4,
          num_stages: int | None = None, divisible_scalars: tuple = ()):
    """``kernel`` compiled for sm_<arch> (Triton's compiled kernel: its PTX, cubin and metadata); pointers map
    argument names to Triton types, scalars to example values (a float is fp32, anything else i32).

    Pointers are compiled as 16-byte aligned, as Triton specialises the launches of aligned tensors (all of ours at
    the presets' shapes): without that the loads are not vectorised, loops are not software-pipelined through shared
    memory, and the shared memory reported is far below what the GPU launch needs. The integers named in
    ``divisible_scalars`` are compiled as multiples of 16, as Triton specialises such a value at launch."""
    signature, attributes = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
            attributes[(index,)] = [["tt.divisibility", 16]]
        elif name in constants:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if isinstance(scalars[name], float) else "i32"
            if name in divisible_scalars:
                attributes[(index,)] = [["tt.divisibility", 16]]
    options = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **COMPILE_OPTIONS}
    return triton.compile(ASTSource(kernel, signature, constants, attributes), target=GPUTarget("cuda", arch, 32),
                          options=options)


def compile_kernel(kernel, arch: int, pointers: dict, scalars: dict, constants: dict, num_warps: int = 4,
                   num_stages: int | None = None) -> dict:
    """Shared memory (bytes), registers and local memory (bytes per thread) of ``kernel`` compiled for sm_<arch>
    (see `build`)."""
    compiled = build(kernel, arch, pointers, scalars, constants, num_warps, num_stages)
    return {"shared": compiled.metadata.shared, **resource_usage(compiled.asm["cubin"])}


def report_line(label: str, usage: dict, limit: int) -> bool:
    """Prints the kernel's line; False when it does not fit in shared memory."""
    fits = usage["shared"] <= limit
    print(f"{'ok  ' if fits else 'FAIL'} {label}: shared memory {usage['shared']} bytes"
          + ("" if fits else f" > {limit}") + f", {usage['registers']} registers, {usage['local']} bytes local",
          flush=True)
    return fits


def cases(quick: bool):
    dtypes = ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32")
    flags = [(True, True)] if quick else list(itertools.product((True, False), repeat=2))
    for dtype, (head_dim, num_subnetworks), (has_norm, has_router) in itertools.product(dtypes, SHAPES, flags):
        yield dtype, head_dim, num_subnetworks, has_norm, has_router


def check_decoder_kernels(arch: int, limit: int, quick: bool) -> int:
    """The decoder's RMSNorm and rotary kernels (`hf_memffn/decoder_triton.py`) at the presets' widths, and KV-FFN's
    activation kernels (`hf_memffn/ffn_triton.py`) for each activation and composition."""
    failures = 0
    scalars = dict(num_rows=1, num_cols=1, stride_x=1, stride_y=1, stride_dy=1, stride_dx=1, eps=1e-5,
                   rows_per_program=1, seq_len=1, stride_xb=1, stride_xl=1, stride_xh=1, stride_cb=1, stride_cl=1,
                   stride_yb=1, stride_yl=1, stride_yh=1, num_pairs=1, heads_first=1, stride_x2b=1, stride_x2l=1,
                   stride_x2h=1, stride_y2b=1, stride_y2l=1, stride_y2h=1)
    for dtype in ("bf16", "fp32") if quick else ("bf16", "fp16", "fp32"):
        element = "*" + dtype
        launches = []
        for width in (64, 1024, 2048, 5000):
            block_r, block_c = decoder_triton._norm_blocks(width)
            constants = dict(BLOCK_R=block_r, BLOCK_C=block_c)
            warps = decoder_triton._norm_warps(block_c)
            for store_rstd in (True, False):  # (training keeps 1 / rms for the backward; inference does not)
                launches.append((f"rms_norm_forward N={width} rstd={int(store_rstd)}",
                                 decoder_triton._rms_norm_forward_kernel,
                                 dict(X=element, W=element, Y=element, RSTD="*fp32" if store_rstd else element),
                                 dict(constants, STORE_RSTD=store_rstd), warps))
            launches.append((f"rms_norm_backward N={width}", decoder_triton._rms_norm_backward_kernel,
                             dict(DY=element, X=element, W=element, RSTD="*fp32", DX=element, DW_PARTS="*fp32"),
                             constants, warps))
        for head_dim in (64, 128, 96):
            for transposed in (False, True):
                half = head_dim // 2
                launches.append((f"rotary D={head_dim} transposed={int(transposed)}", decoder_triton._rotary_kernel,
                                 dict(X=element, Y=element, X2=element, Y2=element, COS=element, SIN=element),
                                 dict(HALF=half, HALF_P2=triton.next_power_of_2(half),
                                      BLOCK_L=decoder_triton.ROTARY_BLOCK_L, TRANSPOSED=transposed), 4))
        for activation, activation_id in ffn_triton.PAIRED_ACTIVATIONS.items():
            for product in (True, False):
                constants = dict(ACTIVATION=activation_id, PRODUCT=product, BLOCK=ffn_triton.PAIRED_BLOCK)
                composition = "product" if product else "sum"
                launches.append((f"kvffn {activation} {composition}", ffn_triton._paired_forward_kernel,
                                 dict(Y=element, H=element), constants, 4))
                launches.append((f"kvffn {activation} {composition} backward", ffn_triton._paired_backward_kernel,
                                 dict(Y=element, DH=element, DY=element), constants, 4))
        for name, kernel, pointers, constants, warps in launches:
            label = f"{name:34s} {dtype}"
            try:
                usage = compile_kernel(kernel, arch, pointers, scalars, constants, num_warps=warps)
            except Exception as exc:  # noqa: BLE001
                failures += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            failures += not report_line(label, usage, limit)
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, choices=sorted(SHARED_MEMORY), help="compute capability x10")
    parser.add_argument("--quick", action="store_true", help="bf16 and fp32 with norm and router only")
    args = parser.parse_args(argv)
    limit = SHARED_MEMORY[args.arch]
    print(f"triton {triton.__version__}, sm_{args.arch}, shared memory limit {limit} bytes")
    failures = 0
    for dtype, head_dim, num_subnetworks, has_norm, has_router in cases(args.quick):
        element = "*" + dtype
        gate_width = layer.e_dot(num_subnetworks)
        common_scalars = dict(eps=1e-6, gate_eps=1e-6, num_tokens=1, seq_len=1, num_heads=1,
                              num_subnetworks=num_subnetworks, stride_p=1, stride_q=1, stride_dq=1, stride_dp=1,
                              blocks_per_program=1, group_size=1, blocks_per_split=1, slots=1, num_splits=1,
                              num_elements=1)
        common_constants = dict(D_H=head_dim, E_DOT=gate_width, HAS_NORM=has_norm, HAS_ROUTER=has_router,
                                ROUTER_PRECISION="ieee" if dtype == "fp32" else "tf32")
        launches = [
            ("queries_and_gates", layer._queries_and_gates_kernel,
             dict(P=element, NORM_W=element, ROUTER=element, Q=element, R="*fp32", TOTALS="*fp32"),
             dict(common_constants, BLOCK_T=layer.GATES_LAUNCH["block_t"], WITH_TOTALS=has_router),
             {"num_warps": layer.GATES_LAUNCH["num_warps"]}),
            ("queries_and_gates_backward", layer._queries_and_gates_backward_kernel,
             dict(P=element, NORM_W=element, ROUTER=element, DQ=element, DR="*fp32", DP=element,
                  DNORM_PARTS="*fp32", DROUTER_PARTS="*fp32"),
             dict(common_constants, BLOCK_T=layer.GATES_BACKWARD_LAUNCH["block_t"],
                  ROUTER_GRAD_TRANSPOSED=layer.GATES_BACKWARD_LAUNCH["router_grad_transposed"]),
             {"num_warps": layer.GATES_BACKWARD_LAUNCH["num_warps"],
              "num_stages": layer.GATES_BACKWARD_LAUNCH["num_stages"]}),
        ]
        if has_norm or has_router:
            launches.append((
                "gate_gradient_sums", layer._gate_gradient_sums_kernel,
                dict(NORM_PARTS="*fp32", ROUTER_PARTS="*fp32", DNORM=element, DROUTER=element),
                dict(D_H=head_dim, E_DOT=gate_width, BLOCK_C=layer.GATE_SUMS_BLOCK_C, BLOCK_S=layer.GATE_SUMS_BLOCK_S,
                     NORM_BLOCK_S=layer.GATE_SUMS_NORM_BLOCK_S, NORM_BLOCK_D=layer.GATE_SUMS_NORM_BLOCK_D,
                     HAS_NORM=has_norm, HAS_ROUTER=has_router),
                {"num_warps": 8},
            ))
        sixteen_bit = ELEMENT_SIZE[dtype] == 2
        for subnetwork_size in SUBNETWORK_SIZES:
            block_n = layer.decode_block_n(subnetwork_size, head_dim, ELEMENT_SIZE[dtype])
            launches.append((
                f"decode d_e={subnetwork_size}", layer._decode_kernel,
                dict(P=element, NORM_W=element, ROUTER=element, K=element, U=element, V=element, OUT="*fp32"),
                dict(common_constants, D_E=subnetwork_size, BLOCK_T=layer.DECODE_BLOCK_T, BLOCK_N=block_n,
                     FAST_SIGMOID=sixteen_bit, PRECISION="tf32" if sixteen_bit else "ieee",
                     WEIGHTS_FIRST=layer.DECODE_LAUNCH["weights_first"]),
                {"num_warps": layer.DECODE_LAUNCH["num_warps"], "num_stages": layer.DECODE_LAUNCH["num_stages"]},
            ))
        launches.append(("decode split sum", layer._split_sum_kernel, dict(PARTS="*fp32", OUT=element),
                         dict(BLOCK_S=layer.DECODE_SUM_BLOCK_S, BLOCK=layer.DECODE_SUM_BLOCK), {"num_warps": 4}))
        for name, kernel, pointers, constants, options in launches:  # options: the launcher's warps and stages
            label = (f"{name:28s} {dtype} d_h={head_dim} E={num_subnetworks} norm={int(has_norm)} "
                     f"router={int(has_router)}")
            try:
                usage = compile_kernel(kernel, args.arch, pointers, common_scalars, constants, **options)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, then the exit status says so
                failures += 1
                print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                continue
            failures += not report_line(label, usage, limit)
    failures += check_decoder_kernels(args.arch, limit, args.quick)
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
