"""spmd_rl/rollout/vllm/sleep.py against a stand-in for vLLM 0.26's sleep path (LLM.sleep ->
executor.sleep -> worker.sleep, executor state as vllm/v1/executor/abstract.py keeps it): a sleep
whose device-wide freed-memory check fails because another process allocated still leaves an
engine that the next wake_up brings back."""

from __future__ import annotations

import logging
import types

import pytest

from spmd_rl.rollout.vllm import sleep as vllm_sleep


class Worker:
    def __init__(self, other_process_allocates: bool, message: str = vllm_sleep.SHARED_GPU_ASSERTION):
        self.resident, self.other, self.message = True, other_process_allocates, message

    def sleep(self, level):
        self.resident = False  # released, then vLLM reads the device's free memory
        if self.other:  # vLLM's `assert freed_bytes >= 0, "..."` (no pytest rewriting of the message)
            raise AssertionError(self.message)

    def wake_up(self, tags):
        self.resident = True


class Executor:
    """vLLM 0.26's ExecutorBase.sleep / wake_up, less logging."""

    def __init__(self, worker):
        self.worker, self.is_sleeping, self.sleeping_tags = worker, False, set()

    def sleep(self, level):
        if self.is_sleeping:
            return
        self.worker.sleep(level)
        self.sleeping_tags = {"weights", "kv_cache"}
        self.is_sleeping = True

    def wake_up(self, tags=None):
        if not self.is_sleeping or any(t not in self.sleeping_tags for t in tags or ()):
            return
        self.worker.wake_up(tags)
        for t in tags or list(self.sleeping_tags):
            self.sleeping_tags.discard(t)
        self.is_sleeping = bool(self.sleeping_tags)


def fake_llm(worker):
    executor = Executor(worker)
    engine = types.SimpleNamespace(model_executor=executor)
    return types.SimpleNamespace(llm_engine=engine, sleep=lambda level: executor.sleep(level),
                                 wake_up=lambda tags=None: executor.wake_up(tags))


@pytest.mark.parametrize("adapter", [True, False])
def test_a_sleep_that_another_process_made_look_like_a_leak_still_wakes_up(adapter, caplog, monkeypatch):
    monkeypatch.setattr(vllm_sleep, "survived", 0)
    worker = Worker(other_process_allocates=True)
    llm = fake_llm(worker)
    if adapter:
        with caplog.at_level(logging.WARNING):
            vllm_sleep.sleep(llm, 2)
        assert "another process on this GPU" in caplog.text and vllm_sleep.survived == 1
    else:
        with pytest.raises(AssertionError):
            llm.sleep(2)
    assert not worker.resident
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    # vLLM alone leaves the memory released after this failure; the adapter brings it back
    assert worker.resident == adapter
    if adapter:
        assert not llm.llm_engine.model_executor.is_sleeping


def test_a_good_sleep_and_other_assertions_are_left_alone(monkeypatch):
    monkeypatch.setattr(vllm_sleep, "survived", 0)
    worker = Worker(other_process_allocates=False)
    llm = fake_llm(worker)
    vllm_sleep.sleep(llm, 1)
    assert llm.llm_engine.model_executor.is_sleeping and not worker.resident
    other = fake_llm(Worker(other_process_allocates=True, message="something else"))
    with pytest.raises(AssertionError, match="something else"):
        vllm_sleep.sleep(other, 2)
    assert not other.llm_engine.model_executor.is_sleeping and vllm_sleep.survived == 0
