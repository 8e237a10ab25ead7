"""A LoRA actor's adapter reaches our vLLM engine, both ways (model.lora_sync), on one GPU: the
numbers come from tests/gpu/lora_worker.py (its docstring says what each is), a random Qwen2-0.5B
shape with rank 32 on every linear layer and its B drawn non-zero.

- the adapter sync gives the actor's log-probs at bf16 level, where losing the adapter would be off
  by `effect`; a zero adapter gives the base's; after a sleep (level 1) and a wake-up the base is
  still there and a new adapter replaces the old one without the base being sent again;
- merged weights give the actor's log-probs too;
- the trap: after 5 small AdamW steps the engine fed by the adapter sync follows the actor's move of
  its log-probs; the merged sync, whose bf16 W + s B A rounds the change away, is printed beside it;
- with rollout.weights_stay_on_gpu (the worker run again, --weights-stay) the weights stay mapped while
  the engine sleeps, nothing else does, and every number above holds as without it.
"""

from __future__ import annotations

import json

import pytest
from runs import random_model_dir, run_worker, skip_reason

pytestmark = pytest.mark.gpu


def run_lora_worker(tmp_path_factory, *flags):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("lora") / "result.json"
    result = run_worker("lora_worker.py", ["--model", random_model_dir("qwen2-0.5b"), *flags], out, timeout=900)
    print("lora sync on the GPU", *flags, json.dumps(result))
    return result


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_lora_worker(tmp_path_factory)


@pytest.fixture(scope="module")
def measured_weights_stay(tmp_path_factory):
    return run_lora_worker(tmp_path_factory, "--weights-stay")


def test_the_adapter_sync_gives_the_actors_policy(measured):
    m = measured
    assert m["sleep_level"] == 1, m  # the base stays (in host memory) across sleeps
    assert m["adapter"] < 0.05, m  # bf16 level (a broken name mapping or a lost adapter shows `effect`)
    assert m["effect"] > max(0.2, 5 * m["adapter"]), m  # the adapter moves the policy far beyond that
    assert m["no_adapter"] < 0.05, m  # B = 0: the base's policy
    assert m["after_sleep"] < 0.05, m  # a new adapter, the base kept through sleep and wake-up
    assert m["held_asleep"] == {}, m  # without rollout.weights_stay_on_gpu nothing stays mapped


def test_the_merged_sync_gives_the_actors_policy(measured):
    assert measured["merged"] < 0.05, measured


def test_after_small_updates_the_adapter_synced_engine_follows_the_actor(measured):
    m = measured
    assert m["actor_move"] > 0, m
    assert m["miss_adapter"] < 0.3, m
    print(f"after 5 AdamW steps at lr 1e-5 (mean |move| {m['actor_move']:.2e} nats): the engine missed "
          f"{m['miss_adapter']:.2f} of the actor's move with the adapter sync, {m['miss_merged']:.2f} merged")


def test_the_weights_kept_on_the_gpu_while_it_sleeps_give_the_same_policy(measured_weights_stay):
    m = measured_weights_stay
    assert set(m["held_asleep"]) == {"weights"}, m  # the KV cache is freed, the weights stay
    assert m["held_asleep"]["weights"] >= m["engine_weight_bytes"], m  # the base's bf16 bytes at least
    for key in ("adapter", "no_adapter", "after_sleep", "merged"):
        assert m[key] < 0.05, (key, m)
    assert m["effect"] > max(0.2, 5 * m["adapter"]), m
    assert m["actor_move"] > 0 and m["miss_adapter"] < 0.3, m
