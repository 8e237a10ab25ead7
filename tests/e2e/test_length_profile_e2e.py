"""rollout.length_profile in whole 2-rank CPU runs of the tiny job (whose model stops at its stop token now and then):
every response runs to the length its prompt drew (the stop tokens ignored), cut at
data.max_response_length, with partial rollouts too (a group's length holds across its rounds)."""

import json

from tests.helpers.cpu_runs import read_metrics, run, torchrun_cmd

COMMON = ["trainer.total_steps=3", "trainer.val_every=0", "data.val_files=[]", "trainer.tensorboard=false",
          "trainer.save_every=-1", "data.max_response_length=12"]


def test_responses_run_to_the_profiles_lengths(tmp_path):
    hist = tmp_path / "lengths.json"  # half the prompts 3 tokens, half 9
    hist.write_text(json.dumps({"edges": [3, 4, 9, 10], "counts": [1, 0, 1]}))
    run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / 'hist'}", *COMMON, f'rollout.length_profile="hist:{hist}"'))
    m = read_metrics(tmp_path / "hist")
    steps = [m[s] for s in (1, 2, 3)]
    assert all(s["response/length_max"] == 9 for s in steps), [s["response/length_max"] for s in steps]
    assert all(3 < s["response/length_mean"] < 9 for s in steps), [s["response/length_mean"] for s in steps]
    assert all(s["response/clip_ratio"] == 0 for s in steps)  # under data.max_response_length

    # cut at data.max_response_length (12), every response, in rounds of 5 tokens of partial rollouts
    run(torchrun_cmd(2, f"trainer.run_dir={tmp_path / 'partial'}", *COMMON, 'rollout.length_profile="uniform:30"',
                     "rollout.partial_rollouts=true", "rollout.partial_chunk_tokens=5", 'algorithm.rollout_is="token"'))
    m = read_metrics(tmp_path / "partial")
    assert all(m[s]["response/length_mean"] == m[s]["response/length_max"] == 12 for s in (1, 2, 3)), m
    assert m[1]["rollout/partial_rounds"] == 3, m[1]  # 5 + 5 + 2 tokens (later steps start with carried groups)
