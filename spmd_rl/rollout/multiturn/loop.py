"""The lockstep loop: every turn, one batched generate over all live trajectories of the rank.

Each prompt's `n` samples become n trajectories up front (n = 1 per request); every turn samples
with its own seed. Before each turn all ranks agree whether any trajectory anywhere is still live
(an all-reduce MAX over the world) and, until none is, every rank calls `engine.generate`, with an
empty list when its own trajectories are done: a tensor-parallel vLLM group gathers its ranks'
prompts in every call, so its ranks must make the same number of calls.

Budgets: one token budget for the whole response (data.max_response_length: the model's tokens and
the bridges), so each turn may generate what is left of it; a bridge that leaves no room for one
more model token ends the trajectory ("bridge_overflow"); rollout.max_turns caps the model's turns.
The environment steps of a turn run in parallel in a thread pool (a step that raises or passes
rollout.tool_timeout ends its trajectory: "env_error" / "env_timeout", counted).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from spmd_rl.runtime.distributed import all_reduce_max_int
from spmd_rl.rollout.base import Completion, RolloutEngine, SamplingParams
from spmd_rl.rollout.multiturn.bridge import Bridge
from spmd_rl.rollout.multiturn.environment import Environment, StepResult
from spmd_rl.model.tokenizer import decode_response

STOP_REASONS = ("answer", "max_turns", "length", "bridge_overflow", "env_error", "env_timeout")
"""Why a trajectory ended: the episode was over ("answer": the model answered without a tool call,
or the environment said done), the turn cap, the token budget spent while generating, a bridge
that did not fit the budget, an environment step that raised or timed out."""


@dataclass
class Trajectory:
    prompt: list[int]
    env: Environment
    tokens: list[int] = field(default_factory=list)
    """The response region: model turns and the bridges between them."""
    mask: list[int] = field(default_factory=list)
    asks_logprobs: bool = True
    """Whether the engine gives this trajectory's log-probs (SamplingParams.logprobs_every, decided
    per prompt once: every turn of a trajectory asks, or none does)."""
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    """The token ids of the model's latest turn."""
    turns: int = 0
    stop: str = ""
    reward: float | None = None
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return not self.stop

    def add_model_turn(self, c: Completion) -> None:
        self.tokens += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += c.logprobs if c.logprobs is not None else [0.0] * len(c.token_ids)
        self.last_turn = list(c.token_ids)
        self.turns += 1

    def add_bridge(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def completion(self) -> Completion:
        return Completion(self.tokens, self.logprobs if self.asks_logprobs else None,
                          "stop" if self.stop == "answer" else "length", self.mask, self.reward)


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 samples with the call's seed; later turns with seeds derived from it."""
    return (seed + turn * 1_000_033) % 2**31


def run_lockstep(engine: RolloutEngine, trajectories: list[Trajectory], sampling: SamplingParams, budget: int,
                 max_turns: int, bridge: Bridge, pool: ThreadPoolExecutor, step_timeout: float | None) -> None:
    """Run every trajectory to its end (collective: every rank calls it, with its own trajectories)."""
    turn = 0
    while all_reduce_max_int(sum(t.live for t in trajectories)) > 0:
        live = [t for t in trajectories if t.live]
        sp = dataclasses.replace(sampling, n=1, max_new_tokens=budget, seed=turn_seed(sampling.seed, turn))
        outs = engine.generate([t.prompt + t.tokens for t in live], sp, [budget - len(t.tokens) for t in live],
                               [t.asks_logprobs for t in live])
        stepping = []
        for t, (c,) in zip(live, outs):
            t.add_model_turn(c)
            if c.finish_reason == "length":  # the turn was given all the budget left
                t.stop = "length"
            else:
                stepping.append(t)
        futures = [pool.submit(t.env.step, {"role": "assistant",
                                            "content": decode_response(bridge.tokenizer, t.last_turn)})
                   for t in stepping]
        for t, future in zip(stepping, futures):
            _after_step(t, future, step_timeout, max_turns, budget, bridge)
        turn += 1


def _after_step(t: Trajectory, future, timeout: float | None, max_turns: int, budget: int, bridge: Bridge) -> None:
    try:
        result: StepResult = future.result(timeout=timeout)
    except FutureTimeout:
        t.stop = "env_timeout"
        return
    except Exception:  # the environment's step raised: the trajectory ends, counted
        t.stop = "env_error"
        return
    for k, v in result.metrics.items():
        t.counts[k] = t.counts.get(k, 0.0) + float(v)
    if result.reward is not None:
        t.reward = float(result.reward)
    if result.done:
        t.stop = "answer"
    elif t.turns >= max_turns:
        t.stop = "max_turns"
    else:
        ids = bridge.tokens(result.messages, t.tokens[-1] if t.tokens else None)
        if len(t.tokens) + len(ids) + 1 > budget:  # no room left for a model token after it
            t.stop = "bridge_overflow"
        else:
            t.add_bridge(ids)


TRAJECTORIES = "multiturn/trajectories"
"""The metric counting the trajectories the other multiturn/* metrics are means over."""


def trajectory_metrics(trajectories: list[Trajectory], count_keys: tuple[str, ...]) -> dict[str, float]:
    """Per-rank means over the trajectories (the trainer averages them over ranks): turns, the
    environment's counts per trajectory, the share of each stop reason; and how many there were."""
    n = max(len(trajectories), 1)
    out = {TRAJECTORIES: float(len(trajectories)), "multiturn/turns_mean": sum(t.turns for t in trajectories) / n}
    out.update({f"multiturn/{k}_mean": sum(t.counts.get(k, 0.0) for t in trajectories) / n for k in count_keys})
    out.update({f"multiturn/stop_{r}": sum(t.stop == r for t in trajectories) / n for r in STOP_REASONS})
    return out


def merge_trajectory_metrics(into: dict[str, float], new: dict[str, float]) -> None:
    """Add one generate call's `trajectory_metrics` to those of the step's earlier calls in `into`
    (dynamic sampling's rounds): each mean weighted by its call's trajectories, the counts added,
    so the step's metrics are those of all its trajectories."""
    had, more = into.get(TRAJECTORIES, 0.0), new[TRAJECTORIES]
    total = had + more
    for key, value in new.items():
        if key != TRAJECTORIES:
            into[key] = (into.get(key, 0.0) * had + value * more) / total if total else value
    into[TRAJECTORIES] = total


def new_trajectories(prompts: list[list[int]], rows: list[dict[str, Any]], sampling: SamplingParams,
                     make_env: Callable[[], Environment]) -> list[Trajectory]:
    """sampling.n trajectories per prompt, consecutive, each with its own environment, reset to its
    row; those of the prompts that `sampling.asks_logprobs` picks get the engine's log-probs."""
    out = []
    for prompt, row, asks in zip(prompts, rows, sampling.asks_logprobs(len(prompts))):
        for _ in range(sampling.n):
            env = make_env()
            env.reset(row)
            out.append(Trajectory(list(prompt), env, asks_logprobs=asks))
    return out
