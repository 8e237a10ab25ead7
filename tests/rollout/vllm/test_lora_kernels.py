"""spmd_rl/rollout/vllm/lora_kernels.py: the shipped LoRA kernel configs are taken where they were tuned
(this GPU, hidden size and rank), never over a folder the user set, and hold a tuned entry for every
kernel call vLLM's LoRA layers make at the shape they ship for (scripts/bench/tune_lora_kernels.py's
list of calls, in vLLM's key layout [max_loras][num_slices][m][k][n])."""

from __future__ import annotations

import json
import os
import sys

import pytest
import tomllib

from spmd_rl.rollout.vllm import lora_kernels as lk
from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

import tune_lora_kernels as tl  # noqa: E402

H200 = "NVIDIA H200"
QWEN7B = dict(hidden=3584, intermediate=18944, heads=28, kv_heads=4, head_dim=128)


def test_the_shipped_configs_are_taken_for_their_gpu_and_shape_only():
    env = {}
    assert "configs tuned for NVIDIA H200, hidden size 3584, rank 32" in lk.choose(H200, 3584, 32, 1, env)
    assert env == {lk.ENV: lk.FOLDER}
    for gpu, hidden, rank, tp in [("NVIDIA H100 80GB HBM3", 3584, 32, 1), (H200, 896, 32, 1), (H200, 3584, 64, 1),
                                  (H200, 3584, 32, 2)]:
        env = {}
        line = lk.choose(gpu, hidden, rank, tp, env)
        assert env == {} and line.startswith("LoRA kernels: vLLM's default configs") and "tune_lora_kernels.py" in line


def test_a_folder_the_user_set_wins():
    env = {lk.ENV: "/mine"}
    assert lk.choose(H200, 3584, 32, 1, env) == f"LoRA kernels: the configs in {lk.ENV}=/mine"
    assert env == {lk.ENV: "/mine"}


@pytest.mark.parametrize("gpu", ["NVIDIA H200"])
def test_every_kernel_call_of_the_shipped_shape_has_its_own_entry(gpu):
    files = tl.file_names(gpu)
    data = {op: json.load(open(os.path.join(lk.FOLDER, name))) for op, name in files.items()}
    for call in tl.kernel_calls(tl.lora_linears(**QWEN7B, tp=1), 32, tl.BATCHES):
        entry = data[call.op][str(tl.MAX_LORAS)][str(call.num_slices)][str(call.m)][str(call.k)][str(call.n)]
        assert {"block_m", "block_n", "block_k", "num_warps", "num_stages"} <= set(entry), call


def test_the_configs_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        data = tomllib.load(f)["tool"]["setuptools"]["package-data"]["spmd_rl.rollout.vllm"]
    assert data == ["lora_kernel_configs/*.json"]
    assert sorted(os.listdir(lk.FOLDER)) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json"]
