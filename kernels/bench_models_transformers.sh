#!/usr/bin/env bash
# The same whole-model tasks under the GPU image's own transformers and under a carried one, one after the other on
# one machine in one call, so that what a transformers release changes (in its Llama or in ours) shows beside what the
# machine does. Each run writes OUT/<transformers version>/models_bench.{json,md,png,log}.
#
#   bash kernels/carried_packages.sh pack PACKED transformers==5.25.0 ...     # here (see that script)
#   bash kernels/bench_models_transformers.sh PACKED OUT [bench_models.py options]    # on the GPU machine
#
# Hub kernels stay off under both (`USE_HUB_KERNELS=NO`): from transformers 5.25 on, a model loaded onto a GPU would
# fetch them, which a machine without a network cannot (notes v83).
set -euo pipefail

packed=${1:?packed dir}
out=${2:?output dir}
shift 2
site=$(mktemp -d)/site
bash "$(dirname "$0")/carried_packages.sh" install "$packed" "$site"
export USE_HUB_KERNELS=NO

for path in "$PWD" "$site:$PWD"; do
    version=$(PYTHONPATH=$path python3 -c "import transformers; print(transformers.__version__)")
    mkdir -p "$out/transformers-$version"
    PYTHONPATH=$path python3 -c "import torch, triton, transformers, huggingface_hub, hf_memffn; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'from', transformers.__file__, 'huggingface_hub', huggingface_hub.__version__)" | tee "$out/transformers-$version/models_bench.log"
    PYTHONPATH=$path python3 kernels/bench_models.py --out "$out/transformers-$version" "$@" 2>&1 \
        | tee -a "$out/transformers-$version/models_bench.log"
done
