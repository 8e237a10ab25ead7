"""The vLLM output adapter (spmd_rl/rollout/vllm/outputs.py) on stand-ins for vLLM 0.26's objects,
and the engine's generate wiring it in with a stand-in `vllm.LLM` (as tests/rollout/vllm/test_engine_allocator.py
does): which requests ask for log-probs and in which container, the collector paused during the
call only, and the Completions that come out."""

from __future__ import annotations

import dataclasses
import gc
import types

import pytest

from spmd_rl.rollout.base import SamplingParams
from spmd_rl.rollout.vllm import outputs as vo
from tests.helpers.stand_in_vllm import stand_in_engine

# --------------------------------------------------------------------------- stand-ins for vLLM 0.26


@dataclasses.dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class FlatLogprobs:  # vllm.logprobs.FlatLogprobs: the fields and __len__ (positions) it has
    start_indices: list = dataclasses.field(default_factory=list)
    end_indices: list = dataclasses.field(default_factory=list)
    token_ids: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    ranks: list = dataclasses.field(default_factory=list)
    decoded_tokens: list = dataclasses.field(default_factory=list)

    def append_position(self, entries: list[tuple[int, float]]) -> None:
        """What vLLM's append_fast does for one position: the sampled token first, then the top-k."""
        self.start_indices.append(len(self.logprobs))
        for rank, (t, lp) in enumerate(entries):
            self.token_ids.append(t)
            self.logprobs.append(lp)
            self.ranks.append(rank + 1)
            self.decoded_tokens.append(None)
        self.end_indices.append(len(self.logprobs))

    def __len__(self) -> int:
        return len(self.start_indices)


@dataclasses.dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput (the fields read)
    index: int
    token_ids: list
    logprobs: object
    finish_reason: str
    routed_experts: object = None


def dict_logprobs(ids, lps, extra=()):
    """vLLM's default container: one {token_id: Logprob} per position, the sampled token among them."""
    return [{t: Logprob(lp, 5), **{e: Logprob(-9.0, 1) for e in extra}} for t, lp in zip(ids, lps)]


def flat_logprobs(ids, lps, extra=()):
    flat = FlatLogprobs()
    for t, lp in zip(ids, lps):
        flat.append_position([(t, lp)] + [(e, -9.0) for e in extra])
    return flat


IDS, LPS = [5, 9, 9, 2], [-0.5, -1.25, -0.125, -3.0]


# --------------------------------------------------------------------------- the adapter


@pytest.mark.parametrize("make", [dict_logprobs, flat_logprobs])
@pytest.mark.parametrize("extra", [(), (7, 8)])  # (7, 8): top-2 beside the sampled token (logprobs=2)
def test_both_containers_give_the_sampled_tokens_logprobs(make, extra):
    assert vo.sampled_logprobs(IDS, make(IDS, LPS, extra)) == LPS


@pytest.mark.parametrize("make", [dict_logprobs, flat_logprobs])
def test_a_container_of_other_tokens_or_lengths_is_refused(make):
    with pytest.raises((RuntimeError, KeyError)):
        vo.sampled_logprobs(IDS, make([5, 9, 3, 2], LPS))
    with pytest.raises(RuntimeError, match="returned 3 log-probs for 4 tokens"):
        vo.sampled_logprobs(IDS, make(IDS[:3], LPS[:3]))
    with pytest.raises(RuntimeError, match="returned 0 log-probs for 4 tokens"):
        vo.sampled_logprobs(IDS, None)


def test_completion_reads_logprobs_only_when_asked():
    out = CompletionOutput(0, list(IDS), flat_logprobs(IDS, LPS), "length")
    assert vo.completion(out, asked=True).logprobs == LPS
    c = vo.completion(CompletionOutput(0, list(IDS), None, "stop"), asked=False)
    assert c.logprobs is None and c.token_ids == IDS and c.finish_reason == "stop"
    with pytest.raises(RuntimeError, match="reason 'abort'"):
        vo.completion(CompletionOutput(0, list(IDS), None, "abort"), asked=False)


def test_completion_carries_vllms_routed_experts_as_int16():
    """vLLM 0.26 returns routed_experts as numpy [tokens, layers, top_k], uint8 up to 256 experts
    and uint16 beyond (vllm/model_executor/layers/fused_moe/routed_experts_capturer.py)."""
    import numpy as np
    import torch

    for dtype, top in ((np.uint8, 255), (np.uint16, 383)):
        arr = np.arange(6 * 2 * 3, dtype=np.int64).reshape(6, 2, 3) % (top + 1)
        arr[0, 0, 0] = top
        c = vo.completion(CompletionOutput(0, list(IDS), None, "stop", arr.astype(dtype)), asked=False)
        assert c.routes.dtype == torch.int16 and c.routes.tolist() == arr.tolist()
        assert c.copy().routes is c.routes
    assert vo.completion(CompletionOutput(0, list(IDS), None, "stop"), asked=False).routes is None


def test_an_expert_id_past_the_models_experts_is_refused_on_the_host():
    """Routes with an expert id >= the model's experts would index past the trainer's experts on the GPU
    (a device-side assert, far from its cause): refused where they arrive, in one line."""
    import numpy as np

    arr = np.zeros((6, 2, 3), dtype=np.uint8)
    arr[4, 1, 2] = 127
    assert vo.completion(CompletionOutput(0, list(IDS), None, "stop", arr), asked=False, num_experts=128).routes.max() == 127
    arr[4, 1, 2] = 128
    with pytest.raises(RuntimeError, match=r"vLLM returned expert 128 .* a model of 128 experts.*router_replay = \"off\""):
        vo.completion(CompletionOutput(0, list(IDS), None, "stop", arr), asked=False, num_experts=128)


