#!/usr/bin/env bash
# The GPU check: the project's GPU tests over every GPU this machine has (scripts/gpu_check.py says
# what it checks and how it spreads the checks over the GPUs). Prints a PASS/FAIL table with the
# GPUs of every row and the training runs' per-step seconds, and writes OUT/gpu_check.txt (the
# table), OUT/pytest.log (the tests' output) and OUT/gpu_logs.tgz (the runs' logs).
#
#   bash scripts/gpu_check.sh OUT                    everything (about 22 minutes on one H200, 25 on two)
#   bash scripts/gpu_check.sh OUT --max-call-s 570   where one command may only run so long (570 s here):
#                                                    runs what fits, then prints the next command to run
#                                                    on the same machine (it has --continue)
#   bash scripts/gpu_check.sh OUT --only preset-0.5b,kernels    some checks (--plan lists them all)
#
# Needs vLLM (pip install -e '.[vllm]') and liger-kernel (the kernels check). On a machine without
# internet: wheels put in .whl/ are installed first, and a missing vLLM comes from the project's
# offline vLLM bundle when a copy of it is in the checkout.
# The mixture-of-experts checks (moe, moe-lora, moe-glm, preset-30b-a3b*) need vLLM's MoE kernels (the vllm
# extra has them; the offline bundle only when built with them, and then it comes in two pieces, installed
# one after the other: exit status 4 below).
# Exit status: 0 every check passed; 1 a check failed or did not run; 3 all passed so far and the
# next command is printed; 4 a piece of the vLLM bundle was staged (run again with the next piece).
set -uo pipefail
export GPU_CHECK_T0=${GPU_CHECK_T0:-$(date +%s)}  # the set-up below counts against --max-call-s
cd "$(dirname "$0")/.."
OUT=${1:?usage: bash scripts/gpu_check.sh OUT [options of scripts/gpu_check.py]}; shift
if compgen -G ".whl/*.whl" >/dev/null; then  # offline wheels (liger-kernel)
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-whl .whl/*.whl \
    && export PYTHONPATH=/tmp/site-whl${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("vllm") is None)'; then
  for bundle in .device-carry/vllm-*/install-vllm-bundle.sh; do  # where the offline vLLM bundle is copied
    [ -f "$bundle" ] || continue
    bash "$bundle" >/dev/null; rc=$?
    if [ "$rc" = 10 ]; then  # a bundle in pieces (with MoE kernels), staged one piece at a time
      echo "gpu_check: a piece of the vLLM bundle is staged on this machine; run again on it with the next piece in .device-carry/"
      exit 4
    fi
    [ "$rc" = 0 ] && . "${VLLM_SITE:-/tmp/site}/vllm-env.sh" && break
  done
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# random-weight models of the presets' shapes, built once per machine (in RAM: read by every run)
[ -d /dev/shm ] && export SPMD_RL_GPU_MODEL_ROOT=${SPMD_RL_GPU_MODEL_ROOT:-/dev/shm/gpu_check/models}
df -h /tmp /dev/shm | tail -2
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi: no GPU here"
python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
# (the version from the package's metadata: importing vLLM takes tens of seconds of the call)
python -c 'import importlib.metadata as m; print("vllm", m.version("vllm"))' 2>/dev/null \
  || python -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null || echo "vLLM is not installed: pip install -e '.[vllm]'"
python scripts/gpu_check.py --out "$OUT" "$@"
