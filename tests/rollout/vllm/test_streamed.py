"""spmd_rl/rollout/vllm/streamed.py on a stand-in for vLLM's LLMEngine that sends DELTA outputs as vLLM 0.26
does (a running request's new tokens every `stream_interval` tokens, the first token, and at its end): the
run reassembles each request's tokens and log-probs, returns a rank only its own requests, and `stop`
aborts every unfinished request and keeps what arrived of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spmd_rl.rollout.vllm.streamed import StreamedRun


class DeltaEngine:
    """Request r samples token 100 * (r + 1) + t at its t-th step, with log-prob -t / 100, until its
    max_tokens ("length")."""

    def __init__(self, interval: int):
        self.interval, self.running, self.sampled, self.aborted = interval, {}, {}, []

    def add_request(self, rid, prompt, params, lora_request=None):
        self.running[rid] = SimpleNamespace(limit=params.max_tokens, base=100 * (len(self.sampled) + 1), sent=0)
        self.sampled[rid] = []

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        outs = []
        for rid, r in list(self.running.items()):
            tokens = self.sampled[rid]
            tokens.append(r.base + len(tokens))
            finished = len(tokens) == r.limit
            if finished or r.sent == 0 or len(tokens) - r.sent >= self.interval:
                new = tokens[r.sent:]
                lps = [{t: SimpleNamespace(logprob=-(t - r.base) / 100)} for t in new]
                outs.append(SimpleNamespace(request_id=rid, finished=finished, outputs=[SimpleNamespace(
                    token_ids=new, logprobs=lps, finish_reason="length" if finished else None)]))
                r.sent = len(tokens)
            if finished:
                del self.running[rid]
        return outs

    def abort_request(self, ids):
        self.aborted += ids
        for rid in ids:
            del self.running[rid]


@pytest.mark.parametrize("interval", [1, 3])
def test_a_rank_gets_its_requests_whole_and_a_stop_keeps_what_arrived(interval):
    eng = DeltaEngine(interval)
    limits = [3, 5, 2, 9]  # the group's requests: 0, 1 are another rank's, 2, 3 this rank's
    stopped = []
    run = StreamedRun(eng, [[1]] * 4, [SimpleNamespace(max_tokens=k) for k in limits], [True] * 4, range(2, 4), "r-",
                      on_stop=stopped.append)
    (i, c), = run.advance(2)  # request 2 finished at its 2 tokens
    assert i == 0 and c.token_ids == [300, 301] and c.logprobs == pytest.approx([0, -0.01])
    assert c.finish_reason == "length"
    assert run.advance(2) == []  # request 0 finished: another rank's
    (i, c), = run.stop()  # request 3 ran 4 of its 9 tokens
    sampled = eng.sampled["r-3"]
    assert i == 1 and c.finish_reason == "" and c.token_ids == sampled[:len(c.token_ids)]
    assert len(sampled) - interval < len(c.token_ids) <= len(sampled) == 4
    assert c.logprobs == pytest.approx([-t / 100 for t in range(len(c.token_ids))])
    assert sorted(eng.aborted) == ["r-1", "r-3"] and not eng.has_unfinished_requests()
    assert stopped == [[3, 2]]  # the group's finished requests' tokens (0 and 2), for the engine's next cap


def test_a_request_vllm_finished_another_way_is_refused():
    """A finish reason other than "stop" or "length" (vLLM's "abort") never becomes a response."""
    class AbortingEngine(DeltaEngine):
        def step(self):
            outs = super().step()
            for out in outs:
                out.outputs[0].finish_reason, out.finished = "abort", True
            return outs

    run = StreamedRun(AbortingEngine(1), [[1]], [SimpleNamespace(max_tokens=3)], [True], range(0, 1), "r-")
    with pytest.raises(RuntimeError, match="reason 'abort'"):
        run.advance(1)


def test_requests_added_to_a_running_run_follow_on_a_ranks_indices():
    """`add` (partial rollouts' refill) puts the group's new requests into the running run: this rank's
    get the indices after its earlier ones, the others' stay out of its results, a stop aborts them too."""
    eng = DeltaEngine(1)
    groups = []

    def group(prompts, sampling, max_new_tokens, asks_logprobs):  # two ranks' requests, this rank's second
        groups.append((prompts, sampling))
        params = [SimpleNamespace(max_tokens=k) for k in [4] * len(prompts) + max_new_tokens]
        return [[0]] * len(prompts) + prompts, params, [True] * len(params), range(len(prompts), 2 * len(prompts))

    run = StreamedRun(eng, [[1], [1]], [SimpleNamespace(max_tokens=k) for k in (2, 9)], [True, True], range(1, 2),
                      "r-", group=group)
    assert run.advance(1) == []
    run.add([[5], [6]], "sampling", [1, 5], [True, True])  # requests 2, 3 the other rank's; 4, 5 this rank's
    assert groups == [([[5], [6]], "sampling")] and sorted(eng.running) == [f"r-{j}" for j in range(6)]
    (i, c), = run.advance(1)  # request 4 finished at its one token (and request 0, the other rank's, at 2)
    assert i == 1 and c.token_ids == [500] and c.finish_reason == "length"
    assert run.advance(2) == []  # request 5 at 3 of its 5
    left = run.stop()
    assert [(i, c.token_ids) for i, c in left] == [(0, [200, 201, 202, 203]), (2, [600, 601, 602])]
    assert sorted(eng.aborted) == ["r-1", "r-2", "r-3", "r-5"]


def test_a_run_started_without_a_group_refuses_an_add():
    run = StreamedRun(DeltaEngine(1), [[1]], [SimpleNamespace(max_tokens=3)], [True], range(0, 1), "r-")
    with pytest.raises(RuntimeError, match="without a way to add"):
        run.add([[2]], "sampling")


class _Kind:
    DELTA = "delta"


class _RecordingEngine(DeltaEngine):
    def __init__(self):
        super().__init__(1)
        self.params = []

    def add_request(self, rid, prompt, params, lora_request=None):
        assert prompt == {"prompt_token_ids": prompt["prompt_token_ids"]}
        self.params.append(params)
        super().add_request(rid, prompt, params)


class _StreamLLM:
    """vllm.LLM with a DeltaEngine as its LLMEngine (what VLLMEngine.start drives)."""

    def __init__(self, **kwargs):
        self.llm_engine = _RecordingEngine()

    def sleep(self, level):
        pass


class _VSP(SimpleNamespace):
    pass


def test_the_engine_starts_a_run_and_adds_to_it_with_delta_outputs_and_fresh_seeds(monkeypatch, tmp_path):
    """VLLMEngine.start, then the run's add (partial rollouts' refill): every request asks for DELTA
    outputs, the added ones with seeds of their own call's seed (not the first requests' again)."""
    import sys
    import types

    from spmd_rl.rollout.base import SamplingParams
    from tests.helpers.stand_in_vllm import stand_in_engine

    for name, attrs in {"vllm.inputs": {"tokens_input": lambda ids: {"prompt_token_ids": ids}},
                        "vllm.sampling_params": {"RequestOutputKind": _Kind}}.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    with stand_in_engine(monkeypatch, tmp_path, _StreamLLM, _VSP, ["rollout.max_num_seqs=64"],
                         config={"hidden_size": 64}) as engine:
        monkeypatch.setattr(engine, "_check_ready", lambda: None)
        one = SamplingParams(n=1, temperature=1.0, max_new_tokens=8, logprobs_every=1, seed=3)
        run = engine.start([[1, 2], [3]], one, max_new_tokens=[2, 8], asks_logprobs=[True, True])
        run.add([[4]], SamplingParams(n=1, temperature=1.0, max_new_tokens=8, logprobs_every=1, seed=4), [1], [True])
        assert [(i, c.token_ids) for i, c in run.advance(2)] == [(2, [300]), (0, [100, 101])]
        (i, c), = run.stop()
        assert i == 1 and c.token_ids == [200, 201]
    eng = engine.llm.llm_engine
    assert eng.aborted == ["run1-1"]
    params = eng.params
    assert all(p.output_kind == "delta" for p in params) and [p.max_tokens for p in params] == [2, 8, 1]
    assert params[2].seed not in (params[0].seed, params[1].seed) and params[0].seed != params[1].seed
