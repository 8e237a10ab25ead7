"""The lockstep loop: every turn, one batched generate over all live trajectories of the rank.

Each prompt's `n` samples become n trajectories up front (n = 1 per request); every turn samples
with its own seed. Before each turn all ranks agree whether any trajectory anywhere is still live
(an all-reduce MAX over the world) and, until none is, every rank calls `engine.generate`, with an
empty list when its own trajectories are done: a tensor-parallel vLLM group gathers its ranks'
prompts in every call, so its ranks must make the same number of calls.

Budgets: one token budget for the whole response (data.max_response_length: the model's tokens and
the bridges), so each turn may generate what is left of it; a bridge that leaves no room for one
more model token ends the trajectory ("bridge_overflow"); rollout.max_turns caps the model's turns.
The environment steps of a turn run in parallel in a thread pool under one deadline
(rollout.tool_timeout for all of them, however many hang): a step that raises, is still running at
the deadline or returns a bad value ends its trajectory ("env_error" / "env_timeout"), and so does
an environment whose construction or reset failed, after the model's first turn. Each such fault
is counted and its first occurrence logged (faults.py).
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from spmd_rl.model.tokenizer import decode_response
from spmd_rl.rollout.base import Completion, RolloutEngine, SamplingParams
from spmd_rl.rollout.multiturn.bridge import Bridge, TemplateError
from spmd_rl.rollout.multiturn.deadline import Outcome, call_all
from spmd_rl.rollout.multiturn.environment import BadStepResult, Environment, check_step_result
from spmd_rl.rollout.multiturn.faults import FaultLog
from spmd_rl.runtime.distributed import all_reduce_max_int

STOP_REASONS = ("answer", "max_turns", "length", "bridge_overflow", "env_error", "env_timeout")
"""Why a trajectory ended: the episode was over ("answer": the model answered without a tool call,
or the environment said done), the turn cap, the token budget spent while generating, a bridge
that did not fit the budget, an environment that failed (raised, returned a bad value) or timed out."""


@dataclass
class Setting:
    """What every turn of a rank's loop uses."""

    max_turns: int
    bridge: Bridge
    pool: ThreadPoolExecutor
    """Runs the environments' resets and steps."""
    step_timeout: float | None
    """Seconds for all of a turn's steps together (None: no limit)."""
    make_env: Callable[[], Environment]
    env_name: str
    """The environment class, for the log."""
    faults: FaultLog


