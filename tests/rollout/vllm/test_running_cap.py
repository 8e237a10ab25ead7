"""spmd_rl/rollout/vllm/running_cap.py: how many requests vLLM runs at once with rollout.max_num_seqs =
"auto", on stand-ins for vLLM's scheduler and engine (vLLM itself: gpu_check's learning checks)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from spmd_rl.rollout.base import SamplingParams
from spmd_rl.rollout.vllm import running_cap as rc
from tests.helpers.stand_in_vllm import stand_in_engine


def test_the_cap_is_what_the_kv_cache_holds_at_the_expected_contexts():
    kv = 1_266_560  # a 7B engine's KV cache on an H200 at gpu_memory_utilization 0.6, in tokens
    assert rc.running_cap(kv, 70, 8192, 512) == 1_266_560 // 8262 == 153  # at full length
    assert rc.running_cap(kv, 70, 1532, 512) == 512  # 790 fit: the engine's most
    assert rc.running_cap(kv, 70, 1532, 1024) == 1_266_560 // 1602 == 790
    assert rc.running_cap(100, 4000, 4000, 512) == 1  # never none
    assert rc.running_cap(kv, 0, 0, 512) == 512


class _Scheduler:
    """vLLM's scheduler as running_cap uses it: the cap it reads every step, and the preemption that
    it calls through the instance when its KV cache is full."""

    def __init__(self, cap: int):
        self.max_num_running_reqs = cap
        self.preempted: list[str] = []

    def _preempt_request(self, request, timestamp):
        self.preempted.append(request)

    def kv_cache_full(self, request: str) -> None:
        self._preempt_request(request, 0.0)


def test_each_call_gets_the_cap_of_its_prompts_and_the_last_calls_lengths():
    sched = _Scheduler(512)
    cap = rc.RunningCap(sched, kv_tokens=100_000, built=512)
    assert cap.before([10] * 8, [990] * 8) == sched.max_num_running_reqs == 100  # none finished yet: at the limits
    cap.finished([90, 190, 290])  # mean 190
    assert cap.before([10] * 8, [990] * 8) == sched.max_num_running_reqs == 100_000 // 200 == 500
    assert cap.before([50] * 4, [150] * 4) == 100_000 // 200  # the limit bounds the expected response
    cap.finished([])  # a run stopped before any request finished: the estimate stays
    assert cap.before([10], [990]) == 500
    cap.finished([4000] * 2)
    assert cap.before([10], [8000]) == 100_000 // 4010 == 24
    assert cap.before([], []) == 24  # an empty call changes nothing
    sched.kv_cache_full("a")
    sched.kv_cache_full("b")
    assert sched.preempted == ["a", "b"]  # vLLM's own preemption still runs
    assert cap.metrics() == {"rollout/engine_max_running": 24.0, "rollout/engine_preempted": 2.0}
    assert cap.metrics()["rollout/engine_preempted"] == 0.0  # per read


def _llm(scheduler, kv_tokens=None, blocks=None):
    cache = SimpleNamespace(kv_cache_size_tokens=kv_tokens, num_gpu_blocks=blocks, block_size=16)
    return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=scheduler)), vllm_config=SimpleNamespace(cache_config=cache)))


def test_the_engines_scheduler_and_kv_cache_are_found_or_said_missing(caplog):
    assert rc.RunningCap.of(_llm(_Scheduler(64), kv_tokens=5000), 64).kv_tokens == 5000
    assert rc.RunningCap.of(_llm(_Scheduler(64), blocks=300), 64).kv_tokens == 4800  # blocks x block size
    with caplog.at_level(logging.WARNING):
        assert rc.RunningCap.of(_llm(None, kv_tokens=5000), 64) is None
    assert "its cap stays at 64 sequences at once" in caplog.text


class _Output(SimpleNamespace):
    pass


class _LLM:
    """Stands in for vllm.LLM: a scheduler and KV cache of 20,000 tokens; generate records the cap it
    runs under and answers each sample with `length` tokens."""
    length = 0

    def __init__(self, **kwargs):
        self.sched = _Scheduler(kwargs["max_num_seqs"])
        self.llm_engine = _llm(self.sched, kv_tokens=20_000).llm_engine
        self.caps: list[int] = []

    def sleep(self, level):
        pass

    def generate(self, prompts, sps, use_tqdm=False, **kw):
        self.caps.append(self.sched.max_num_running_reqs)
        return [_Output(outputs=[_Output(index=i, token_ids=list(range(self.length)), logprobs=None,
                                         finish_reason="length", stop_reason=None) for i in range(sp.n)])
                for sp in sps]


class _SamplingParams(SimpleNamespace):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.max_tokens = kwargs["max_tokens"]


@pytest.mark.parametrize("value, adapts", [('"auto"', True), ("64", False)])
def test_the_engine_sets_the_cap_before_each_call_where_auto_chose_it(monkeypatch, tmp_path, value, adapts):
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=990, logprobs_every=0)
    _LLM.length = 40
    with stand_in_engine(monkeypatch, tmp_path, _LLM, _SamplingParams, ["rollout.tensor_parallel_size=1",
                         f"rollout.max_num_seqs={value}"], config={"hidden_size": 64},
                         choose_speed_settings=True) as engine:  # no GPU: "auto" builds for 256
        monkeypatch.setattr(engine, "_check_ready", lambda: None)
        out = engine.generate([[1] * 10, [2] * 30], sampling)  # 8 requests of 20 prompt tokens on average
        engine.generate([[1] * 10, [2] * 30], sampling)
        metrics = engine.scheduling_metrics()
    assert [len(c.token_ids) for g in out for c in g] == [40] * 8
    if adapts:
        assert engine.llm.caps == [20_000 // (20 + 990), 256] and 20_000 // (20 + 40) > 256  # built for 256
        assert metrics == {"rollout/engine_max_running": 256.0, "rollout/engine_preempted": 0.0}
    else:
        assert engine.llm.caps == [64, 64] and metrics == {}
