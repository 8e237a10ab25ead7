"""Validation with several samples per prompt (rollout.val_n = k > 1): mean@k, pass@k, maj@k.

- mean@k: the mean correctness (`acc`) of the k samples, averaged over prompts.
- pass@k: the chance that at least one of k samples is correct, by the unbiased estimator of
  Chen et al. 2021 ("Evaluating Large Language Models Trained on Code"): from n samples with c
  correct, 1 - C(n - c, k) / C(n, k); reported for k = 1, 2, 4, ... and n.
- maj@k: the correctness of the most frequent extracted answer among the n samples (majority
  vote, ties to the answer seen first; samples without an answer do not vote).

Per prompt group these give sums (`prompt_sums`), reduced over ranks like the other validation
sums and turned into means by `prompt_means`; every key exists for the whole set and per data source.
"""

from __future__ import annotations

from collections import Counter
from math import comb

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... below n, and n."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def majority_correct(answers: list[str | None], acc: list[float]) -> float:
    """Correctness of the majority answer: the mean acc of the samples that gave it (0 if no
    sample gave an answer)."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return 0.0
    best = max(votes.values())
    winner = next(a for a in answers if a is not None and votes[a] == best)
    hits = [x for a, x in zip(answers, acc) if a == winner]
    return sum(hits) / len(hits)


def prompt_sums(group_ids: torch.Tensor, acc: torch.Tensor, answers: list[str | None],
                data_sources: list[str]) -> dict[str, float]:
    """Sums over the batch's prompt groups of mean@n, pass@k and maj@n, and the group count,
    under val/... and val/<data_source>/... ("*/prompts" is the count)."""
    groups: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.tolist()):
        groups.setdefault(g, []).append(row)
    sums: dict[str, float] = {}
    for rows in groups.values():
        n = len(rows)
        a = [float(acc[r]) for r in rows]
        c = sum(1 for x in a if x > 0)
        values = {f"mean@{n}": sum(a) / n, f"maj@{n}": majority_correct([answers[r] for r in rows], a),
                  **{f"pass@{k}": pass_at_k(n, c, k) for k in ks_for(n)}, "prompts": 1.0}
        for prefix in ("val", f"val/{data_sources[rows[0]]}"):
            for name, v in values.items():
                key = f"{prefix}/{name}_sum" if name != "prompts" else f"{prefix}/prompts"
                sums[key] = sums.get(key, 0.0) + v
    return sums


def prompt_means(total: dict[str, float]) -> dict[str, float]:
    """val/.../<metric> = its sum / the prompt count of the same prefix, for the *_sum keys of
    `prompt_sums` (others are ignored)."""
    out = {}
    for key, count in total.items():
        if not key.endswith("/prompts") or count == 0:
            continue
        prefix = key[: -len("prompts")]
        for k, v in total.items():
            name = k[len(prefix):]
            if k.startswith(prefix) and "/" not in name and "@" in name and name.endswith("_sum"):
                out[prefix + name[: -len("_sum")]] = v / count
    return out
