"""Rollout log-probs only where something reads them (rollout.calculate_log_probs,
rollout.logprob_sample_every): the rule per setting, the refusal, the start-up line, which prompts
ask (both engines), and the mismatch metrics over the rows that have them only."""

from __future__ import annotations

import math
import random
import types

import pytest
import torch

from spmd_rl import preflight
from spmd_rl.algo.rollout_correction import mismatch_metrics
from spmd_rl.batching.batch import build_rollout_batch
from spmd_rl.config.run_config import Config
from spmd_rl.errors import ConfigError
from spmd_rl.rollout.base import Completion, SamplingParams
from tests.config.test_config import valid_cfg
from tests.helpers.dist_utils import run_distributed


def config(**changes) -> Config:
    cfg = Config()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


# --------------------------------------------------------------------------- the rule


@pytest.mark.parametrize("changes, every, words", [
    ({}, 8, "the responses of every 8th prompt, for the mismatch metrics only (rollout.calculate_log_probs = 'auto'"),
    ({"rollout.logprob_sample_every": 2}, 2, "every 2nd prompt"),
    ({"rollout.logprob_sample_every": 1}, 1, "every prompt's responses, for the mismatch metrics only"),
    ({"rollout.logprob_sample_every": 0}, 0, "none (rollout.calculate_log_probs = 'auto' and no"),
    ({"algorithm.rollout_is": "token"}, 1, "every response (algorithm.rollout_is = 'token' reads them)"),
    ({"algorithm.rollout_is": "sequence", "rollout.logprob_sample_every": 0}, 1, "algorithm.rollout_is = 'sequence'"),
    ({"algorithm.rollout_mask": "geometric"}, 1, "every response (algorithm.rollout_mask = 'geometric' reads them)"),
    ({"algorithm.rollout_reject_sequences": True}, 1, "(algorithm.rollout_reject_sequences = True reads them)"),
    ({"rollout.calculate_log_probs": "on"}, 1, "every response (rollout.calculate_log_probs = 'on')"),
    ({"rollout.calculate_log_probs": "off"}, 8, "every 8th prompt, for the mismatch metrics only "
                                                "(rollout.calculate_log_probs = 'off')"),
    ({"rollout.calculate_log_probs": "off", "rollout.logprob_sample_every": 0}, 0, "none (rollout.calculate_log_probs"
                                                                                   " = 'off'; "),
])
def test_which_prompts_ask_per_setting(changes, every, words):
    cfg = config(**changes)
    got, why = cfg.rollout_logprobs_plan()
    assert got == every and words in why, (got, why)
    assert f" | rollout log-probs: {why} | old log-probs: " in cfg.describe_layout(1)  # the start-up line


@pytest.mark.parametrize("setting", ['algorithm.rollout_is="token"', 'algorithm.rollout_mask="sequence"',
                                     "algorithm.rollout_reject_sequences=true"])
