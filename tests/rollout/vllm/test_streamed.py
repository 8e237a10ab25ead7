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
