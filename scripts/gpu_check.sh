#!/usr/bin/env bash
# The GPU path in one or more device calls (scripts/gpu_check.py says what it checks and how it
# spreads the checks over the GPUs); prints a PASS/FAIL table with the GPUs of every row and the
# runs' per-step seconds, and writes it to OUT/gpu_check.txt plus OUT/gpu_logs.tgz.
#
#   device call, carrying .device-carry/vllm-1 (and .whl: liger-kernel, for test_fused_gpu's liger case):
#   bash .device-carry/vllm-1/install-vllm-bundle.sh >/dev/null && . /tmp/site/vllm-env.sh && bash scripts/gpu_check.sh $OUT [--only ...] [--continue]
#
# On 2xH200 the whole plan takes ~27 minutes: scripts/gpu_check.py's docstring gives the four calls.
# Exit status 0 only if every check that could run passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu_check.sh OUT [gpu_check.py options]}; shift
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (liger-kernel): beside the vLLM bundle's site
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-whl .whl/*.whl \
    && export PYTHONPATH=/tmp/site-whl${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# random-weight models of the presets' shapes, built once per machine (in RAM: read by every run)
[ -d /dev/shm ] && export SPMD_RL_GPU_MODEL_ROOT=${SPMD_RL_GPU_MODEL_ROOT:-/dev/shm/gpu_check/models}
df -h /tmp /dev/shm | tail -2
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python -c 'import torch, vllm, transformers; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
python scripts/gpu_check.py --out "$OUT" "$@"
rc=$?
tar czf "$OUT/gpu_logs.tgz" -C /tmp/gpu_check gpu_logs 2>/dev/null
exit $rc
