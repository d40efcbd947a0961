python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
# GPU check of the Megatron learner backend, for one H200 (Python 3.12, torch with CUDA already
# there, no network). Run from the repository root with megatron-core's wheel in .whl/:
#   mkdir -p .whl && pip download megatron-core==0.16.1 --no-deps --only-binary=:all: \
#       --python-version 3.12 --platform manylinux_2_28_x86_64 -d .whl
#   (optional, for the glm4_moe part: transformers' wheel beside it, e.g.
#    pip download transformers==5.25.0 --no-deps --only-binary=:all: -d .whl, plus its own missing dependencies)
#   pip download flash-linear-attention --no-deps -d .whl   # qwen3_5_moe's GatedDeltaNet kernels (triton)
#   bash tools/gpu_megatron_check.sh
# Prints one JSON line per part and writes them all to $OUT/gpu_megatron_check.json (+ .log);
# about 2-3 minutes, bounded at 270 s. What it runs: tools/gpu_megatron_check.py's docstring.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/gpu_megatron_check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 270 python3 tools/gpu_megatron_check.py --out "$OUT/gpu_megatron_check.json" 2>&1 | tee "$OUT/gpu_megatron_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_megatron_check: exit $rc, results in $OUT/gpu_megatron_check.json"
exit "$rc"
