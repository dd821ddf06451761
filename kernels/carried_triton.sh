#!/usr/bin/env bash
# Another Triton on the GPU machine, whose image has Triton 3.6 and no package index: the wheel packed small enough
# to travel with the working tree (64 MiB a call, about 20 of them the repository), in two parts over two calls.
#
#   bash kernels/carried_triton.sh pack WHEEL DIR      # here: DIR/part1 holds libtriton.so.xz, DIR/part2 the rest
#   bash kernels/carried_triton.sh stage PART1         # on the GPU machine, first call: keeps part 1 under /tmp
#   bash kernels/carried_triton.sh unpack PART2 SITE   # on the GPU machine, next call (machine still warm)
#   PYTHONPATH=SITE:$PWD python ...                    # runs with that Triton
#
# The pack leaves out what compiling and launching a kernel for an NVIDIA GPU does not use (the profiler and its CUPTI
# libraries, the AMD code generator that Triton 3.9 loads only to compile for AMD, FileCheck, the test plugins) and
# strips libtriton.so of its debug information and local symbols (`strip --strip-unneeded`). It keeps both ptxas the
# wheel brings (Triton 3.9 compiles for Hopper with the one it names `ptxas-blackwell`), so the kernels are compiled
# as users of that Triton get them; cuobjdump and nvdisasm, which `kernels/compile_check.py` and the ptxas report
# read cubins with; and the AMD backend's Python: Triton imports every backend an installed Triton's entry points
# name. The wheel must match the GPU machine's Python (cp312 there). Measured with it: notes v40.
set -euo pipefail

stage_dir=${CARRIED_TRITON_STAGE:-/tmp/carried-triton-part1}  # where `stage` keeps part 1 until `unpack`

case "${1:-}" in
pack)
    wheel=${2:?wheel}
    out=${3:?output dir}
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m zipfile -e "$wheel" "$work/site"
    rm -rf "$work/site/triton/backends/nvidia/lib/cupti" "$work/site/triton/backends/nvidia/lib/cupti-blackwell" \
        "$work/site/triton/backends/amd/lib/libtriton_amd_codegen.so" "$work/site/triton/instrumentation" \
        "$work/site/triton/_C/libproton.so" "$work/site/triton/profiler" "$work/site/triton/plugins" \
        "$work/site/triton/FileCheck"
    strip --strip-unneeded "$work/site/triton/_C/libtriton.so"
    mkdir -p "$out/part1.tmp" "$out/part2.tmp"
    xz -9 -T2 -c "$work/site/triton/_C/libtriton.so" > "$out/part1.tmp/libtriton.so.xz"
    rm "$work/site/triton/_C/libtriton.so"
    tar -C "$work/site" -cf - . | xz -9 -T2 > "$out/part2.tmp/site.tar.xz"
    rm -rf "$out/part1" "$out/part2"
    mv "$out/part1.tmp" "$out/part1"
    mv "$out/part2.tmp" "$out/part2"
    du -b "$out"/part1/* "$out"/part2/*
    ;;
stage)
    part1=${2:?part 1 dir}
    mkdir -p "$stage_dir"
    cp "$part1/libtriton.so.xz" "$stage_dir/"
    ls -l "$stage_dir"
    ;;
unpack)
    part2=${2:?part 2 dir}
    site=${3:?site dir}
    if [ ! -f "$stage_dir/libtriton.so.xz" ]; then
        echo "no $stage_dir/libtriton.so.xz: run 'stage' first, on the same machine" >&2
        exit 2
    fi
    rm -rf "$site.tmp"
    mkdir -p "$site.tmp"
    python3 -c "import lzma, shutil, sys, tarfile
with lzma.open(sys.argv[1]) as packed, open(sys.argv[3] + '/lib.tmp', 'wb') as lib:
    shutil.copyfileobj(packed, lib)
tarfile.open(sys.argv[2]).extractall(sys.argv[3] + '/site', filter='data')" \
        "$stage_dir/libtriton.so.xz" "$part2/site.tar.xz" "$site.tmp"
    mv "$site.tmp/lib.tmp" "$site.tmp/site/triton/_C/libtriton.so"
    chmod +x "$site.tmp/site/triton/_C/libtriton.so" "$site.tmp/site/triton/backends/nvidia/bin/"*  # zip keeps no modes
    rm -rf "$site"
    mv "$site.tmp/site" "$site"
    rm -rf "$site.tmp"
    PYTHONPATH="$site" python3 -c "import triton; print('Triton', triton.__version__, 'from', triton.__file__)"
    ;;
*)
    echo "usage: $0 pack WHEEL DIR | stage PART1 | unpack PART2 SITE" >&2
    exit 2
    ;;
esac