def test_corrections_refuse_off_in_one_line(tmp_path, setting):
    cfg = valid_cfg(tmp_path, [setting, 'rollout.calculate_log_probs="off"'])
    with pytest.raises(ConfigError) as e:
        preflight.validate(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("rollout.calculate_log_probs = 'off' but algorithm.rollout_") and (
        msg.endswith("set rollout.calculate_log_probs = 'auto' (or 'on')")), msg
    preflight.validate(valid_cfg(tmp_path, [setting]))  # "auto" turns them on


def test_calculate_log_probs_takes_its_choices_only(tmp_path):
    with pytest.raises(ConfigError, match="rollout.calculate_log_probs = 'yes' is not one of 'auto', 'on', 'off'"):
        preflight.validate(valid_cfg(tmp_path, ['rollout.calculate_log_probs="yes"']))
    with pytest.raises(ConfigError, match="rollout.logprob_sample_every = -1 must be >= 0"):
        preflight.validate(valid_cfg(tmp_path, ["rollout.logprob_sample_every=-1"]))


def test_the_trainer_asks_per_the_plan_and_never_for_validation():
    from spmd_rl.trainer import Trainer

    for changes, every in (({}, 8), ({"algorithm.rollout_is": "token"}, 1), ({"rollout.logprob_sample_every": 0}, 0)):
        trainer = types.SimpleNamespace(cfg=config(**changes), step=3, engine_replica=0)
        assert Trainer._sampling(trainer, train=True).logprobs_every == every
        assert Trainer._sampling(trainer, train=False).logprobs_every == 0


@pytest.mark.parametrize("every, count, asking", [
    (1, 3, [0, 1, 2]), (3, 7, [0, 3, 6]), (8, 5, [0]), (0, 4, []), (2, 0, []),
])
def test_asks_logprobs_picks_every_kth_prompt_from_the_first(every, count, asking):
    asks = SamplingParams(logprobs_every=every).asks_logprobs(count)
    assert [i for i, a in enumerate(asks) if a] == asking and len(asks) == count


# --------------------------------------------------------------------------- the metrics


def rollout_rows(seed: int, prompts: int, n: int, asks: list[bool]):
    """A batch of random rows whose prompts ask per `asks`, and its old log-probs: the engine's
    plus noise (every row gets old log-probs; only the asking rows have engine ones)."""
    rng = random.Random(seed)
    ps = [[rng.randrange(1, 50) for _ in range(rng.randint(1, 4))] for _ in range(prompts)]
    comps = []
    for i in range(prompts):
        group = []
        for _ in range(n):
            toks = [rng.randrange(1, 50) for _ in range(rng.randint(1, 6))]
            group.append(Completion(toks, [-rng.random() * 3 for _ in toks] if asks[i] else None, "length"))
        comps.append(group)
    batch = build_rollout_batch(ps, comps, pad_id=0)
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(batch["rollout_logprobs"].shape, generator=g) * 0.3
    batch["old_logprobs"] = (batch["rollout_logprobs"] + noise) * batch["response_mask"]
    return batch, comps


def reference(batches) -> dict[str, float]:
    """The three metrics by their definitions, over the asking rows' response tokens of `batches`."""
    diffs, kls = [], []
    for batch, comps in batches:
        rows = [c for group in comps for c in group]
        for i, c in enumerate(rows):
            if c.logprobs is None:
                continue
            start = int(batch["prompt_lens"][i])
            for t, engine in enumerate(c.logprobs):
                actor = float(batch["old_logprobs"][i, start + t])
                engine = float(torch.tensor(engine, dtype=torch.float32))  # the batch holds float32
                diffs.append(abs(engine - actor))
                kls.append(math.exp(actor - engine) - (actor - engine) - 1)
    if not diffs:
        return {}
    return {"rollout/logprob_diff_mean": sum(diffs) / len(diffs), "rollout/logprob_diff_max": max(diffs),
            "rollout/mismatch_kl": sum(kls) / len(kls)}


def assert_close(got: dict, want: dict):
    assert set(got) == set(want), (got, want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k


def test_rows_without_logprobs_leave_the_mismatch_metrics():
    batch, comps = rollout_rows(0, prompts=6, n=3, asks=SamplingParams(logprobs_every=4).asks_logprobs(6))
    assert batch["has_rollout_logprobs"].tolist() == [True] * 3 + [False] * 9 + [True] * 3 + [False] * 3
    got = mismatch_metrics(batch, torch.device("cpu"))
    assert_close(got, reference([(batch, comps)]))
    everyone = mismatch_metrics(build_with_all_flags(batch), torch.device("cpu"))  # rows of 0s would count as 0s
    assert everyone["rollout/logprob_diff_mean"] != pytest.approx(got["rollout/logprob_diff_mean"], rel=1e-3)


def build_with_all_flags(batch):
    from spmd_rl.batching.batch import Batch

    return Batch({**batch.tensors, "has_rollout_logprobs": torch.ones(len(batch), dtype=torch.bool)}, batch.meta)


def test_no_row_with_logprobs_gives_no_metrics():
    batch, _ = rollout_rows(1, prompts=3, n=2, asks=[False] * 3)
    assert mismatch_metrics(batch, torch.device("cpu")) == {}


def _two_ranks(rank, world, cases):
    for asks_per_rank in cases:
        mine = rollout_rows(10 + rank, prompts=3, n=2, asks=asks_per_rank[rank])
        everyone = [rollout_rows(10 + r, prompts=3, n=2, asks=asks_per_rank[r]) for r in range(world)]
        assert_close(mismatch_metrics(mine[0], torch.device("cpu")), reference(everyone))


def test_mismatch_metrics_are_token_means_over_every_ranks_rows():
    """Rank 1 holding no row with log-probs (after rank balancing, say) must not pull the mean to 0,
    and ranks with more such tokens weigh more (not a mean of the ranks' means)."""
    run_distributed(_two_ranks, 2, [
        [[True, False, False], [False, False, False]],
        [[True, True, True], [True, False, False]],
        [[False, False, False], [False, False, False]],
    ])


def test_the_correction_refuses_rows_without_logprobs():
    from spmd_rl.algo.rollout_correction import actor_update_batch
    from spmd_rl.config.algorithm import AlgorithmConfig

    batch, _ = rollout_rows(2, prompts=2, n=2, asks=[True, False])
    with pytest.raises(RuntimeError, match="needs every row's rollout log-probs"):
        actor_update_batch(batch, AlgorithmConfig(rollout_is="token"), correct_rollout=False)
    actor_update_batch(batch, AlgorithmConfig())  # nothing to correct: fine


# --------------------------------------------------------------------------- the HF engine


def test_hf_engine_gives_logprobs_to_the_asking_prompts_only():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmd_rl.rollout.hf_engine import HFEngine

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    engine = HFEngine(model, pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"), max_batch_size=4)
    prompts = [[3, 4], [5], [6, 7, 8], [9], [10, 11]]
    runs = {every: engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=7, logprobs_every=every))
            for every in (1, 3, 0)}  # 3: across the engine's chunks of 2 prompts
    for every, out in runs.items():
        asks = SamplingParams(logprobs_every=every).asks_logprobs(len(prompts))
        for p, (group, full) in enumerate(zip(out, runs[1])):
            for c, ref in zip(group, full):
                assert c.token_ids == ref.token_ids  # asking changes nothing of the sampling
                assert (c.logprobs is not None) == asks[p], (every, p)
                if asks[p]:
                    assert c.logprobs == ref.logprobs and len(c.logprobs) == len(c.token_ids)
