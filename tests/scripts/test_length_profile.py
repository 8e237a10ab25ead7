"""scripts/bench/length_profile.py: lengths drawn from a profile (checked against the lognormal's
formulas) and the tail numbers of constructed finish times."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))

import length_profile as lp  # noqa: E402


def test_lognormal_draws_match_the_formulas():
    prof = lp.parse("lognormal:mean=1532,sigma=0.9,cap=1000000")
    lengths = lp.draw(prof, 40_000, seed=3)
    assert lengths == lp.draw(prof, 40_000, seed=3)  # seeded
    # E[X] = exp(mu + sigma^2/2) = the mean asked for; median = exp(mu) = 1532 exp(-0.405) = 1022
    assert statistics.fmean(lengths) == pytest.approx(1532, rel=0.03)
    assert statistics.median(lengths) == pytest.approx(1532 * math.exp(-0.9 ** 2 / 2), rel=0.03)


def test_the_cap_takes_the_upper_tail():
    prof = lp.parse(lp.DEFAULT)
    lengths = lp.draw(prof, 40_000, seed=1)
    assert max(lengths) == 8192 and min(lengths) >= 1
    # P(X >= cap) = 1 - Phi((ln cap - mu) / sigma)
    z = (math.log(8192) - prof.mu) / prof.sigma
    expected = 0.5 * math.erfc(z / math.sqrt(2))
    assert sum(n == 8192 for n in lengths) / len(lengths) == pytest.approx(expected, rel=0.25)


def test_uniform_and_histogram(tmp_path):
    assert lp.draw(lp.parse("uniform:512"), 3) == [512, 512, 512]
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"edges": [10, 20, 100], "counts": [3, 1]}))
    lengths = lp.draw(lp.parse(f"hist:{path}"), 20_000, seed=0)
    assert all(10 <= n < 100 for n in lengths)
    assert sum(n < 20 for n in lengths) / len(lengths) == pytest.approx(0.75, abs=0.02)


@pytest.mark.parametrize("spec", ["uniform:0", "lognormal:mean=5", "lognormal:mean=1,sigma=x,cap=3", "gauss:3"])
def test_bad_profiles_name_the_form(spec):
    with pytest.raises(ValueError, match="--length-profile"):
        lp.parse(spec)


def test_tail_share_and_running_counts():
    # 10 requests from t=0: nine finish by t=4, the last at t=10 -> 60% of the wall is after 90% finished
    finishes = [1, 1, 2, 2, 3, 3, 4, 4, 4, 10]
    assert lp.tail_share(0.0, finishes) == pytest.approx(0.6)
    assert [lp.running_at(0.0, finishes, s) for s in (0.1, 0.5, 0.9)] == [8, 1, 1]
    report = lp.tail_report(0.0, finishes, [100] * 10)
    assert report["wall_s"] == 10 and report["tokens_per_s"] == pytest.approx(100.0)
    assert lp.tail_share(0.0, [5.0] * 4) == 0.0  # all at once: no tail
