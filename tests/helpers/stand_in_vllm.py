"""spmd_rl's VLLMEngine on CPU over stand-ins for `vllm.LLM` and `vllm.SamplingParams`: for tests of what
the engine itself does around vLLM (its requests, log-prob containers, caps, the LoRA kernels' folder)."""

from __future__ import annotations

import contextlib
import json
import sys
import types
from typing import Iterator

import torch.distributed as dist

from spmd_rl.config.run_config import load_config
from spmd_rl.runtime.distributed import free_port

VLLM_WRAPPER = "vllm.lora.punica_wrapper.punica_gpu.PunicaWrapperGPU"
"""What vLLM 0.26's CUDA platform names as its LoRA layers' wrapper (get_punica_wrapper)."""


@contextlib.contextmanager
def stand_in_engine(monkeypatch, model_dir, llm_cls, sampling_params_cls, overrides=(), config: dict | None = None,
                    choose_speed_settings: bool = False) -> Iterator:
    """A one-rank VLLMEngine of `overrides` (on rollout.engine = "vllm") built over the stand-ins, in a
    gloo process group that ends with the block. `config`: the model directory's config.json, where
    given; `choose_speed_settings`: "auto" resolved as on a machine without a GPU (speed_settings)."""
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = llm_cls, sampling_params_cls
    monkeypatch.setitem(sys.modules, "vllm", fake)
    fake.platforms = types.ModuleType("vllm.platforms")  # the platform, whose LoRA wrapper the engine may name
    fake.platforms.current_platform = type("Platform", (), {"get_punica_wrapper": classmethod(lambda cls: VLLM_WRAPPER)})()
    monkeypatch.setitem(sys.modules, "vllm.platforms", fake.platforms)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    if config is not None:
        (model_dir / "config.json").write_text(json.dumps(config))
    from spmd_rl.preflight import speed_settings
    from spmd_rl.rollout.vllm import engine as vllm_engine

    monkeypatch.setattr(vllm_engine, "set_expandable_segments", lambda on: None)
    cfg = load_config(None, ['rollout.engine="vllm"', *overrides])
    if choose_speed_settings:
        speed_settings.resolve(cfg, 1, None)
    dist.init_process_group("gloo")
    try:
        yield vllm_engine.VLLMEngine(cfg, str(model_dir), rank=0, world_size=1, local_rank=0, local_world_size=1)
    finally:
        dist.destroy_process_group()
