"""spmd_rl/rollout/vllm/lora_kernels.py: the shipped LoRA kernel configs are taken where they were tuned
(this GPU, and an entry of the model's own shape for each of its kernel calls), never over a folder the user
set, nor without LoRA; they hold, for every kernel call vLLM's LoRA layers make at the shape they ship for
(scripts/bench/tune_lora_kernels.py's list of calls), an entry that vLLM's lookup
(vllm/lora/ops/triton_ops/utils.py, get_lora_op_configs: [max_loras][num_slices][m][k][n], the nearest key
but for num_slices) finds with every key its kernels read; and they are package data."""

from __future__ import annotations

import glob
import json
import logging
import os
import sys

import pytest
import tomllib
import torch

from spmd_rl.rollout.vllm import lora_kernels as lk
from tests.helpers import ROOT
from tests.helpers.stand_in_vllm import stand_in_engine

sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

import tune_lora_kernels as tl  # noqa: E402

H200 = "NVIDIA H200"
QWEN7B_CONFIG = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=3584, intermediate_size=18944,
                     num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, vocab_size=152064)
QWEN1_5B_CONFIG = dict(QWEN7B_CONFIG, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                       num_key_value_heads=2)
GEMMA2_9B_CONFIG = dict(hidden_size=3584, intermediate_size=14336, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256)  # 7B's hidden size, other attention and MLP widths
QWEN2_57B_A14B_CONFIG = dict(QWEN7B_CONFIG, num_experts=64, moe_intermediate_size=2560)
READS = {"shrink": {"block_m", "block_n", "block_k", "split_k", "num_warps", "num_ctas", "num_stages"},
         "expand": {"block_m", "block_n", "block_k", "num_warps", "num_ctas", "num_stages"}}
"""The keys vLLM 0.26's lora_shrink_op / lora_expand_op read from a config (kernel_config[...])."""


def test_the_shipped_configs_are_taken_for_their_gpu_and_shape_only():
    env = {}
    assert "configs tuned for NVIDIA H200, hidden size 3584, rank 32" in lk.choose(H200, QWEN7B_CONFIG, 32, 1, env)
    assert env == {lk.ENV: lk.FOLDER}
    for gpu, config, rank, tp in [("NVIDIA H100 80GB HBM3", QWEN7B_CONFIG, 32, 1), (H200, QWEN1_5B_CONFIG, 32, 1),
                                  (H200, QWEN7B_CONFIG, 64, 1), (H200, QWEN7B_CONFIG, 32, 2),
                                  (H200, GEMMA2_9B_CONFIG, 32, 1), (H200, {}, 32, 1)]:
        env = {}
        line = lk.choose(gpu, config, rank, tp, env)
        assert env == {} and line.startswith("LoRA kernels: vLLM's default configs") and "tune_lora_kernels.py" in line
    env = {}  # with the folder set, vLLM's MoE LoRA layers would look their configs up there too
    assert "a mixture of experts" in lk.choose(H200, QWEN2_57B_A14B_CONFIG, 32, 1, env) and env == {}


def test_a_folder_the_user_set_wins():
    env = {lk.ENV: "/mine"}
    assert lk.choose(H200, QWEN7B_CONFIG, 32, 1, env) == f"LoRA kernels: the configs in {lk.ENV}=/mine"
    assert env == {lk.ENV: "/mine"}


def test_the_keys_checked_are_a_7b_layers_calls():
    """(num_slices, k, n), written out by hand: q/k/v, o, gate/up and down shrink their inputs to the rank;
    expand writes q/k/v's widest slice, o's and down's hidden (one call), gate/up's intermediate."""
    assert lk.kernel_keys(QWEN7B_CONFIG, 32) == {
        "shrink": {("3", "3584", "32"), ("1", "3584", "32"), ("2", "3584", "32"), ("1", "18944", "32")},
        "expand": {("3", "32", "3584"), ("1", "32", "3584"), ("2", "32", "18944")}}


