"""spmd_rl/rollout/vllm/sleep.py against a stand-in for vLLM 0.26's sleep path (LLM.sleep ->
executor.sleep -> worker.sleep, executor state as vllm/v1/executor/abstract.py keeps it): a sleep
whose device-wide freed-memory check fails because another process allocated still leaves an
engine that the next wake_up brings back."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

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


# ----------------------------------------------------------------- the weights kept on the GPU


class Allocation:
    """vLLM 0.26's AllocationData: handle (device, size, pointer, cuMem handle), tag, is_asleep."""

    def __init__(self, ptr: int, size: int, tag: str):
        self.handle, self.tag, self.is_asleep, self.cpu_backup_tensor = (0, size, ptr, ptr), tag, False, None


class Pool:
    """vLLM's CuMemAllocator over a stand-in device: `memory` holds each mapped allocation's bytes;
    `sleep` / `wake_up` are vLLM's own (the weights' bytes copied to `host` and back, the rest dropped)."""

    def __init__(self, sizes: dict[str, list[int]]):
        self.pointer_to_data, self.memory, self.host, self.unmapped, self.mapped = {}, {}, {}, [], []
        for tag, tag_sizes in sizes.items():
            for size in tag_sizes:
                ptr = 1000 * (len(self.pointer_to_data) + 1)
                self.pointer_to_data[ptr] = Allocation(ptr, size, tag)
                self.memory[ptr] = f"{tag}@{ptr}"

    def unmap(self, handle):
        assert handle[2] in self.memory, "unmapped twice"
        self.unmapped.append(handle[2])
        del self.memory[handle[2]]

    def create(self, handle):
        assert handle[2] not in self.memory, "mapped twice"
        self.mapped.append(handle[2])
        self.memory[handle[2]] = "new memory"

    def sleep(self, offload_tags=None):  # CuMemAllocator.sleep
        for ptr, data in self.pointer_to_data.items():
            if data.tag in (offload_tags or ()):
                self.host[ptr] = self.memory[ptr]
            self.unmap(data.handle)
            data.is_asleep = True

    def wake_up(self, tags=None):  # CuMemAllocator.wake_up
        for ptr, data in self.pointer_to_data.items():
            if tags is None or data.tag in tags:
                self.create(data.handle)
                data.is_asleep = False
                if ptr in self.host:
                    self.memory[ptr] = self.host.pop(ptr)


def test_release_frees_what_is_not_kept_once_and_map_back_returns_only_that():
    pool = Pool({"weights": [300, 200], "kv_cache": [500, 50]})
    weights = {p: pool.memory[p] for p, d in pool.pointer_to_data.items() if d.tag == "weights"}
    assert vllm_sleep.release(pool, vllm_sleep.KEPT, pool.unmap) == 550
    assert vllm_sleep.mapped_bytes(pool) == {"weights": 500}
    assert vllm_sleep.release(pool, vllm_sleep.KEPT, pool.unmap) == 0  # asleep already: not unmapped twice
    assert vllm_sleep.map_back(pool, ["weights"], pool.create) == 0  # the weights never went
    assert vllm_sleep.map_back(pool, ["kv_cache"], pool.create) == 550
    assert vllm_sleep.map_back(pool, None, pool.create) == 0  # nothing left asleep: nothing mapped twice
    assert vllm_sleep.mapped_bytes(pool) == {"weights": 500, "kv_cache": 550}
    assert {p: pool.memory[p] for p in weights} == weights  # the same bytes, never copied
    assert set(pool.unmapped) == set(pool.mapped) == {p for p, d in pool.pointer_to_data.items() if d.tag == "kv_cache"}
    assert pool.host == {}


class StandInWorker:
    """vLLM 0.26's gpu_worker.Worker: its sleep-mode backend made at the first sleep unless set."""

    def __init__(self, default_backend):
        self._sleep_mode_backend, self.default = None, default_backend

    def _get_sleep_mode_backend(self):
        if self._sleep_mode_backend is None:
            self._sleep_mode_backend = self.default()
        return self._sleep_mode_backend

    def sleep(self, level=1):
        self._get_sleep_mode_backend().suspend(level)

    def wake_up(self, tags=None):
        self._get_sleep_mode_backend().resume(tags)


