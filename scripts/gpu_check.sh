#!/usr/bin/env bash
# The single-GPU path in one device call (scripts/gpu_check.py says what it checks); prints a
# PASS/FAIL table and the runs' per-step seconds, and writes them to OUT/gpu_check.txt.
#
#   device call, carrying .device-carry/vllm-1 and .whl (liger-kernel, for the fused-kernel test):
#   bash .device-carry/vllm-1/install-vllm-bundle.sh >/dev/null && . /tmp/site/vllm-env.sh && bash scripts/gpu_check.sh $OUT
#
# About 9 minutes on one H100 (machine start aside). Exit status 0 only if every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT [gpu_check.py options]}; shift
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (liger-kernel): beside the vLLM bundle's site
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-whl .whl/*.whl \
    && export PYTHONPATH=/tmp/site-whl${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/gpu_check/vllm_cache}   # one compile cache for every run
df -h /tmp | tail -1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c 'import torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
python scripts/gpu_check.py --out "$OUT" "$@"
rc=$?
tar czf "$OUT/gpu_logs.tgz" -C /tmp/gpu_check gpu_logs 2>/dev/null
exit $rc
