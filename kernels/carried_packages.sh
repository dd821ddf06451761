#!/usr/bin/env bash
# Python packages that the GPU machine's image lacks (or has in another version), packed here to travel with the
# working tree (64 MiB a call, about 57 of them the repository) to a machine without a package index: each as a wheel
# for the image's Python (cp312, x86-64), the largest pure-Python ones as xz-compressed trees.
#
#   bash kernels/carried_packages.sh pack DIR NAME==VERSION ...   # here; none of their needs is fetched: name each
#                                                                 # (a wheel file named instead is taken as it is)
#   bash kernels/carried_packages.sh install DIR SITE             # there; then PYTHONPATH=SITE:$PWD python ...
#
# transformers 5.25 over the image's 5.17, as measured in notes v83 and v84:
#   bash kernels/carried_packages.sh pack .whl525 transformers==5.25.0 kernels==0.19.1 huggingface_hub==2.4.0 \
#       httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 tomlkit==0.15.3 click==8.5.1 idna==3.20
set -euo pipefail

# Pure-Python wheels above this size are carried as a tar.xz of their tree
compress_above_bytes=${CARRIED_COMPRESS_ABOVE_BYTES:-4000000}

case "${1:-}" in
pack)
    out=${2:?output dir}
    shift 2
    [ "$#" -gt 0 ] || { echo "pack: name at least one NAME==VERSION" >&2; exit 2; }
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    mkdir -p "$work/wheels"
    requirements=()
    for spec in "$@"; do
        if [ -f "$spec" ]; then cp "$spec" "$work/wheels/"; else requirements+=("$spec"); fi
    done
    if [ "${#requirements[@]}" -gt 0 ]; then
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$work/wheels" "${requirements[@]}"
    fi
    mkdir -p "$work/out"
    for wheel in "$work"/wheels/*.whl; do
        name=$(basename "$wheel")
        if [ "$(stat -c %s "$wheel")" -gt "$compress_above_bytes" ] && [[ "$name" == *-py3-none-any.whl ]]; then
            tree="$work/tree-${name%.whl}"
            python3 -m zipfile -e "$wheel" "$tree"
            tar -C "$tree" -cf - . | xz -9 -T2 > "$work/out/${name%-py3-none-any.whl}.tar.xz"
        else
            cp "$wheel" "$work/out/"
        fi
    done
    rm -rf "$out"
    mv "$work/out" "$out"
    du -b "$out"/*
    ;;
install)
    packed=${2:?packed dir}
    site=${3:?site dir}
    mkdir -p "$site"
    if compgen -G "$packed/*.whl" > /dev/null; then
        python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "$packed"/*.whl
    fi
    for tree in "$packed"/*.tar.xz; do
        [ -e "$tree" ] || continue
        python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter='data')" \
            "$tree" "$site"
    done
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
