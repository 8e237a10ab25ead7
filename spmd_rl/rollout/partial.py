"""Partial rollouts: a step's generation stops once enough prompt groups are complete; the rest carry over.

With `rollout.partial_rollouts` on, a step does not wait for its longest response. Each rank keeps a
pool of prompt groups in flight: the groups carried over from earlier steps (oldest first), then the
step's new prompts. Every unfinished response of the pool goes into one engine run a step, carried
groups first (a carried response is resumed as a new request whose prompt is prompt + its tokens so
far, with the tokens it has left; vLLM rebuilds its KV cache by prefill, once a step). The run goes on
in stretches of `rollout.partial_chunk_tokens` engine steps (tokens per running response); after each,
the ranks agree, by counts alone, whether every rank has its batch: the step's prompts per rank in
complete groups (all n samples done: GRPO's advantages need the whole group), and, under stale_policy
"wait", every group at the staleness bound complete. Then the run stops: the unfinished responses keep
their tokens and go on next step. Never by clocks: in lockstep SPMD every rank (and tensor-parallel
group) must make the same calls.

vLLM's engine keeps its requests running between the checks (`VLLMEngine.start`: a streamed run,
spmd_rl/rollout/vllm/streamed.py), so the engine stays full of work until the cut. An engine without a
streamed run (the HF engine) runs `Rounds`: each stretch one generate call that resumes every unfinished
response anew.

Every response token keeps the policy version that sampled it (the number of optimizer steps behind
the weights it was sampled with) and its behaviour log-prob under those weights: the rollout log-probs
that rollout correction (spmd_rl/algo/rollout_correction.py, algorithm.rollout_is / rollout_mask)
compares with the current actor. A group trains at most `rollout.max_staleness` versions after its
first token: "drop" drops a group that would be older (counted in rollout/stale_dropped), "wait"
finishes a group at the bound within its step. A group's age counts from its first token (a prompt
drawn but not yet started does not age). Groups train oldest first, so long responses are not
starved.

The pool holds about two steps' prompts: the first step draws two batches of prompts, later steps one
(more where drops left a rank short), the same number on every rank. Within a step it takes more
(over-sampling, `rollout.partial_pool_batches`): when the run has fewer unfinished responses than one
batch has (the engine running short, say while the step waits for a group at the staleness bound), a
batch of new prompts joins the running run, on every rank at the same check, while the pool holds at
most that many batches. The engine keeps decoding tokens that later steps train instead of idling.

A checkpoint does not hold the carried groups: a save drops them (rollout/dropped_at_save), in a run
that goes on as in one resumed from it, so both continue alike.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch

from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.runtime.distributed import all_reduce_sum

CHECK_EVERY = 64
"""rollout.partial_chunk_tokens = 0: the ranks check the cut every this many engine steps, or every
quarter of data.max_response_length where that is fewer. A check is one all-reduce of a flag; the
engine decodes on past the cut by up to this many steps, whose tokens carry over."""


@dataclass
class Response:
    """One sample of a group, as far as it got: its tokens, their behaviour log-probs and versions."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    """"" while it runs; then "stop" or "length" (Completion.finish_reason)."""
    routes: torch.Tensor | None = None
    """A mixture-of-experts engine's routing (Completion.routes) of its last engine call: that call
    ran the whole row so far (the prompt and every earlier token, prefilled again)."""

    def completion(self) -> Completion:
        return Completion(list(self.tokens), list(self.logprobs), self.finish_reason, routes=self.routes)


@dataclass
class Group:
    """A prompt and its n responses."""

    record: object  # data.prompts.PromptRecord
    responses: list[Response]
    max_len: int
    """Its responses' token limit: data.max_response_length, or the length rollout.length_profile drew."""

    def born(self, version: int) -> int:
        """The policy version of its first token (`version`, the current one, before it has any)."""
        return min((r.versions[0] for r in self.responses if r.versions), default=version)

    @property
    def complete(self) -> bool:
        return all(r.finish_reason for r in self.responses)


