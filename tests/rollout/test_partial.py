"""spmd_rl/rollout/partial.py on a scripted engine: the cut by complete groups, the versions and
behaviour log-probs every token keeps, the rollout-correction weights they give, the staleness bound
under "drop" and "wait", and two ranks cutting in lockstep."""

from __future__ import annotations

import math

import pytest
import torch

from spmd_rl.algo.rollout_correction import is_weights
from spmd_rl.batching.batch import build_rollout_batch
from spmd_rl.data.prompts import PromptRecord
from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.rollout.partial import PartialRollouts
from tests.helpers.dist_utils import run_distributed

STOP = 99


class ScriptedEngine:
    """Prompt [g] samples response s of group g to LENGTHS[g][s] tokens (token 7, then STOP at the
    end when that is shorter than the limit); each token's log-prob is -0.1 x (version + 1), version
    being the weights the test "synced" last. Counts its calls."""

    def __init__(self, lengths: dict[int, list[int]]):
        self.lengths, self.version, self.calls = lengths, 0, 0

    def generate(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        assert sampling.n == 1 and all(asks_logprobs)
        self.calls += 1
        out = []
        for prompt, limit in zip(prompts, max_new_tokens):
            g, so_far = prompt[0], len(prompt) - 2  # prompt = [g, s] + the tokens so far
            target = self.lengths[g][prompt[1]]
            n = min(limit, target - so_far)
            stops = so_far + n == target
            tokens = [7] * (n - 1) + [STOP if stops else 7]
            routes = torch.full((len(prompt) + n - 1, 1, 1), self.version, dtype=torch.int16)  # the row, as vLLM
            out.append([Completion(tokens, [-0.1 * (self.version + 1)] * n, "stop" if stops else "length", routes=routes)])
        return out


def records(*groups):
    return [PromptRecord(g, [g], "t", "0") for g in groups]


def run_step(pr, engine, recs, version, more=None):
    engine.version = version
    return pr.step(engine, recs, version, lambda k: SamplingParams(seed=k), more=more)


class TwoSamples(PartialRollouts):
    """Sample s of group g resumes as the prompt [g, s] + its tokens, so the scripted engine knows which
    sample it runs."""

    def resume_prompt(self, g, r):
        return [g.record.prompt_ids[0], next(s for s, x in enumerate(g.responses) if x is r)] + r.tokens


LENGTHS = {0: [2, 2], 1: [8, 8], 2: [2, 4], 3: [4, 4], 4: [2, 2], 5: [2, 2], 6: [2, 2], 7: [2, 2]}


def new(policy="drop", pool_batches=2):
    return TwoSamples(n=2, per_rank=2, max_response_length=8, chunk_tokens=2, max_staleness=1, stale_policy=policy,
                      device=torch.device("cpu"), pool_batches=pool_batches)


def test_versions_logprobs_and_correction_weights_are_exact():
    pr, eng = new(), ScriptedEngine(LENGTHS)
    recs, comps, m = run_step(pr, eng, records(0, 1, 2, 3), version=0)
    # after two rounds groups 0, 2, 3 are complete: the first two in pool order train, 1 (4 tokens) and 3 carry
    assert [r.index for r in recs] == [0, 2] and eng.calls == 2 and m["rollout/partial_rounds"] == 2
    assert [[len(c.token_ids) for c in cs] for cs in comps] == [[2, 2], [2, 4]]
    assert [g.record.index for g in pr.carried] == [1, 3] and pr.carried[0].responses[0].versions == [0] * 4
    assert m["rollout/staleness_max"] == 0 and m["rollout/carried_groups"] == 2
    assert m["rollout/carried_tokens"] == 4 + 4 + 4 + 4  # group 1 four tokens a sample so far, group 3 complete

    recs, comps, m = run_step(pr, eng, records(4, 5), version=1)
    # one round: group 1 reaches 6 tokens; 3 (carried complete, oldest) and 4 train, 1 and 5 carry
    assert [r.index for r in recs] == [3, 4] and eng.calls == 3
    assert comps[0][0].logprobs == pytest.approx([-0.1] * 4) and comps[1][0].logprobs == pytest.approx([-0.2] * 2)
    assert m["rollout/staleness_mean"] == pytest.approx(8 / 12) and m["rollout/staleness_max"] == 1
    assert m["rollout/staleness_share_1"] == pytest.approx(8 / 12) and m["rollout/staleness_share_0"] == pytest.approx(4 / 12)
    # a mixture's routing: the last call's, over the whole row (prompt [g, s] + 4 tokens, the last one never fed)
    assert comps[0][0].routes.flatten().tolist() == [0] * 5
    carried = pr.carried[0].responses[0]
    assert carried.routes is None  # unfinished: its last run gives the whole row's when it finishes
    assert carried.versions == [0, 0, 0, 0, 1, 1] and carried.logprobs == pytest.approx([-0.1] * 4 + [-0.2] * 2)

    # the actor now (version 1) gives -0.2 to every token: token-level TIS = exp(actor - behaviour)
    batch = build_rollout_batch([r.prompt_ids for r in recs], comps, 0)
    mask = batch["response_mask"]
    w = is_weights(torch.full_like(mask, -0.2) * mask, batch["rollout_logprobs"], mask, "token", 2.0)
    assert w[mask > 0][:8].tolist() == pytest.approx([math.exp(-0.1)] * 8)  # group 3: one version old
    assert w[mask > 0][8:].tolist() == pytest.approx([1.0] * 4)  # group 4: sampled by this policy

    # version 2: group 1 (first token at version 0) would train 2 versions old: dropped, counted
    recs, _, m = run_step(pr, eng, records(6, 7), version=2)
    assert [r.index for r in recs] == [5, 6] and m["rollout/stale_dropped"] == 1
    assert m["rollout/staleness_max"] <= 1


def test_wait_finishes_the_groups_at_the_bound():
    pr, eng = new("wait"), ScriptedEngine(LENGTHS)
    run_step(pr, eng, records(0, 1, 2, 3), version=0)
    recs, comps, m = run_step(pr, eng, records(4, 5), version=1)
    # group 1 is at the bound: the step runs until its 8 tokens are done (two more rounds), and it trains first
    assert [r.index for r in recs] == [1, 3] and m["rollout/partial_rounds"] == 2 and m["rollout/stale_dropped"] == 0
    assert comps[0][0].logprobs == pytest.approx([-0.1] * 4 + [-0.2] * 4)
    assert comps[0][0].routes.flatten().tolist() == [1] * 9  # its last call's: prompt [g, s] + 8 tokens, less one
    assert m["rollout/staleness_max"] == 1
    _, _, m = run_step(pr, eng, records(6, 7), version=2)
    assert m["rollout/stale_dropped"] == 0 and m["rollout/staleness_max"] <= 1


def test_a_save_drops_the_carried_groups_and_counts_them():
    pr, eng = new(), ScriptedEngine(LENGTHS)
    run_step(pr, eng, records(0, 1, 2, 3), version=0)
    pr.drop_all()
    assert pr.carried == [] and pr.batches_to_draw() == 2
    _, _, m = run_step(pr, eng, records(4, 5, 6, 7), version=1)
    assert m["rollout/dropped_at_save"] == 2 and m["rollout/staleness_max"] == 0


def _lockstep(rank, world):
    # rank 0's groups finish in one round, rank 1's need four: both make the same engine calls
    eng = ScriptedEngine({0: [2, 2], 1: [2, 2], 2: [8, 8], 3: [8, 8]})
    pr = new()
    recs, _, m = run_step(pr, eng, records(0, 1) if rank == 0 else records(2, 3), version=0)
    assert eng.calls == 4 and m["rollout/partial_rounds"] == 4 and len(recs) == 2
    assert pr.batches_to_draw() == 2


def test_two_ranks_cut_in_lockstep():
    run_distributed(_lockstep, 2)


def test_a_group_ages_from_its_first_token():
    pr, eng = new(), ScriptedEngine({g: [2, 2] for g in range(8)})
    run_step(pr, eng, records(4, 5, 6, 7), version=0)  # all done in one round: 6 and 7 carry, complete
    recs, _, m = run_step(pr, eng, records(0, 1), version=1)  # 6, 7 train; 0 and 1 carry without a token
    assert [r.index for r in recs] == [6, 7] and m["rollout/partial_rounds"] == 0
    assert [g.born(3) for g in pr.carried] == [3, 3]  # not started: as young as the step that starts them
    recs, _, m = run_step(pr, eng, records(2, 3), version=3)
    assert [r.index for r in recs] == [0, 1] and m["rollout/stale_dropped"] == 0 and m["rollout/staleness_max"] == 0


def test_the_checks_default_to_64_steps_or_a_quarter_of_the_longest_response():
    from spmd_rl.config.run_config import Config
    from spmd_rl.rollout.partial import from_config

    cfg = Config()
    assert from_config(cfg, 1, torch.device("cpu")) is None  # off
    cfg.rollout.partial_rollouts, cfg.data.max_response_length = True, 8192
    assert from_config(cfg, 1, torch.device("cpu")).chunk == 64
    cfg.data.max_response_length = 200
    assert from_config(cfg, 1, torch.device("cpu")).chunk == 50
    cfg.data.max_response_length = 2
    assert from_config(cfg, 1, torch.device("cpu")).chunk == 1  # at least one token
    cfg.rollout.partial_chunk_tokens = 300
    assert from_config(cfg, 1, torch.device("cpu")).chunk == 300  # a set value is kept


class StreamingEngine(ScriptedEngine):
    """The scripted engine with a streamed run of its own (`start`, as vLLM's): a run keeps its requests
    between `advance` calls instead of resuming them as new ones. Counts its runs."""

    def __init__(self, lengths):
        super().__init__(lengths)
        self.starts, self.added = 0, []

    def start(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        assert sampling.n == 1 and all(asks_logprobs)
        self.starts += 1
        return _ScriptedRun(self, prompts, max_new_tokens)


class _ScriptedRun:
    def __init__(self, engine, prompts, limits):
        self.engine, self.prompts, self.limits = engine, prompts, limits
        self.out = [Completion([], [], "") for _ in prompts]

    def advance(self, steps):
        finished = []
        for i, (prompt, limit, o) in enumerate(zip(self.prompts, self.limits, self.out)):
            if o.finish_reason:
                continue
            target = self.engine.lengths[prompt[0]][prompt[1]] - (len(prompt) - 2)  # tokens this run owes
            n = min(steps, target - len(o.token_ids), limit - len(o.token_ids))
            o.token_ids += [7] * n
            o.logprobs += [-0.1 * (self.engine.version + 1)] * n
            if len(o.token_ids) == target:
                o.token_ids[-1], o.finish_reason = STOP, "stop"
            elif len(o.token_ids) == limit:
                o.finish_reason = "length"
            if o.finish_reason:
                o.routes = torch.full((len(prompt) + len(o.token_ids) - 1, 1, 1), self.engine.version,
                                      dtype=torch.int16)
                finished.append((i, o.copy()))
        return finished

    def add(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        assert sampling.n == 1 and all(asks_logprobs)
        self.engine.added.append(sampling.seed)
        self.prompts += prompts
        self.limits += max_new_tokens
        self.out += [Completion([], [], "") for _ in prompts]

    def stop(self):
        return [(i, o.copy()) for i, o in enumerate(self.out) if not o.finish_reason]


@pytest.mark.parametrize("policy", ["drop", "wait"])
def test_a_streamed_run_cuts_as_rounds_do_with_one_run_a_step(policy):
    """An engine with its own run (vLLM's streamed one) trains the same groups, tokens, log-probs,
    versions and routes as rounds of generate calls, step after step, and starts one run a step: its
    unfinished requests are not resumed at every check."""
    rounds_pr, rounds_eng = new(policy), ScriptedEngine(LENGTHS)
    stream_pr, stream_eng = new(policy), StreamingEngine(LENGTHS)
    generating = 0
    for version, recs in enumerate([(0, 1, 2, 3), (4, 5), (6, 7), (), ()]):
        a = run_step(rounds_pr, rounds_eng, records(*recs), version)
        b = run_step(stream_pr, stream_eng, records(*recs), version)
        assert [r.index for r in a[0]] == [r.index for r in b[0]]
        for ca, cb in zip(sum(a[1], []), sum(b[1], [])):
            assert (ca.token_ids, ca.logprobs, ca.finish_reason) == (cb.token_ids, cb.logprobs, cb.finish_reason)
            assert torch.equal(ca.routes, cb.routes)
        assert a[2] == b[2]
        assert [[r.versions for r in g.responses] for g in rounds_pr.carried] == \
               [[r.versions for r in g.responses] for g in stream_pr.carried]
        generating += a[2]["rollout/partial_rounds"] > 0
    assert stream_eng.starts == generating and stream_eng.calls == 0
    assert rounds_eng.calls > generating  # rounds resume the unfinished requests at every check


# After the first check (2 tokens each) group 0 is complete and groups 1, 2, 3 each have one response
# left: 3 unfinished responses, fewer than a batch's 4, and no batch of complete groups yet.
SHORT = {0: [2, 2], 1: [8, 2], 2: [4, 2], 3: [4, 2], 4: [2, 2], 5: [2, 2], 6: [2, 2], 7: [2, 2]}


def _drawer(drawn):
    """`more` of a step: the k-th refill's batch, groups 4 + 2(k-1) and 5 + 2(k-1) (limits: the longest)."""
    def more(k):
        drawn.append(k)
        return records(4 + 2 * (k - 1), 5 + 2 * (k - 1)), None
    return more


@pytest.mark.parametrize("engine_cls", [ScriptedEngine, StreamingEngine])
def test_a_run_short_of_a_batch_of_responses_takes_new_prompts_while_the_pool_has_room(engine_cls):
    """With room for three batches, the step's run takes one batch of new prompts (its own seed) when
    its unfinished responses fall below a batch's; the new groups, done at the next check, wait behind
    the older complete ones and carry over. With room for two, nothing joins and the rest is the same."""
    outcomes = []
    for pool_batches in (3, 2):
        pr, eng, drawn = new("drop", pool_batches), engine_cls(SHORT), []
        recs, comps, m = run_step(pr, eng, records(0, 1, 2, 3), version=0, more=_drawer(drawn))
        joined = pool_batches == 3
        assert drawn == ([1] if joined else []) and m["rollout/partial_refills"] == float(joined)
        assert [r.index for r in recs] == [0, 2] and m["rollout/partial_rounds"] == 2
        assert [g.record.index for g in pr.carried] == ([1, 3, 4, 5] if joined else [1, 3])
        if joined:  # groups 4 and 5 sampled both of their tokens in the run's second stretch
            assert [[r.tokens for r in g.responses] for g in pr.carried[2:]] == [[[7, STOP]] * 2] * 2
            assert all(r.versions == [0, 0] for g in pr.carried[2:] for r in g.responses)
            assert getattr(eng, "added", [1]) == [1]  # a streamed run: the refill joined it, with seed 1
        outcomes.append((recs, [[c.token_ids for c in cs] for cs in comps]))
    assert outcomes[0] == outcomes[1]  # the step's batch is the same either way


def test_a_full_pool_takes_no_more_and_the_carried_responses_resumed_are_counted():
    pr, eng, drawn = new("wait", 3), ScriptedEngine(SHORT), []
    run_step(pr, eng, records(0, 1, 2, 3), version=0, more=_drawer(drawn))  # carries 1, 3, 4, 5 (3, 4, 5 complete)
    recs, _, m = run_step(pr, eng, records(6, 7), version=1, more=_drawer(drawn))
    # group 1 is at the bound ("wait"): its first response runs on from 4 tokens (the engine prefills the
    # prompt [1, 0] and them again); after the first stretch it alone is unfinished, but the pool holds
    # 1, 3, 4, 5, 6, 7, three batches: nothing joins
    assert drawn == [1] and m["rollout/partial_refills"] == 0 and m["rollout/partial_rounds"] == 2
    assert m["rollout/resumed_tokens"] == 2 + 4 and [r.index for r in recs] == [1, 3]


def _refill_lockstep(rank, world):
    # rank 0's run is short after the first check, rank 1's is not: both ranks take a batch at that check
    lengths = SHORT if rank == 0 else {**SHORT, 10: [8, 8], 11: [8, 8], 12: [8, 8], 13: [8, 8]}
    pr, eng, drawn = new("drop", 3), ScriptedEngine(lengths), []
    recs, _, m = run_step(pr, eng, records(0, 1, 2, 3) if rank == 0 else records(10, 11, 12, 13), 0,
                          more=_drawer(drawn))
    assert drawn == [1] and m["rollout/partial_refills"] == 1 and eng.calls == m["rollout/partial_rounds"]


def test_two_ranks_take_new_prompts_at_the_same_check():
    run_distributed(_refill_lockstep, 2)