@pytest.fixture
def stand_in_vllm(monkeypatch):
    """vLLM's sleep-mode modules over a Pool: `vllm.device_allocator{,.cumem,.sleep_mode_backend}`."""
    pool = Pool({"weights": [300, 200], "kv_cache": [500]})

    class CuMemBackend:  # vllm.device_allocator.sleep_mode_backend.CuMemBackend
        def __init__(self):
            self._state = "RUNNING"

        def suspend(self, level=1):
            pool.sleep(offload_tags=("weights",) if level == 1 else ())

        def resume(self, tags=None):
            pool.wake_up(tags)

    modules = {"vllm": types.ModuleType("vllm"),
               "vllm.device_allocator": types.SimpleNamespace(get_mem_allocator_instance=lambda: pool),
               "vllm.device_allocator.cumem": types.SimpleNamespace(create_and_map=pool.create,
                                                                    unmap_and_release=pool.unmap),
               "vllm.device_allocator.sleep_mode_backend": types.SimpleNamespace(CuMemBackend=CuMemBackend)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return pool, CuMemBackend


def worker_llm(worker):
    executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=worker))
    return types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=executor))


@pytest.mark.parametrize("kept", [True, False])
def test_the_backend_keeps_the_weights_mapped_through_sleeps_and_wake_ups(stand_in_vllm, kept):
    pool, cumem = stand_in_vllm
    worker = StandInWorker(cumem)
    if kept:
        vllm_sleep.keep_weights_on_gpu(worker_llm(worker))
    weights = {p for p, d in pool.pointer_to_data.items() if d.tag == "weights"}
    for _ in range(2):  # the engine's cycle: sleep, wake the weights, then the KV cache
        worker.sleep(1)
        assert vllm_sleep.held_while_asleep() == ({"weights": 500} if kept else {})
        assert bool(pool.host) != kept  # vLLM's own backend copies the weights to the host
        worker.wake_up(["weights"])
        worker.wake_up(["kv_cache"])
        assert vllm_sleep.mapped_bytes(pool) == {"weights": 500, "kv_cache": 500}
    assert (weights & set(pool.unmapped) == set()) == kept


def test_keeping_the_weights_is_refused_after_the_first_sleep_or_without_the_backend(stand_in_vllm):
    _, cumem = stand_in_vllm
    worker = StandInWorker(cumem)
    worker.sleep(1)
    with pytest.raises(RuntimeError, match="before its first sleep"):
        vllm_sleep.keep_weights_on_gpu(worker_llm(worker))
    with pytest.raises(RuntimeError, match="rollout.weights_stay_on_gpu = false"):
        vllm_sleep.keep_weights_on_gpu(worker_llm(types.SimpleNamespace()))


class StandInLLM:
    """vllm.LLM as the engine drives it: LLM -> executor (vLLM's sleep bookkeeping) -> worker -> backend."""

    cumem = None  # the stand-in vLLM's default backend (set by the test)

    def __init__(self, **kwargs):
        self.worker = StandInWorker(StandInLLM.cumem)
        self.worker.model_runner = types.SimpleNamespace(model=torch.nn.Linear(4, 4, bias=False))
        executor = Executor(self.worker)
        executor.driver_worker = types.SimpleNamespace(worker=self.worker)
        self.llm_engine = types.SimpleNamespace(model_executor=executor)

    def sleep(self, level):
        self.llm_engine.model_executor.sleep(level)

    def wake_up(self, tags=None):
        self.llm_engine.model_executor.wake_up(tags)

    def reset_prefix_cache(self):
        return True