def test_the_engine_knows_its_models_experts(tmp_path):
    import json

    from spmd_rl.rollout.vllm.engine import expert_count

    assert expert_count(str(tmp_path)) == 0  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    assert expert_count(str(tmp_path)) == 0
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_experts": 128, "num_experts_per_tok": 8}}))
    assert expert_count(str(tmp_path)) == 128
    (tmp_path / "config.json").write_text(json.dumps({"n_routed_experts": 64}))
    assert expert_count(str(tmp_path)) == 64


def test_logprob_request_and_flat_support():
    assert vo.logprob_request(False, True) == {"logprobs": None}
    assert vo.logprob_request(True, False) == {"logprobs": 0}
    assert vo.logprob_request(True, True) == {"logprobs": 0, "flat_logprobs": True}
    assert vo.supports_flat_logprobs(types.SimpleNamespace(__struct_fields__=("n", "logprobs", "flat_logprobs")))
    assert not vo.supports_flat_logprobs(types.SimpleNamespace(__struct_fields__=("n", "logprobs")))


def test_paused_gc_restores_the_collector_also_after_an_error():
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with vo.paused_gc():
            assert not gc.isenabled()
            raise ValueError("generate failed")
    assert gc.isenabled()
    with vo.paused_gc(pause=False):
        assert gc.isenabled()
    gc.disable()
    try:
        with vo.paused_gc():
            pass
        assert not gc.isenabled()  # off before: stays off
    finally:
        gc.enable()


# --------------------------------------------------------------------------- the engine's generate


class StandInSamplingParams:
    """vllm.SamplingParams 0.26: a msgspec Struct that has flat_logprobs."""
    __struct_fields__ = ("n", "temperature", "logprobs", "flat_logprobs", "seed")

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class StandInLLM:
    """vllm.LLM: each request's n completions, token ids from its prompt, log-probs in the container
    its SamplingParams asked for; records the params and whether the collector ran during generate."""
    last = None

    def __init__(self, **kwargs):
        StandInLLM.last = self

    def sleep(self, level):
        pass

    def wake_up(self, tags):
        pass

    def reset_prefix_cache(self):
        return True

    def generate(self, requests, params, use_tqdm=False):
        self.params, self.gc_on = params, gc.isenabled()
        outs = []
        for r, sp in zip(requests, params):
            comps = []
            for k in range(sp.n):
                ids = [t + k for t in r["prompt_token_ids"]]
                lps = [-0.25 * (t + 1) for t in ids]
                make = flat_logprobs if getattr(sp, "flat_logprobs", False) else dict_logprobs
                comps.append(CompletionOutput(k, ids, None if sp.logprobs is None else make(ids, lps), "length"))
            outs.append(types.SimpleNamespace(outputs=comps[::-1]))  # any order: the engine sorts by index
        return outs


@pytest.fixture
def engine(monkeypatch, tmp_path):
    with stand_in_engine(monkeypatch, tmp_path, StandInLLM, StandInSamplingParams) as eng:
        eng.wake_up()
        eng._weights_valid = True  # as after a load_weights (the stand-in has no model to load into)
        yield eng


@pytest.mark.parametrize("flat", [True, False])
def test_generate_asks_per_prompt_in_the_chosen_container_with_the_collector_paused(engine, flat):
    engine.flat_logprobs = flat
    prompts = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, logprobs_every=3))
    llm = StandInLLM.last
    assert [p.logprobs for p in llm.params] == [0, None, None, 0, None]
    assert [getattr(p, "flat_logprobs", False) for p in llm.params] == [flat, False, False, flat, False]
    assert not llm.gc_on and gc.isenabled()  # paused during the call, back on after it
    for p, group in zip(prompts, out):
        for k, c in enumerate(group):
            assert c.token_ids == [t + k for t in p]
            asked = p in (prompts[0], prompts[3])
            assert c.logprobs == ([-0.25 * (t + k + 1) for t in p] if asked else None)


def test_engine_takes_flat_logprobs_where_vllm_has_them_and_pauses_the_collector(engine):
    assert engine.flat_logprobs and engine.pause_gc
    engine.pause_gc = False
    engine.generate([[1]], SamplingParams(n=1, max_new_tokens=2))
    assert StandInLLM.last.gc_on


def test_greedy_copies_keep_no_logprobs_where_none_were_asked(engine):
    out = engine.generate([[1, 2], [3]], SamplingParams(n=3, temperature=0.0, max_new_tokens=2, logprobs_every=2))
    assert [len(g) for g in out] == [3, 3]
    assert all(c.logprobs == [-0.5, -0.75] for c in out[0]) and all(c.logprobs is None for c in out[1])
    assert out[0][0].logprobs is not out[0][1].logprobs  # copies, not one list three times


def test_ignore_eos_runs_every_request_to_its_own_limit_past_every_stop_token(engine):
    """SamplingParams.ignore_eos (rollout.length_profile): vLLM's ignore_eos and no stop token ids, each
    request with its own max_tokens; without it, the engine's stop ids and the call's."""
    engine.generate([[1], [2, 3]], SamplingParams(n=1, max_new_tokens=9, stop_token_ids=[5], ignore_eos=True),
                    max_new_tokens=[4, 7])
    params = StandInLLM.last.params
    assert [(p.ignore_eos, p.stop_token_ids, p.max_tokens) for p in params] == [(True, [], 4), (True, [], 7)]
    engine.generate([[1]], SamplingParams(n=1, max_new_tokens=9, stop_token_ids=[5]))
    (p,) = StandInLLM.last.params
    assert p.ignore_eos is False and p.stop_token_ids == sorted({5, *engine.stop_ids}) and p.max_tokens == 9
