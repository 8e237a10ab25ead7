"""The vLLM engine is built with expandable segments off and hidden from the environment.

vLLM's sleep-mode allocator switches expandable segments back on after its pools whenever
PYTORCH_CUDA_ALLOC_CONF names them, so CUDA graphs captured during engine start-up got buffers
from VMM segments, and custom all-reduce (tensor parallel >= 2) died registering them through
legacy CUDA IPC (`custom_all_reduce.cuh:455 'invalid argument'`; spmd_rl/runtime/gpu_memory.py). These
tests run the real VLLMEngine constructor on CPU with a stand-in `vllm.LLM` that records what it
saw; the GPU proof is configs/qwen7b.toml (TP=2, CUDA graphs, custom all-reduce) in
scripts/gpu_check.py.
"""

import os
import sys
import types

import pytest
import torch.distributed as dist

from spmd_rl.config.run_config import load_config
from spmd_rl.runtime import gpu_memory
from spmd_rl.runtime.distributed import free_port


@pytest.mark.parametrize("conf, hidden", [
    ("expandable_segments:True", ""),
    ("expandable_segments:True,max_split_size_mb:128", "max_split_size_mb:128"),
    ("max_split_size_mb:128, expandable_segments:True", "max_split_size_mb:128"),
    ("max_split_size_mb:128", "max_split_size_mb:128"),
])
def test_without_expandable_segments_keeps_the_other_settings(conf, hidden):
    assert gpu_memory.without_expandable_segments(conf) == hidden


def test_engine_build_allocator_hides_the_setting_and_restores_it(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:64")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    switched = []
    monkeypatch.setattr(gpu_memory, "set_expandable_segments", switched.append)
    with gpu_memory.engine_build_allocator():
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
        assert "PYTORCH_ALLOC_CONF" not in os.environ
        assert not gpu_memory.expandable_segments_requested()
    assert switched == [False]
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:64"
    assert os.environ["PYTORCH_ALLOC_CONF"] == "expandable_segments:True"


def test_engine_build_allocator_restores_after_a_failed_build(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.raises(RuntimeError):
        with gpu_memory.engine_build_allocator():
            raise RuntimeError("engine start failed")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ


class _RecordingLLM:
    """Stands in for vllm.LLM: records the allocator environment and switch at construction."""
    seen: list = []

    def __init__(self, **kwargs):
        _RecordingLLM.seen.append((os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), list(_switches),
                                   kwargs["disable_custom_all_reduce"]))

    def sleep(self, level):
        pass


_switches: list = []


def test_vllm_engine_is_built_with_expandable_segments_hidden(monkeypatch, tmp_path):
    fake = types.ModuleType("vllm")
    fake.LLM = _RecordingLLM
    fake.SamplingParams = type("SamplingParams", (), {})
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    from spmd_rl.rollout.vllm import engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "set_expandable_segments", _switches.append)
    monkeypatch.setattr(gpu_memory, "set_expandable_segments", _switches.append)
    cfg = load_config(None, ['rollout.engine="vllm"', "rollout.tensor_parallel_size=1"])
    dist.init_process_group("gloo")
    try:
        engine = vllm_engine.VLLMEngine(cfg, str(tmp_path), rank=0, world_size=1, local_rank=0, local_world_size=1)
    finally:
        dist.destroy_process_group()
    env_seen, switches_seen, disable_custom = _RecordingLLM.seen[-1]
    assert env_seen is None  # nothing left for vLLM's allocator to switch back on
    assert switches_seen == [False]  # and off in the allocator itself
    assert disable_custom is False  # custom all-reduce stays on (vLLM's default)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert _switches[-1] is True  # back on for training once the engine sleeps
    assert engine.is_asleep