@dataclass
class Trajectory:
    prompt: list[int]
    row: dict[str, Any]
    """This sample's own copy of its data row (what `reset` got)."""
    env: Environment | None = None
    """None until started, and where construction or reset failed."""
    tokens: list[int] = field(default_factory=list)
    """The response region: model turns and the bridges between them."""
    mask: list[int] = field(default_factory=list)
    asks_logprobs: bool = True
    """Whether the engine gives this trajectory's log-probs (SamplingParams.logprobs_every, decided
    per prompt once: every turn of a trajectory asks, or none does)."""
    logprobs: list[float] = field(default_factory=list)
    last_turn: list[int] = field(default_factory=list)
    """The token ids of the model's latest turn."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation after the prompt: each model turn decoded as an assistant message, and the
    environment's messages that went into the sequence (what a reward model scores)."""
    routes: Any = None
    """The engine's routing of the latest turn (Completion.routes): it fed the prompt, every earlier
    turn and bridge, and this turn, so it covers the trajectory but the tokens after it (None: not
    given)."""
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
        self.routes = c.routes
        self.turns += 1

    def add_bridge(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def completion(self) -> Completion:
        return Completion(self.tokens, self.logprobs if self.asks_logprobs else None,
                          "stop" if self.stop == "answer" else "length", self.mask, self.reward, self.messages,
                          self.routes)


def turn_seed(seed: int, turn: int) -> int:
    """Turn 0 samples with the call's seed; later turns with seeds derived from it."""
    return (seed + turn * 1_000_033) % 2**31


def run_lockstep(engine: RolloutEngine, trajectories: list[Trajectory], sampling: SamplingParams, budget: int,
                 setting: Setting) -> None:
    """Run every trajectory to its end (collective: every rank calls it, with its own trajectories)."""
    start_episodes(trajectories, setting)
    turn = 0
    while all_reduce_max_int(sum(t.live for t in trajectories)) > 0:
        live = [t for t in trajectories if t.live]
        sp = dataclasses.replace(sampling, n=1, max_new_tokens=budget, seed=turn_seed(sampling.seed, turn))
        outs = engine.generate([t.prompt + t.tokens for t in live], sp, [budget - len(t.tokens) for t in live],
                               [t.asks_logprobs for t in live])
        stepping = []
        for t, (c,) in zip(live, outs):
            t.add_model_turn(c)
            t.messages.append(_assistant_message(t, setting.bridge.tokenizer))
            if c.finish_reason == "length":  # the turn was given all the budget left
                t.stop = "length"
            elif t.env is None:  # its environment failed to start (counted then)
                t.stop = "env_error"
            else:
                stepping.append(t)
        steps = [partial(t.env.step, dict(t.messages[-1])) for t in stepping]
        outcomes = call_all(setting.pool, steps, setting.step_timeout)
        for t, outcome in zip(stepping, outcomes):
            _after_step(t, outcome, budget, setting)
        turn += 1


def _assistant_message(t: Trajectory, tokenizer) -> dict[str, str]:
    """The model's latest turn as the environment's step gets it (decoded here, not in the pool)."""
    return {"role": "assistant", "content": decode_response(tokenizer, t.last_turn)}


def start_episodes(trajectories: list[Trajectory], setting: Setting) -> None:
    """Each trajectory's environment, made and reset to its row in the pool, all within one step
    timeout; one that raised or timed out stays None (its trajectory ends after the first turn)."""
    def start(row: dict[str, Any]) -> Environment:
        env = setting.make_env()
        env.reset(row)
        return env

    outcomes = call_all(setting.pool, [partial(start, t.row) for t in trajectories], setting.step_timeout)
    for t, o in zip(trajectories, outcomes):
        if o.late:
            _fault(t, setting, "reset_errors", f"reset did not return within rollout.tool_timeout = "
                                               f"{setting.step_timeout:g} s")
        elif o.error is not None:
            _fault(t, setting, "reset_errors", f"construction or reset raised {_describe(o.error)}")
        else:
            t.env = o.value


def _after_step(t: Trajectory, outcome: Outcome, budget: int, setting: Setting) -> None:
    result = _checked_result(t, outcome, setting)
    if result is None:
        return
    for k, v in result.metrics.items():
        t.counts[k] = t.counts.get(k, 0.0) + v
    if result.reward is not None:
        t.reward = result.reward
    if result.done:
        t.stop = "answer"
    elif t.turns >= setting.max_turns:
        t.stop = "max_turns"
    else:
        _add_messages(t, result.messages, budget, setting)


def _checked_result(t: Trajectory, outcome: Outcome, setting: Setting):
    """The step's StepResult, checked; None (the trajectory ended, the fault counted) where the step
    raised, ran past the turn's deadline or returned a bad value."""
    if outcome.late:
        t.stop = "env_timeout"
        how = "was still running" if outcome.started else "had not started (earlier steps held the pool's threads)"
        _fault(t, setting, "step_timeouts", f"step {how} at the turn's deadline, rollout.tool_timeout = "
                                            f"{setting.step_timeout:g} s")
        return None
    if outcome.error is not None:
        t.stop = "env_error"
        _fault(t, setting, "step_errors", f"step raised {_describe(outcome.error)}")
        return None
    try:
        result, dropped = check_step_result(outcome.value, setting.env_name)
    except BadStepResult as e:
        t.stop = "env_error"
        _fault(t, setting, "bad_values", str(e))
        return None
    for problem in dropped:
        _fault(t, setting, "bad_values", problem)
    return result


def _add_messages(t: Trajectory, messages: list[dict[str, Any]], budget: int, setting: Setting) -> None:
    """The bridge of the step's messages, where the budget leaves room for a model token after it."""
    special = setting.bridge.special_text(messages)
    if special:
        _fault(t, setting, "special_text", f"the step's messages hold special-token text {special[0]!r}",
               len(special))
    try:
        ids = setting.bridge.tokens(messages, t.tokens[-1] if t.tokens else None)
    except TemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - the chat template refused the messages (a role it does not know, ...)
        t.stop = "env_error"
        _fault(t, setting, "bad_values", f"the chat template cannot render the step's messages: {_describe(e)}")
        return
    if len(t.tokens) + len(ids) + 1 > budget:  # no room left for a model token after it
        t.stop = "bridge_overflow"
    else:
        t.add_bridge(ids)
        t.messages += [dict(m) for m in messages]


def _fault(t: Trajectory, setting: Setting, kind: str, detail: str, count: int = 1) -> None:
    t.counts[kind] = t.counts.get(kind, 0.0) + count
    setting.faults.report(kind, setting.env_name, t.row.get("index"), detail)


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


TRAJECTORIES = "multiturn/trajectories"
"""The metric counting the trajectories the other multiturn/* metrics are means over."""


def trajectory_metrics(trajectories: list[Trajectory], count_keys: tuple[str, ...]) -> dict[str, float]:
    """Per-rank means over the trajectories (the trainer averages them over ranks): turns, the
    counts of `count_keys` per trajectory (the environment's metrics, faults), the share of each
    stop reason; and how many there were."""
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
    keys = set(new) | {k for k in into if k.startswith("multiturn/")}  # a metric one call lacks is 0 there
    for key in keys - {TRAJECTORIES}:
        value = new.get(key, 0.0)
        into[key] = (into.get(key, 0.0) * had + value * more) / total if total else value
    into[TRAJECTORIES] = total


def new_trajectories(records: list, sampling: SamplingParams) -> list[Trajectory]:
    """sampling.n trajectories per record (PromptRecord), consecutive, each with its own copy of the
    record's row (`sample`: which of the n it is); those of the prompts that `sampling.asks_logprobs`
    picks get the engine's log-probs. Their environments start in run_lockstep."""
    out = []
    for rec, asks in zip(records, sampling.asks_logprobs(len(records))):
        for sample in range(sampling.n):
            row = {**dataclasses.asdict(rec), "sample": sample}  # asdict copies: each sample its own row
            out.append(Trajectory(list(rec.prompt_ids), row, asks_logprobs=asks))
    return out
