"""scripts/bench/simulate_partial.py: the project's partial rollouts over a modelled engine. Without a
tail, and with every engine step's cost per running sequence, partial rollouts cost what synchronous
steps do per trained token (the bookkeeping of tokens generated and trained is exact); with a tail
they cost less, and over-sampling less again here."""

import os
import subprocess
import sys

from tests.helpers import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "bench", "simulate_partial.py")
SMALL = ["--prompts", "8", "--samples", "4", "--chunk", "16", "--pools", "2,3"]


def table(*args):
    out = subprocess.run([sys.executable, SCRIPT, *SMALL, *args], capture_output=True, text=True, check=True,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}).stdout
    return {row.split(" | ")[0].strip("| "): row.split(" | ")[1:] for row in out.splitlines()[2:]}


def test_without_a_tail_partial_rollouts_cost_what_synchronous_steps_do():
    rows = table("--steps", "10", "--profile", "uniform:300", "--max-response-length", "300", "--step-ms", "0",
                 "--prefill-us", "0")
    assert rows["synchronous"][0] == "44.0"  # 0.044 ms a token
    assert [rows[f"partial, pool {p}, bound 2"][:2] for p in (2, 3)] == [["44.0", "1.00x"]] * 2


def test_with_a_tail_partial_rollouts_cost_less_and_over_sampling_less_again():
    rows = table("--steps", "20", "--profile", "lognormal:mean=200,sigma=0.9,cap=2048", "--max-response-length",
                 "2048", "--max-running", "64")
    two, three = (float(rows[f"partial, pool {p}, bound 2"][1].rstrip("x")) for p in (2, 3))
    assert three < two < 0.8, rows
    assert all(float(rows[f"partial, pool {p}, bound 2"][4].rstrip(" |")) <= 2 for p in (2, 3)), rows


def test_the_log_probs_every_partial_rollout_asks_for_cost_it_alone():
    """--logprob-us charges the sequences that ask for log-probs: every partial rollout's, none of the
    synchronous steps' (which ask none here): their cost stays, partial rollouts' grows."""
    args = ["--steps", "6", "--profile", "uniform:100", "--max-response-length", "100", "--step-ms", "0",
            "--prefill-us", "0", "--pools", "2"]
    plain, charged = table(*args), table(*args, "--logprob-us", "44")
    assert plain["synchronous"][0] == charged["synchronous"][0] == "44.0"
    assert charged["partial, pool 2, bound 2"][:2] == ["88.0", "2.00x"]  # 0.044 ms a token, as much again