def stand_in_engine(stand_in_vllm, monkeypatch, tmp_path, *overrides):
    """VLLMEngine built on CPU over the stand-ins with LoRA's adapter sync and `overrides`."""
    import torch.distributed as dist
    from transformers import Qwen2Config

    from spmd_rl.config.run_config import load_config
    from spmd_rl.runtime.distributed import free_port

    _, cumem = stand_in_vllm
    StandInLLM.cumem = cumem
    sys.modules["vllm"].LLM = StandInLLM
    sys.modules["vllm"].SamplingParams = type("SamplingParams", (), {})
    Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128).save_pretrained(tmp_path)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    from spmd_rl.rollout.vllm import engine as vllm_engine

    monkeypatch.setattr(vllm_engine.torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setattr(vllm_engine.lora_kernels, "choose", lambda *a: "LoRA kernels: stand-in")
    monkeypatch.setattr(vllm_engine.lora_matmul, "install", lambda **_: None)
    cfg = load_config(None, ['rollout.engine="vllm"', "model.lora_rank=8", *overrides])
    dist.init_process_group("gloo")
    try:
        return vllm_engine.VLLMEngine(cfg, str(tmp_path), rank=0, world_size=1, local_rank=0, local_world_size=1)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("stay", [True, False])
def test_the_engine_with_the_key_keeps_its_weights_mapped_from_its_first_sleep(stand_in_vllm, monkeypatch, tmp_path,
                                                                               stay):
    """VLLMEngine, built on CPU over the stand-ins with LoRA's adapter sync: with
    rollout.weights_stay_on_gpu its weights stay mapped through its first sleep (at the end of its
    build) and every cycle after, and nothing goes to host memory; without it vLLM's own backend
    copies them there."""
    pool, _ = stand_in_vllm
    engine = stand_in_engine(stand_in_vllm, monkeypatch, tmp_path, f"rollout.weights_stay_on_gpu={str(stay).lower()}")
    weights = {p for p, d in pool.pointer_to_data.items() if d.tag == "weights"}
    assert engine.is_asleep and engine.sleep_level == 1
    for _ in range(2):
        assert vllm_sleep.held_while_asleep() == ({"weights": 500} if stay else {})
        assert bool(pool.host) != stay
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert vllm_sleep.mapped_bytes(pool) == {"weights": 500, "kv_cache": 500}
        engine.sleep()
    assert (weights & set(pool.unmapped) == set()) == stay


@pytest.mark.parametrize("awake", [True, False])
def test_the_engine_stays_awake_from_its_first_wake_up_with_the_key(stand_in_vllm, monkeypatch, tmp_path, awake):
    """rollout.stay_awake: the engine sleeps once at the end of its build (as without it); from its first
    wake-up on, sleep() leaves weights and KV cache mapped and the next wake-ups neither empty PyTorch's
    cache nor call vLLM. Without it every step unmaps the KV cache and empties the cache around it."""
    pool, _ = stand_in_vllm
    engine = stand_in_engine(stand_in_vllm, monkeypatch, tmp_path, "rollout.weights_stay_on_gpu=true",
                             f"rollout.stay_awake={str(awake).lower()}")
    assert engine.is_asleep and vllm_sleep.mapped_bytes(pool) == {"weights": 500}
    emptied, woken = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    wake = engine.llm.wake_up
    monkeypatch.setattr(engine.llm, "wake_up", lambda tags=None: (woken.append(tags), wake(tags)))
    for _ in range(3):  # the trainer's cycle
        engine.wake_up(["weights"])
        engine.wake_up(["kv_cache"])
        assert vllm_sleep.mapped_bytes(pool) == {"weights": 500, "kv_cache": 500}
        engine.sleep()
        assert engine.is_asleep != awake
        assert vllm_sleep.mapped_bytes(pool) == ({"weights": 500, "kv_cache": 500} if awake else {"weights": 500})
    assert woken == [["weights"], ["kv_cache"]] * (1 if awake else 3)
    if awake:
        assert len(emptied) == 2  # before the first cycle's two wake-ups only
    else:
        assert len(emptied) >= 9  # before each wake-up and after each sleep, every cycle
