"""Multi-turn rollouts: tools and environments between the model's turns.

    rollout = MultiTurnRollout(cfg.rollout, tokenizer)        # None-free: only when cfg.rollout.multi_turn
    completions, metrics = rollout.generate(engine, records, sampling, budget)
    merge_trajectory_metrics(step_metrics, metrics)           # a step of several generate calls

One concept per module: tools.py (load tools, run calls with timeouts), parsers.py (tool calls in a
turn's text: hermes, llama3_json), templates/ (chat templates shipped for multi-turn, by name in
rollout.chat_template), environment.py (the Environment protocol; tools as an environment), bridge.py (the
tokens between turns, from the chat template), loop.py (the lockstep loop over a rank's
trajectories), deadline.py (a batch of calls into user code under one deadline), faults.py (user
code's faults: counted, logged once). Each returned Completion is a whole trajectory: its tokens, a mask with 1 on the
model's sampled tokens, rollout log-probs (0 on the bridges) and the environment's reward, if any.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from spmd_rl.errors import ConfigError
from spmd_rl.rollout.base import Completion, RolloutEngine, SamplingParams
from spmd_rl.rollout.multiturn.bridge import Bridge
from spmd_rl.rollout.multiturn.environment import TOOL_METRICS, Environment, StepResult, ToolEnvironment
from spmd_rl.rollout.multiturn.faults import FAULT_METRICS, FaultLog
from spmd_rl.rollout.multiturn.loop import (
    Setting,
    merge_trajectory_metrics,
    new_trajectories,
    run_lockstep,
    trajectory_metrics,
)
from spmd_rl.rollout.multiturn.parsers import PARSERS, CallError, ToolCall
from spmd_rl.rollout.multiturn.tools import ToolRunner, load_tools
from spmd_rl.runtime.distributed import all_gather_union
from spmd_rl.user_import import import_object

__all__ = ["MultiTurnRollout", "merge_trajectory_metrics", "StepResult", "Environment", "ToolCall", "CallError", "check_config"]


def load_parser(spec: str):
    if spec in PARSERS:
        return PARSERS[spec]()
    return import_object(spec, "rollout.tool_parser", ConfigError, "class")()


def load_environment_class(spec: str) -> type:
    cls = import_object(spec, "rollout.environment", ConfigError, "class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"rollout.environment = {spec!r}: {cls.__name__} has no {' or '.join(missing)} method; an "
                          "environment needs reset(row) and step(message) -> StepResult")
    return cls


def check_config(r) -> None:
    """Everything the run's multi-turn keys name can be loaded (RolloutConfig.check_multi_turn)."""
    if r.tools:
        load_tools(r.tools)
        load_parser(r.tool_parser)
    if r.environment:
        load_environment_class(r.environment)


class MultiTurnRollout:
    """Trajectories of several turns from a rollout engine, per `rollout.*` (RolloutConfig)."""

    def __init__(self, r, tokenizer):
        pool = ThreadPoolExecutor(max_workers=r.tool_pool_size, thread_name_prefix="spmd_rl-env")
        faults = FaultLog()
        self.runner = None
        if r.tools:
            tools = load_tools(r.tools)
            self.runner = ToolRunner(tools, r.tool_timeout, r.tool_pool_size)
            parser = load_parser(r.tool_parser)
            make_env, env_name = lambda: ToolEnvironment(self.runner, parser, faults), "ToolEnvironment"
            self.schemas = [t.schema for t in tools]
            self.count_keys = TOOL_METRICS + FAULT_METRICS
            step_timeout = None  # each call has its own timeout inside the step
        else:
            make_env, env_name = load_environment_class(r.environment), r.environment
            self.schemas = None
            self.count_keys = FAULT_METRICS
            step_timeout = r.tool_timeout
        self.bridge = Bridge(tokenizer, self.schemas, r.max_tool_response_tokens)
        self.setting = Setting(r.max_turns, self.bridge, pool, step_timeout, make_env, env_name, faults)

    def generate(self, engine: RolloutEngine, records: list, sampling: SamplingParams,
                 budget: int) -> tuple[list[list[Completion]], dict[str, float]]:
        """`sampling.n` trajectories per record (spmd_rl.data.prompts.PromptRecord), each within `budget`
        response tokens; and their metrics (per-rank means; the same keys on every rank).
        Collective: every rank calls it."""
        trajectories = new_trajectories(records, sampling)
        run_lockstep(engine, trajectories, sampling, budget, self.setting)
        completions = [t.completion() for t in trajectories]
        n = sampling.n
        env_keys = all_gather_union({k for t in trajectories for k in t.counts} - set(self.count_keys))
        return ([completions[i * n:(i + 1) * n] for i in range(len(records))],
                trajectory_metrics(trajectories, self.count_keys + tuple(env_keys)))

    def close(self) -> None:
        self.setting.pool.shutdown(wait=False, cancel_futures=True)
        if self.runner is not None:
            self.runner.close()
