"""scripts/bench/tune_lora_kernels.py's CPU side: the kernel calls vLLM's LoRA layers make at a model's
shapes over tensor parallelism (written out by hand for Qwen2.5-7B), and the files in the layout vLLM's
get_lora_op_configs reads (vllm/lora/ops/triton_ops/utils.py: [max_loras][num_slices][m][k][n])."""

from __future__ import annotations

import os
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

import tune_lora_kernels as tl  # noqa: E402

QWEN7B = dict(hidden_size=3584, intermediate_size=18944, num_attention_heads=28, num_key_value_heads=4, head_dim=128)


def test_a_7b_layers_adapted_linears_on_one_and_two_ranks():
    one = tl.lora_linears(QWEN7B, tp=1)
    assert [(x.name, x.in_features, x.outs) for x in one] == [
        ("qkv", 3584, (3584, 512, 512)), ("o", 3584, (3584,)), ("gate_up", 3584, (18944, 18944)),
        ("down", 18944, (3584,))]
    two = tl.lora_linears(QWEN7B, tp=2)  # column-parallel: outputs split; row-parallel: inputs split
    assert [(x.name, x.in_features, x.outs) for x in two] == [
        ("qkv", 3584, (1792, 256, 256)), ("o", 1792, (3584,)), ("gate_up", 3584, (9472, 9472)),
        ("down", 9472, (3584,))]
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        tl.lora_linears(QWEN7B, tp=3)


def test_each_distinct_call_once_per_batch_with_its_lookup_key():
    calls = tl.kernel_calls(tl.lora_linears(QWEN7B, tp=1), 32, (256, 8192))
    at_256 = [c for c in calls if c.m == 256]
    # shrink: (slices, k = the input, n = rank); o and qkv shrink the same input width with other slices
    assert [(c.op, c.num_slices, c.k, c.n) for c in at_256 if c.op == "shrink"] == [
        ("shrink", 3, 3584, 32), ("shrink", 1, 3584, 32), ("shrink", 2, 3584, 32), ("shrink", 1, 18944, 32)]
    # expand: k = rank, n = the widest slice; o and down expand to the same width: one call
    assert [(c.op, c.num_slices, c.k, c.n, c.outs) for c in at_256 if c.op == "expand"] == [
        ("expand", 3, 32, 3584, (3584, 512, 512)), ("expand", 1, 32, 3584, (3584,)),
        ("expand", 2, 32, 18944, (18944, 18944))]
    assert len(calls) == 2 * len(at_256)


def test_the_files_nest_as_vllm_reads_them_without_the_unused_keys():
    shrink = tl.KernelCall("shrink", 3, 256, 3584, 32)
    expand = tl.KernelCall("expand", 1, 512, 32, 3584, (3584,))
    cfg = dict(block_m=64, block_n=16, block_k=128, split_k=8, num_warps=4, num_ctas=1, num_stages=2, group_size_m=8,
               max_nreg=None)
    best = {shrink: cfg, expand: dict(block_m=32, block_n=128, block_k=16, num_warps=4, num_ctas=1, num_stages=2)}
    got = tl.nested(best, "shrink")
    assert got == {"2": {"3": {"256": {"3584": {"32": {k: v for k, v in cfg.items() if k != "max_nreg"}}}}}}
    assert tl.nested(best, "expand")["2"]["1"]["512"]["32"]["3584"]["block_n"] == 128
    assert tl.file_names("NVIDIA H200") == {"shrink": "NVIDIA_H200_SHRINK.json", "expand": "NVIDIA_H200_EXPAND_TRUE.json"}
    assert tl.file_names("NVIDIA H100 80GB HBM3")["expand"] == "NVIDIA_H100_80GB_HBM3_EXPAND_TRUE.json"


def test_every_grid_config_has_the_keys_the_kernels_read():
    """vllm/lora/ops/triton_ops/lora_shrink_op.py and lora_expand_op.py index these keys."""
    for c in tl.SHRINK_GRID:
        assert {"block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "num_ctas"} <= c.keys()
    for c in tl.EXPAND_GRID:
        assert {"block_m", "block_n", "block_k", "num_warps", "num_stages", "num_ctas"} <= c.keys()
