"""Partial rollouts against synchronous steps on a modelled engine, without a GPU.

The project's own partial rollouts (spmd_rl/rollout/partial.py: the cut, the carried groups, the
staleness bound, over-sampling) run over a modelled vLLM engine: each decode step costs
`--step-ms + --seq-ms x running sequences` (+ `--logprob-us` for each that asks for its tokens' log-probs,
as every partial rollout does: the CPU's work on them), a request's prefill `--prefill-us` per token (a carried
response prefills its prompt and its tokens so far again), at most `--max-running` at once, the rest
queued. Every response runs to the length the profile drew for its prompt (as `rollout.length_profile`
makes random weights do). Synchronous steps run each step's prompts to their end on the same engine.

Prints, for each pool size (rollout.partial_pool_batches) and staleness bound (rollout.max_staleness):
the generate seconds per trained token against the synchronous steps', the mean and longest step's
generate seconds, and the mean staleness. A model to choose settings with and to hold a GPU
measurement against, not a measurement: fit --step-ms and --seq-ms to a run's steps (engine steps and
tokens against generate seconds; docs/performance-details.md, "Long tails at 7B").

    python scripts/bench/simulate_partial.py --steps 40 --pools 2,3,4 --bounds 2
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from spmd_rl.data.prompts import PromptRecord  # noqa: E402
from spmd_rl.rollout import length_profile  # noqa: E402
from spmd_rl.rollout.base import Completion, SamplingParams  # noqa: E402
from spmd_rl.rollout.partial import PartialRollouts  # noqa: E402


class Engine:
    """The modelled engine: a clock, advanced by its runs."""

    def __init__(self, args):
        self.args, self.seconds = args, 0.0

    def start(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None) -> "Run":
        return Run(self, prompts, max_new_tokens, asks_logprobs)


class Run:
    """The EngineRun protocol (spmd_rl/rollout/base.py) on the modelled engine."""

    def __init__(self, engine: Engine, prompts: list[list[int]], limits: list[int], asks: list[bool] | None):
        self.engine = engine
        self.prompts, self.limits, self.tokens = [], [], []
        self.asks: list[bool] = []
        self.finished: list[bool] = []
        self.waiting: collections.deque[int] = collections.deque()
        self.running: list[int] = []
        self.add(prompts, None, limits, asks)

    def add(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None) -> None:
        for prompt, limit, ask in zip(prompts, max_new_tokens, asks_logprobs or [False] * len(prompts)):
            self.waiting.append(len(self.prompts))
            self.prompts.append(prompt)
            self.limits.append(limit)
            self.asks.append(ask)
            self.tokens.append(0)
            self.finished.append(False)

    def advance(self, steps: int) -> list[tuple[int, Completion]]:
        a, done = self.engine.args, []
        for _ in range(steps):
            while self.waiting and len(self.running) < a.max_running:  # admitted: prefilled
                i = self.waiting.popleft()
                self.running.append(i)
                self.engine.seconds += a.prefill_us * 1e-6 * len(self.prompts[i])
            if not self.running:
                break
            asking = sum(self.asks[i] for i in self.running)
            self.engine.seconds += (a.step_ms + a.seq_ms * len(self.running)) * 1e-3 + a.logprob_us * 1e-6 * asking
            still = []
            for i in self.running:
                self.tokens[i] += 1
                if self.tokens[i] >= self.limits[i]:
                    self.finished[i] = True
                    done.append((i, self._completion(i, "length")))
                else:
                    still.append(i)
            self.running = still
        return done

    def stop(self) -> list[tuple[int, Completion]]:
        return [(i, self._completion(i, "")) for i in range(len(self.prompts)) if not self.finished[i]]

    def _completion(self, i: int, reason: str) -> Completion:
        return Completion([7] * self.tokens[i], [0.0] * self.tokens[i], reason)


def prompt_batch(args, profile, k: int) -> tuple[list[PromptRecord], list[int]]:
    """The k-th batch of prompts (one rank's) and each prompt's drawn length, the same in every run."""
    records = [PromptRecord(k * args.prompts + j, [1] * args.prompt_tokens, "sim", "0") for j in range(args.prompts)]
    return records, [min(n, args.max_response_length) for n in length_profile.draw(profile, args.prompts, seed=k)]


def synchronous(args, profile) -> tuple[float, int, list[float]]:
    """Generate seconds, trained tokens and each step's generate seconds of synchronous steps."""
    engine, tokens, steps = Engine(args), 0, []
    for k in range(args.steps):
        records, lengths = prompt_batch(args, profile, k)
        before = engine.seconds
        run = engine.start([r.prompt_ids for r in records for _ in range(args.samples)], None,
                           [n for n in lengths for _ in range(args.samples)])
        while run.running or run.waiting:
            run.advance(args.chunk)
        tokens += sum(lengths) * args.samples
        steps.append(engine.seconds - before)
    return engine.seconds, tokens, steps


def partial(args, profile, pool: int, bound: int) -> tuple[float, int, list[float], list[float]]:
    """The same with partial rollouts: generate seconds, trained tokens, each step's seconds and staleness."""
    engine = Engine(args)
    pr = PartialRollouts(args.samples, args.prompts, args.max_response_length, args.chunk, bound, args.stale_policy,
                         torch.device("cpu"), pool)
    drawn, tokens, steps, staleness = 0, 0, [], []

    def next_batch(_k: int = 0):
        nonlocal drawn
        drawn += 1
        return prompt_batch(args, profile, drawn - 1)

    for version in range(args.steps):
        records, lengths = [], []
        for _ in range(pr.batches_to_draw()):
            r, n = next_batch()
            records, lengths = records + r, lengths + n
        before = engine.seconds
        _, completions, m = pr.step(engine, records, version, lambda k: SamplingParams(seed=k), lengths, next_batch)
        tokens += sum(len(c.token_ids) for group in completions for c in group)
        steps.append(engine.seconds - before)
        staleness.append(m["rollout/staleness_mean"])
    return engine.seconds, tokens, steps, staleness


def rows(args) -> list[str]:
    profile = length_profile.parse(args.profile)
    seconds, tokens, steps = synchronous(args, profile)
    base = seconds / tokens
    out = ["| run | generate s / M tokens | against synchronous | step mean s | longest step s | staleness mean |",
           "|---|---|---|---|---|---|",
           f"| synchronous | {base * 1e6:.1f} | 1.00x | {seconds / len(steps):.1f} | {max(steps):.1f} | 0 |"]
    for pool in args.pools:
        for bound in args.bounds:
            s, t, per_step, stale = partial(args, profile, pool, bound)
            out.append(f"| partial, pool {pool}, bound {bound} | {s / t * 1e6:.1f} | {s / t / base:.2f}x | "
                       f"{s / len(per_step):.1f} | {max(per_step):.1f} | {sum(stale) / len(stale):.2f} |")
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="lognormal:mean=1532,sigma=0.9,cap=8192", help="rollout.length_profile")
    ap.add_argument("--steps", type=int, default=40, help="steps of each run")
    ap.add_argument("--prompts", type=int, default=32, help="prompts a step (one rank)")
    ap.add_argument("--samples", type=int, default=8, help="responses a prompt (rollout.n)")
    ap.add_argument("--prompt-tokens", type=int, default=70, help="tokens of every prompt")
    ap.add_argument("--max-response-length", type=int, default=8192, help="data.max_response_length")
    ap.add_argument("--pools", type=ints, default=[2, 3, 4], help="rollout.partial_pool_batches values")
    ap.add_argument("--bounds", type=ints, default=[2], help="rollout.max_staleness values")
    ap.add_argument("--stale-policy", default="wait", choices=["wait", "drop"], help="rollout.stale_policy")
    ap.add_argument("--chunk", type=int, default=64, help="engine steps between the cut's checks")
    ap.add_argument("--step-ms", type=float, default=5.6, help="an engine step's fixed milliseconds")
    ap.add_argument("--seq-ms", type=float, default=0.044, help="an engine step's milliseconds per running sequence")
    ap.add_argument("--prefill-us", type=float, default=25.0, help="microseconds per prefilled token")
    ap.add_argument("--logprob-us", type=float, default=0.0,
                    help="an engine step's microseconds per running sequence that asks for log-probs")
    ap.add_argument("--max-running", type=int, default=512, help="sequences the engine runs at once")
    print("\n".join(rows(ap.parse_args(argv))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
