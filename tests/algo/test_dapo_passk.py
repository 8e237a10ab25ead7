"""DAPO dynamic sampling (group filtering, rounds, padding, batch concatenation) in one process,
and the pass@k / maj@k validation statistics against brute-force references."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from spmd_rl.algo.dynamic_sampling import collect_informative_groups
from spmd_rl.algo.val_metrics import ks_for, majority_correct, pass_at_k, prompt_means, prompt_sums
from spmd_rl.batching.batch import build_rollout_batch
from spmd_rl.rollout.base import Completion


def fake_round(rng: random.Random, prompts: int, n: int, p_uniform: float, first_id: int):
    """A scored rollout batch: prompt ids first_id.., responses of random length, and per group
    either all-equal scores (probability p_uniform) or mixed ones."""
    ps = [[first_id + i, 3] for i in range(prompts)]
    comps, scores = [], []
    for _ in range(prompts):
        comps.append([Completion([rng.randint(4, 9) for _ in range(rng.randint(1, 5))], [0.0] * 1, "stop")
                      for _ in range(n)])
        uniform = rng.random() < p_uniform
        group = [1.0] * n if uniform else [float(i % 2) for i in range(n)]
        scores += group
    for group in comps:
        for c in group:
            c.logprobs = [-0.5] * len(c.token_ids)
    batch = build_rollout_batch(ps, comps, pad_id=0, meta={"data_source": [f"s{p[0]}" for p in ps]})
    batch["scores"] = torch.tensor(scores)
    return batch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dynamic_sampling_keeps_exactly_the_informative_groups(seed):
    rng = random.Random(seed)
    drawn = []

    def draw(round_):
        b = fake_round(rng, prompts=4, n=3, p_uniform=0.6, first_id=100 * (len(drawn) + 1))
        drawn.append(b)
        return b

    batch, m = collect_informative_groups(draw, groups_per_rank=4, max_rounds=50, pad_id=0, device=torch.device("cpu"))
    assert m["dynamic_sampling/train_groups"] == m["dynamic_sampling/informative_groups"] == 4
    assert m["dynamic_sampling/padded_groups"] == 0 and m["dynamic_sampling/rounds"] == len(drawn)
    # reference: the first 4 non-uniform groups in draw order, rows intact
    want = []
    for b in drawn:
        for g in range(4):
            rows = (b["group_ids"] == g).nonzero().flatten().tolist()
            if len(set(b["scores"][rows].tolist())) > 1:
                want.append((b, rows))
    uniform = sum(len(set(b["scores"][(b["group_ids"] == g)].tolist())) == 1 for b in drawn for g in range(4))
    assert m["dynamic_sampling/dropped_groups"] == uniform
    assert len(batch) == 12 and batch["group_ids"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    row = 0
    for b, rows in want[:4]:
        for r in rows:
            n = int(b["attention_mask"][r].sum())
            assert batch["input_ids"][row, :n].tolist() == b["input_ids"][r, :n].tolist()
            assert batch["input_ids"][row, n:].eq(0).all() and batch["attention_mask"][row, n:].eq(0).all()
            assert batch["response_mask"][row].sum() == b["response_mask"][r].sum()
            assert batch.meta["data_source"][row] == b.meta["data_source"][r]
            row += 1


def test_dynamic_sampling_fills_up_with_uniform_groups_after_max_rounds():
    rng = random.Random(0)
    batch, m = collect_informative_groups(lambda r: fake_round(rng, 4, 2, 1.0, 10 * (r + 1)), groups_per_rank=4,
                                          max_rounds=3, pad_id=0, device=torch.device("cpu"))
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/padded_groups"] == 4
    assert m["dynamic_sampling/informative_groups"] == 0 and len(batch) == 8


def ref_pass_at_k(correct: list[bool], k: int) -> float:
    """Fraction of all k-subsets of the samples holding at least one correct sample."""
    subsets = list(itertools.combinations(correct, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("seed", range(5))
def test_pass_at_k_is_the_subset_average(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    correct = [rng.random() < 0.3 for _ in range(n)]
    for k in range(1, n + 1):
        assert pass_at_k(n, sum(correct), k) == pytest.approx(ref_pass_at_k(correct, k), abs=1e-12)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]


def test_majority_vote_and_prompt_means():
    assert majority_correct(["3", "4", "4", None], [1, 0, 0, 0]) == 0.0
    assert majority_correct(["3", "3", "4", None], [1, 1, 0, 0]) == 1.0
    assert majority_correct(["4", "3"], [0.0, 1.0]) == 0.0  # tie: the answer seen first
    assert majority_correct([None, None], [0.0, 0.0]) == 0.0
    group_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    acc = torch.tensor([1, 0, 0, 0, 0, 1, 1, 0.0])
    answers = ["5", "6", "6", "6", "2", "7", "7", "1"]
    sums = prompt_sums(group_ids, acc, answers, ["a"] * 4 + ["b"] * 4)
    means = prompt_means(sums)
    assert means["val/mean@4"] == pytest.approx((0.25 + 0.5) / 2)
    assert means["val/pass@1"] == pytest.approx((0.25 + 0.5) / 2)
    assert means["val/pass@2"] == pytest.approx((ref_pass_at_k([1, 0, 0, 0], 2) + ref_pass_at_k([0, 1, 1, 0], 2)) / 2)
    assert means["val/pass@4"] == 1.0
    assert means["val/maj@4"] == pytest.approx(0.5)  # prompt a votes "6" (wrong), b votes "7" (right)
    assert means["val/a/maj@4"] == 0.0 and means["val/b/maj@4"] == 1.0
    assert set(means) == {f"val{p}/{k}" for p in ("", "/a", "/b")
                          for k in ("mean@4", "maj@4", "pass@1", "pass@2", "pass@4")}
