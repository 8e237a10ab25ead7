"""Response lengths drawn from a profile: what a benchmark of random weights, which never stop, needs
to show the long tail of a real RL run (a step waits for its longest response).

    lognormal:mean=M,sigma=S,cap=C   a lognormal of mean M (before the cap), log-space sigma S, cut at C
    uniform:N                        every response N tokens
    hist:FILE                        a JSON histogram {"edges": [e0, ..., ek], "counts": [c0, ..., ck-1]}
                                     (a real run's response lengths): a bin by its count, then a length
                                     uniform in [e_i, e_i+1)

rollout.length_profile gives a training run's prompts their lengths (each prompt's n responses run to
its length, the stop tokens ignored); scripts/bench/ gives plain vLLM's requests theirs.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

FORMS = "lognormal:mean=M,sigma=S,cap=C, uniform:N or hist:FILE"


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


def parse(spec: str, name: str = "the length profile") -> Profile:
    """A profile from its written form (the module docstring); ValueError names `name` (the option or
    key that gave it) and what is wrong."""
    kind, _, rest = spec.partition(":")
    if kind == "uniform":
        if not rest.isdigit() or int(rest) < 1:
            raise ValueError(f"{name} {spec!r}: uniform takes a positive length, e.g. uniform:512")
        return Profile("uniform", mean=int(rest), cap=int(rest))
    if kind == "lognormal":
        try:
            kv = {k: float(v) for k, v in (item.split("=") for item in rest.split(","))}
        except ValueError:
            kv = {}
        if set(kv) != {"mean", "sigma", "cap"} or min(kv.values()) <= 0:
            raise ValueError(f"{name} {spec!r}: lognormal takes positive mean, sigma and cap, e.g. "
                             "lognormal:mean=1532,sigma=0.9,cap=8192")
        return Profile("lognormal", mean=kv["mean"], sigma=kv["sigma"], cap=int(kv["cap"]))
    if kind == "hist":
        try:
            with open(rest) as f:
                h = json.load(f)
            edges, counts = [int(e) for e in h["edges"]], [float(c) for c in h["counts"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{name} {spec!r}: cannot read the histogram ({e}): a JSON file "
                             '{"edges": [...], "counts": [...]}') from None
        if len(edges) != len(counts) + 1 or any(b <= a for a, b in zip(edges, edges[1:])) or edges[0] < 1 \
                or sum(counts) <= 0:
            raise ValueError(f"{name} {spec!r}: the file needs increasing edges (>= 1) and one count "
                             "per bin, not all 0")
        return Profile("hist", cap=edges[-1] - 1, edges=edges, counts=counts)
    raise ValueError(f"{name} {spec!r}: use {FORMS}")


def draw(profile: Profile, count: int, seed: int = 0) -> list[int]:
    """`count` lengths (>= 1), the same for the same seed."""
    rng = random.Random(seed)
    if profile.kind == "uniform":
        return [profile.cap] * count
    if profile.kind == "lognormal":
        return [max(1, min(profile.cap, round(rng.lognormvariate(profile.mu, profile.sigma)))) for _ in range(count)]
    bins = rng.choices(range(len(profile.counts)), weights=profile.counts, k=count)
    return [rng.randrange(profile.edges[b], profile.edges[b + 1]) for b in bins]