class PartialRollouts:
    """One rank's groups in flight and the step's cut (the module docstring)."""

    def __init__(self, n: int, per_rank: int, max_response_length: int, chunk_tokens: int, max_staleness: int,
                 stale_policy: str, device: torch.device, pool_batches: int = 2):
        self.n, self.per_rank, self.max_len = n, per_rank, max_response_length
        self.chunk, self.max_staleness, self.stale_policy = chunk_tokens, max_staleness, stale_policy
        self.device, self.pool_batches = device, pool_batches
        self.carried: list[Group] = []
        self.dropped_at_save = 0

    def batches_to_draw(self) -> int:
        """How many batches of new prompts this step draws: enough to bring the pool of the rank with
        the fewest carried groups to two batches (collective: every rank draws the same number)."""
        short = torch.tensor([max(0, 2 * self.per_rank - len(self.carried))], dtype=torch.float64, device=self.device)
        short = int(all_reduce_sum(short, op=torch.distributed.ReduceOp.MAX).item())
        return max(1, -(-short // self.per_rank))

    def drop_all(self) -> None:
        """At a checkpoint: the carried groups are not saved."""
        self.dropped_at_save += len(self.carried)
        self.carried = []

    def step(self, engine, records: list, version: int, sampling: Callable[[int], SamplingParams],
             limits: list[int] | None = None, more: Callable[[int], tuple[list, list[int] | None]] | None = None
             ) -> tuple[list, list[list[Completion]], dict[str, float]]:
        """Generate until every rank has `per_rank` complete groups (collective), and return this
        step's records, their completions (behaviour log-probs per token) and the metrics, reduced over
        ranks. `version`: the policy version of the engine's weights now; `sampling(k)`: the sampling
        settings of the step's run (k = 0; its k-th refill: k; Rounds: its k-th generate call, for the
        seed); `limits`: each new record's token limit (default data.max_response_length); `more(k)`:
        the step's k-th refill (k = 1, 2, ...), a batch of new records and their limits (None: no refill)."""
        pool, dropped = [], 0
        for g in sorted(self.carried, key=lambda g: g.born(version)):  # oldest first
            if version - g.born(version) > self.max_staleness:  # "drop"; "wait" only where more groups
                # reached the bound in one step than a step trains (counted alike: rollout/stale_dropped)
                dropped += 1
            else:
                pool.append(g)
        pool += self._new_groups(records, limits)
        resumed = sum(len(self.resume_prompt(g, r))  # what the engine prefills again to go on with them
                      for g in pool for r in g.responses if r.tokens and not r.finish_reason)
        run, running, checks, refills = None, [], 0, 0
        while True:
            stop, refill = self._check(pool, version, more is not None)
            if stop:
                break
            if run is None:  # one run a step: every unfinished response, carried groups first
                running = [(g, r) for g in pool for r in g.responses if not r.finish_reason]
                run = self._start(engine, running, sampling)
            elif refill:  # the engine runs short: a batch of new prompts joins the run
                refills += 1
                groups = self._new_groups(*more(refills))
                pool += groups
                joining = [(g, r) for g in groups for r in g.responses]
                running += joining
                self._join(run, joining, sampling(refills))
            for i, c in run.advance(self.chunk):
                self._extend(*running[i], c, version)
            checks += 1
        if run is not None:
            for i, c in run.stop():  # unfinished: their tokens so far carry over
                self._extend(*running[i], c, version)
        done = [g for g in pool if g.complete][:self.per_rank]  # oldest first: pool order
        chosen = set(map(id, done))
        self.carried = [g for g in pool if id(g) not in chosen]
        metrics = self._metrics(done, version, dropped, checks, refills, resumed if run is not None else 0)
        return [g.record for g in done], [[r.completion() for r in g.responses] for g in done], metrics

    def _new_groups(self, records: list, limits: list[int] | None) -> list[Group]:
        """Groups of new prompts, not started: each with its token limit (default data.max_response_length)."""
        return [Group(rec, [Response() for _ in range(self.n)], limit)
                for rec, limit in zip(records, limits or [self.max_len] * len(records))]

    def _must_finish(self, g: Group, version: int) -> bool:
        return self.stale_policy == "wait" and version - g.born(version) >= self.max_staleness

    def _check(self, pool: list[Group], version: int, can_refill: bool) -> tuple[bool, bool]:
        """(stop, refill), the same on every rank (collective: one all-reduce of three flags). Stop once
        every rank has its batch; a step whose pool already holds its batch complete generates nothing
        (its new prompts start next step). Refill where a rank runs fewer unfinished responses than a
        batch has and every rank's pool has room for one more batch (rollout.partial_pool_batches)."""
        ready = sum(g.complete for g in pool) >= self.per_rank and all(
            g.complete for g in pool if self._must_finish(g, version))
        running = any(not g.complete for g in pool)
        unfinished = sum(not r.finish_reason for g in pool for r in g.responses)
        room = can_refill and len(pool) + self.per_rank <= self.pool_batches * self.per_rank
        flags = torch.tensor([0.0 if (ready or not running) else 1.0, float(unfinished < self.n * self.per_rank),
                              0.0 if room else 1.0], dtype=torch.float64, device=self.device)
        going, short, full = all_reduce_sum(flags, op=torch.distributed.ReduceOp.MAX).tolist()
        return going == 0.0, going == 1.0 and short == 1.0 and full == 0.0

    def resume_prompt(self, g: Group, r: Response) -> list[int]:
        """What the engine continues: the prompt and the response's tokens so far."""
        return list(g.record.prompt_ids) + r.tokens

    def _start(self, engine, running: list[tuple[Group, Response]], sampling: Callable[[int], SamplingParams]):
        """The step's engine run of `running` (each to its group's token limit): the engine's own
        streamed run where it has one (`start`: vLLM), else `Rounds` of generate calls. Every rank
        starts one, also with nothing to run (a tensor-parallel group gathers)."""
        prompts, limits = self._requests(running)
        if hasattr(engine, "start"):
            return engine.start(prompts, self._one(sampling(0)), max_new_tokens=limits,
                                asks_logprobs=[True] * len(prompts))
        return Rounds(engine, prompts, limits, sampling)

    def _join(self, run, joining: list[tuple[Group, Response]], sampling: SamplingParams) -> None:
        """New groups' responses into the running run (every rank at the same check: a tensor-parallel
        group gathers), after its earlier requests: their indices follow on."""
        prompts, limits = self._requests(joining)
        run.add(prompts, self._one(sampling), max_new_tokens=limits, asks_logprobs=[True] * len(prompts))

    def _requests(self, responses: list[tuple[Group, Response]]) -> tuple[list[list[int]], list[int]]:
        """The engine requests that go on with `responses`: each one's prompt so far and the tokens it has left."""
        return ([self.resume_prompt(g, r) for g, r in responses],
                [g.max_len - len(r.tokens) for g, r in responses])

    def _one(self, sampling: SamplingParams) -> SamplingParams:
        """A streamed run's sampling: one completion a request, every token's log-prob."""
        return dataclasses.replace(sampling, n=1, max_new_tokens=self.max_len, logprobs_every=1)

    @staticmethod
    def _extend(g: Group, r: Response, c: Completion, version: int) -> None:
        """A response's tokens from this step's run: sampled by the weights of `version`; finished
        when the run finished it ("stop", or "length" at its group's limit)."""
        r.tokens += c.token_ids
        r.logprobs += c.logprobs
        r.versions += [version] * len(c.token_ids)
        if c.finish_reason:
            r.routes = c.routes  # the whole row's, from its last run
            r.finish_reason = c.finish_reason

    def _metrics(self, done: list[Group], version: int, dropped: int, rounds: int, refills: int,
                 resumed: int) -> dict[str, float]:
        """rollout/staleness_mean and _max over the trained tokens (versions behind the weights that
        train them), rollout/staleness_share_k (k = 0..max_staleness: a histogram), stale_dropped,
        dropped_at_save, carried_groups and carried_tokens (the groups after the cut and the response tokens
        they have sampled so far, summed over ranks), partial_rounds (the checks of
        the cut: stretches of partial_chunk_tokens engine steps), partial_refills (batches of new prompts
        that joined the run, per rank), resumed_tokens (the prompts and tokens so far of the carried
        responses the run went on with, which the engine prefilled again; summed over ranks)."""
        ages = torch.tensor([version - v for g in done for r in g.responses for v in r.versions], dtype=torch.float64)
        hist = [float((ages == k).sum()) for k in range(self.max_staleness + 1)]
        carried_tokens = sum(len(r.tokens) for g in self.carried for r in g.responses)
        sums = torch.tensor([float(ages.sum()), float(len(ages)), dropped, self.dropped_at_save, len(self.carried),
                             resumed, carried_tokens, *hist], dtype=torch.float64, device=self.device)
        sums = all_reduce_sum(sums)
        top = all_reduce_sum(torch.tensor([float(ages.max()) if len(ages) else 0.0], dtype=torch.float64,
                                          device=self.device), op=torch.distributed.ReduceOp.MAX)
        self.dropped_at_save = 0
        tokens = max(sums[1].item(), 1.0)
        out = {"rollout/staleness_mean": sums[0].item() / tokens, "rollout/staleness_max": top.item(),
               "rollout/stale_dropped": sums[2].item(), "rollout/dropped_at_save": sums[3].item(),
               "rollout/carried_groups": sums[4].item(), "rollout/partial_rounds": float(rounds),
               "rollout/partial_refills": float(refills), "rollout/resumed_tokens": sums[5].item(),
               "rollout/carried_tokens": sums[6].item()}
        out.update({f"rollout/staleness_share_{k}": sums[7 + k].item() / tokens for k in range(len(hist))})
        return out


class Rounds:
    """An engine run (spmd_rl/rollout/base.py, EngineRun) made of `generate` calls, for an engine
    without its own (the HF engine): each `advance(steps)` is one call that resumes every unfinished
    request as a new one (prompt + its tokens so far) for up to `steps` more tokens."""

    def __init__(self, engine, prompts: list[list[int]], limits: list[int], sampling: Callable[[int], SamplingParams]):
        self.engine, self.prompts, self.limits, self.sampling = engine, prompts, limits, sampling
        self.out = [Completion([], [], "") for _ in prompts]
        self.calls = 0

    def advance(self, steps: int) -> list[tuple[int, Completion]]:
        todo = [i for i, c in enumerate(self.out) if not c.finish_reason]
        one = dataclasses.replace(self.sampling(self.calls), n=1, max_new_tokens=steps, logprobs_every=1)
        self.calls += 1
        outs = self.engine.generate([self.prompts[i] + self.out[i].token_ids for i in todo], one,
                                    max_new_tokens=[min(steps, self.limits[i] - len(self.out[i].token_ids))
                                                    for i in todo],
                                    asks_logprobs=[True] * len(todo))
        finished = []
        for i, (c,) in zip(todo, outs):
            o = self.out[i]
            o.token_ids += c.token_ids
            o.logprobs += c.logprobs
            if c.finish_reason == "stop" or len(o.token_ids) >= self.limits[i]:
                o.finish_reason, o.routes = c.finish_reason, c.routes
                finished.append((i, o.copy()))
        return finished

    def add(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
            asks_logprobs: list[bool] | None = None) -> None:
        """More requests, resumed with the others from the next call on (their indices follow on;
        every call's sampling comes from the run's own `sampling`)."""
        self.prompts += prompts
        self.limits += max_new_tokens or [sampling.max_new_tokens] * len(prompts)
        self.out += [Completion([], [], "") for _ in prompts]

    def stop(self) -> list[tuple[int, Completion]]:
        return [(i, o.copy()) for i, o in enumerate(self.out) if not o.finish_reason]


def from_config(cfg, world_size: int, device: torch.device) -> PartialRollouts | None:
    """The trainer's partial rollouts (rollout.partial_rollouts), or None when off."""
    r = cfg.rollout
    if not r.partial_rollouts:
        return None
    longest = cfg.data.max_response_length
    return PartialRollouts(r.n, cfg.data.train_batch_size // world_size, longest,
                           r.partial_chunk_tokens or min(CHECK_EVERY, max(1, longest // 4)), r.max_staleness,
                           r.stale_policy, device, r.partial_pool_batches)
