"""Response lengths drawn from a profile, and what a long tail does to a generation call's wall.

Random weights never stop, so a benchmark that leaves every request the same length hides the tail
of a real RL run, where a step waits for its longest response while the GPU decodes a handful of
sequences. Each request gets its own length (EOS ignored, a per-request max_tokens) from a profile
(the forms: spmd_rl/rollout/length_profile.py; a training run's: rollout.length_profile).

`timed_run` steps a vllm.LLM by hand to record each request's finish time; `tail_report` turns
them into the generation wall, the share of the wall after 90% of the requests had finished, the
requests still running at 50/70/90% of the wall and tokens/s.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from spmd_rl.rollout.finish_times import running_at, tail_share  # noqa: E402  (the tail's figures: one place)
from spmd_rl.rollout.length_profile import Profile, draw  # noqa: E402,F401  (the profiles: one place)
from spmd_rl.rollout.length_profile import parse as parse_profile  # noqa: E402

DEFAULT = "lognormal:mean=1532,sigma=0.9,cap=8192"


def parse(spec: str) -> Profile:
    """A profile from its command-line form (spmd_rl/rollout/length_profile.py)."""
    return parse_profile(spec, "--length-profile")


def tail_report(start: float, finishes: list[float], lengths: list[int]) -> dict:
    wall = max(finishes) - start
    return {"wall_s": wall, "tokens": sum(lengths), "tokens_per_s": sum(lengths) / wall if wall > 0 else 0.0,
            "tail_share_after_90pct": tail_share(start, finishes),
            "running_at_50_70_90pct": [running_at(start, finishes, s) for s in (0.5, 0.7, 0.9)],
            "length_mean": sum(lengths) / len(lengths), "length_max": max(lengths)}


def timed_run(llm, prompts: list[list[int]], params: list) -> tuple[float, list[float]]:
    """Run one vllm.LLM request per prompt (`params`: its vllm.SamplingParams, each with its own
    max_tokens and ignore_eos) by stepping the engine, and return the start and each request's finish time."""
    engine = llm.llm_engine
    start = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    finishes = [0.0] * len(prompts)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finishes[int(out.request_id)] = time.perf_counter()
    return start, finishes