def vllm_lookup(data: dict, max_loras: int, num_slices: int, m: int, k: int, n: int) -> dict:
    """get_lora_op_configs' walk through a file (vLLM 0.26)."""
    def nearest(d, x):
        return d.get(str(x)) or d[min(d.keys(), key=lambda key: abs(int(key) - x))]

    return nearest(nearest(nearest(nearest(data, max_loras)[str(num_slices)], m), k), n)


@pytest.mark.parametrize("gpu", ["NVIDIA H200"])
def test_every_kernel_call_of_the_shipped_shape_finds_its_own_entry(gpu):
    files = tl.file_names(gpu)
    data = {op: json.load(open(os.path.join(lk.FOLDER, name))) for op, name in files.items()}
    graph_sizes = [1, 2, 4] + list(range(8, 513, 8))  # vLLM's CUDA-graph batch sizes, and a prefill chunk
    for call in tl.kernel_calls(tl.lora_linears(QWEN7B_CONFIG, tp=1), 32, tl.BATCHES):
        entry = data[call.op][str(tl.MAX_LORAS)][str(call.num_slices)][str(call.m)][str(call.k)][str(call.n)]
        assert READS[call.op] <= set(entry), call
        assert vllm_lookup(data[call.op], tl.MAX_LORAS, call.num_slices, call.m, call.k, call.n) is entry
        for m in graph_sizes + [4096, 8192]:  # any token count lands on an entry of this call's own k and n
            found = vllm_lookup(data[call.op], tl.MAX_LORAS, call.num_slices, m, call.k, call.n)
            assert any(found is by_k[str(call.k)][str(call.n)]
                       for by_k in data[call.op][str(tl.MAX_LORAS)][str(call.num_slices)].values()), (call, m)


def test_the_configs_are_package_data():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert "spmd_rl.rollout.vllm" in setuptools["packages"]
    package = os.path.join(ROOT, "spmd_rl", "rollout", "vllm")
    declared = {os.path.relpath(p, package) for pattern in setuptools["package-data"]["spmd_rl.rollout.vllm"]
                for p in glob.glob(os.path.join(package, pattern))}
    shipped = {os.path.join("lora_kernel_configs", name) for name in os.listdir(lk.FOLDER)}
    assert shipped == {"lora_kernel_configs/NVIDIA_H200_EXPAND_TRUE.json", "lora_kernel_configs/NVIDIA_H200_SHRINK.json"}
    assert shipped <= declared


class _RecordingLLM:
    """Stands in for vllm.LLM: records VLLM_TUNED_CONFIG_FOLDER and enable_lora at construction."""
    seen: list = []

    def __init__(self, **kwargs):
        _RecordingLLM.seen.append((os.environ.get(lk.ENV), kwargs.get("enable_lora", False)))

    def sleep(self, level):
        pass


@pytest.mark.parametrize("lora, user, folder", [(True, None, lk.FOLDER), (True, "/mine", "/mine"), (False, None, None)])
def test_the_engine_points_vllm_at_them_before_it_is_built_with_lora(monkeypatch, tmp_path, caplog, lora, user, folder):
    monkeypatch.setenv(lk.ENV, user or "")  # recorded, so that what the engine sets is undone after the test
    if not user:
        monkeypatch.delenv(lk.ENV)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H200)
    overrides = ["rollout.tensor_parallel_size=1"]
    if lora:
        overrides += ["model.lora_rank=32", 'model.lora_sync="adapter"', 'model.lora_target_modules=["q_proj"]',
                      "rollout.lora_matmul=false"]  # vLLM's kernels (with the matmuls: test_lora_matmul.py)
    with caplog.at_level(logging.INFO), stand_in_engine(monkeypatch, tmp_path, _RecordingLLM,
                                                        type("SamplingParams", (), {}), overrides, QWEN7B_CONFIG):
        pass
    assert _RecordingLLM.seen[-1] == (folder, lora)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA kernels:")]
    assert len(said) == (1 if lora else 0)
