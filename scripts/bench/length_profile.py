"""Response lengths drawn from a profile, and what a long tail does to a generation call's wall.

Random weights never stop, so a benchmark that leaves every request the same length hides the tail
of a real RL run, where a step waits for its longest response while the GPU decodes a handful of
sequences. Each request gets its own length (EOS ignored, a per-request max_tokens) from a profile:

    lognormal:mean=M,sigma=S,cap=C   a lognormal of mean M (before the cap), log-space sigma S, cut at C
    uniform:N                        every request N tokens
    hist:FILE                        a JSON histogram {"edges": [e0, ..., ek], "counts": [c0, ..., ck-1]}
                                     (a real run's response lengths): a bin by its count, then a length
                                     uniform in [e_i, e_i+1)

`timed_run` steps a vllm.LLM by hand to record each request's finish time; `tail_report` turns
them into the generation wall, the share of the wall after 90% of the requests had finished, the
requests still running at 50/70/90% of the wall and tokens/s.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field

DEFAULT = "lognormal:mean=1532,sigma=0.9,cap=8192"


@dataclass
class Profile:
    kind: str  # "lognormal", "uniform" or "hist"
    mean: float = 0.0
    sigma: float = 0.0
    cap: int = 0
    edges: list[int] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    @property
    def mu(self) -> float:
        """The lognormal's log-space mean: E[X] = exp(mu + sigma^2 / 2)."""
        return math.log(self.mean) - self.sigma ** 2 / 2


def parse(spec: str) -> Profile:
    """A profile from its command-line form (the module docstring); ValueError names what is wrong."""
    kind, _, rest = spec.partition(":")
    if kind == "uniform":
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"--length-profile {spec!r}: uniform takes a positive length, e.g. uniform:512")
        return Profile("uniform", mean=int(rest), cap=int(rest))
    if kind == "lognormal":
        try:
            kv = {k: float(v) for k, v in (item.split("=") for item in rest.split(","))}
        except ValueError:
            kv = {}
        if set(kv) != {"mean", "sigma", "cap"} or min(kv.values()) <= 0:
            raise ValueError(f"--length-profile {spec!r}: lognormal takes positive mean, sigma and cap, e.g. {DEFAULT}")
        return Profile("lognormal", mean=kv["mean"], sigma=kv["sigma"], cap=int(kv["cap"]))
    if kind == "hist":
        with open(rest) as f:
            h = json.load(f)
        edges, counts = [int(e) for e in h["edges"]], [float(c) for c in h["counts"]]
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 1 \
                or sum(counts) <= 0:
            raise ValueError(f"--length-profile {spec!r}: the file needs increasing edges (>= 1) and one count "
                             "per bin, not all 0")
        return Profile("hist", cap=edges[-1] - 1, edges=edges, counts=counts)
    raise ValueError(f"--length-profile {spec!r}: use lognormal:mean=M,sigma=S,cap=C, uniform:N or hist:FILE")


def draw(profile: Profile, count: int, seed: int = 0) -> list[int]:
    """`count` lengths (>= 1), the same for the same seed."""
    rng = random.Random(seed)
    if profile.kind == "uniform":
        return [profile.cap] * count
    if profile.kind == "lognormal":
        return [max(1, min(profile.cap, round(rng.lognormvariate(profile.mu, profile.sigma)))) for _ in range(count)]
    bins = rng.choices(range(len(profile.counts)), weights=profile.counts, k=count)
    return [rng.randrange(profile.edges[b], profile.edges[b + 1]) for b in bins]


def running_at(start: float, finishes: list[float], share: float) -> int:
    """Requests still running at `share` of the wall (start to the last finish)."""
    t = start + share * (max(finishes) - start)
    return sum(f > t for f in finishes)


def tail_share(start: float, finishes: list[float], done: float = 0.9) -> float:
    """The share of the wall after `done` of the requests had finished (the ceil(done x count)-th finish)."""
    ordered = sorted(finishes)
    wall = ordered[-1] - start
    k = max(1, math.ceil(done * len(ordered)))
    return (ordered[-1] - ordered[k - 1]) / wall if wall > 0 else 0.0


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
