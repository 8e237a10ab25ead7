"""The on-policy shortcut (spmd_rl/train/old_logprobs.py): old log-probs from the update's own forward.

- where it is taken, it gives the update of the separate no-grad pass: per policy loss and IS
  level on one process (the losses, metrics, gradients), and the whole trainer on 2 ranks for two
  steps (GRPO + KL loss + token TIS against an engine that differs from the actor, packed rows);
- where it would change the update, it is not taken: the decision, and the trainer running the pass;
- the start-up line says which path a run takes.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from spmd_rl import preflight
from spmd_rl.batching.batch import Batch
from spmd_rl.config.run_config import Config
from spmd_rl.train.old_logprobs import UpdateLogprobs
from tests.helpers import ROOT
from tests.helpers.dist_utils import run_distributed

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")


# --------------------------------------------------------------------------- the decision


def on_policy_config(**changes) -> Config:
    """A config that takes the shortcut: one mini-batch per step, one epoch; `changes`: "section.key" -> value."""
    cfg = Config()
    cfg.data.train_batch_size = cfg.actor.ppo_mini_batch_size = 8
    cfg.actor.ppo_epochs = 1
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


# each configuration whose update the shortcut would change, and the words its reason must hold
NEEDS_PASS = {
    "two_epochs": ({"actor.ppo_epochs": 2}, "actor.ppo_epochs = 2"),
    "two_mini_batches": ({"actor.ppo_mini_batch_size": 4}, "2 mini-batches per step"),
    "kl_in_reward": ({"algorithm.use_kl_in_reward": True}, "algorithm.use_kl_in_reward"),
    "kl_in_reward_adaptive": ({"algorithm.use_kl_in_reward": True, "algorithm.kl_ctrl": "adaptive"},
                              "algorithm.use_kl_in_reward"),
    "rollout_mask": ({"algorithm.rollout_mask": "token"}, "algorithm.rollout_mask"),
    "rollout_mask_geometric_with_is": ({"algorithm.rollout_mask": "geometric", "algorithm.rollout_is": "token"},
                                       "algorithm.rollout_mask"),
    "reject_sequences": ({"algorithm.rollout_reject_sequences": True}, "algorithm.rollout_reject_sequences"),
    "forced": ({"actor.force_old_logprob_pass": True}, "actor.force_old_logprob_pass = true"),
}

# on-policy configurations that read nothing of the old policy before the update
TAKES_SHORTCUT = {
    "grpo": {},
    "grpo_kl_loss_entropy": {"actor.use_kl_loss": True, "actor.entropy_coeff": 0.01},
    "token_tis": {"algorithm.rollout_is": "token"},
    "sequence_tis_gspo": {"algorithm.rollout_is": "sequence", "actor.policy_loss": "gspo"},
    "geometric_tis_cispo": {"algorithm.rollout_is": "geometric", "actor.policy_loss": "cispo"},
    "ppo_critic": {"algorithm.adv_estimator": "gae", "critic.ppo_mini_batch_size": 2, "critic.ppo_epochs": 3},
    "dapo": {"algorithm.dynamic_sampling": True, "algorithm.overlong_filtering": True},
}


@pytest.mark.parametrize("name", sorted(NEEDS_PASS))
def test_configs_the_shortcut_would_change_run_the_pass(name):
    changes, words = NEEDS_PASS[name]
    cfg = on_policy_config(**changes)
    reason = cfg.old_logprob_pass_reason()
    assert words in reason
    assert cfg.describe_layout(2).endswith(f" | old log-probs: separate pass ({reason})")


@pytest.mark.parametrize("name", sorted(TAKES_SHORTCUT))
def test_on_policy_configs_take_the_shortcut(name):
    cfg = on_policy_config(**TAKES_SHORTCUT[name])
    assert cfg.old_logprob_pass_reason() == ""


def test_start_up_line_names_the_path():
    """Config.describe_layout, the line the trainer logs at start."""
    line = on_policy_config().describe_layout(2)
    assert line.endswith(" | old log-probs: from the update's forward (on-policy: 1 mini-batch, 1 epoch)"), line
    line = on_policy_config(**{"actor.ppo_mini_batch_size": 2}).describe_layout(2)
    assert line.endswith(" | old log-probs: separate pass (4 mini-batches per step: later ones follow an "
                         "optimizer step)"), line
    line = on_policy_config(**{"algorithm.rollout_reject_sequences": True}).describe_layout(2)
    assert line.endswith(" | old log-probs: separate pass (algorithm.rollout_reject_sequences: masked tokens leave "
                         "the loss's denominator, counted before the update's forward)"), line


def test_masks_cannot_be_deferred_to_the_update():
    """actor_update_batch without old log-probs (the shortcut) refuses a correction that changes the mask."""
    from spmd_rl.algo.rollout_correction import actor_update_batch
    from spmd_rl.config.algorithm import AlgorithmConfig
    from tests.train.test_update import make_batch

    batch = make_batch()
    batch["rollout_logprobs"] = batch["old_logprobs"]
    for alg in (AlgorithmConfig(rollout_mask="token"), AlgorithmConfig(rollout_reject_sequences=True)):
        with pytest.raises(ValueError, match="need the old log-probs before the update"):
            actor_update_batch(batch, alg, correct_rollout=False)
    out, metrics = actor_update_batch(batch, AlgorithmConfig(rollout_is="token"), correct_rollout=False)
    assert "rollout_is_weights" not in out and metrics == {}  # the update computes them per micro-batch


# --------------------------------------------------------------------------- one process: the loss path


def _batch_with_engine_logprobs(seed=0):
    """test_update's rows with engine log-probs near the tiny random policy's (log 1/50 + N(0, 0.3):
    ratios on both sides of the IS caps), reference log-probs and advantages."""
    from tests.train.test_update import make_batch

    batch = make_batch(seed, rows=8)
    g = torch.Generator().manual_seed(seed + 1)
    resp = batch["response_mask"]
    batch.tensors.pop("old_logprobs")
    batch["rollout_logprobs"] = (-math.log(50) + 0.3 * torch.randn(resp.shape, generator=g)) * resp
    batch["ref_logprobs"] = (-torch.rand(resp.shape, generator=g) * 3) * resp
    return batch


def _update(batch, policy_loss, is_level, shortcut, pass_tokens):
    """One update of a fresh packed tiny policy (SGD, lr 1: the parameters move by -grad); the old
    log-probs from a pass of `pass_tokens`-token micro-batches, or from the update's forward."""
    from transformers import Qwen2ForCausalLM

    from spmd_rl.algo.rollout_correction import actor_update_batch
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.config.algorithm import AlgorithmConfig
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import actor_loss_fn, compute_logprobs
    from spmd_rl.train.update import ppo_update
    from tests.train.test_update import tiny_config

    torch.manual_seed(0)
    model = prepare_policy(Qwen2ForCausalLM(tiny_config()), remove_padding=True)
    cfg = ActorConfig(policy_loss=policy_loss, use_kl_loss=True, entropy_coeff=0.01, gspo_clip_ratio_low=0.1,
                      gspo_clip_ratio_high=0.1)
    alg = AlgorithmConfig(rollout_is=is_level, rollout_is_threshold=1.1)  # many tokens / rows truncated
    batch = Batch(dict(batch.tensors), batch.meta)
    cpu = torch.device("cpu")
    own = None
    if not shortcut:
        batch["old_logprobs"] = compute_logprobs(model, batch, 0.7, 4, cpu, pass_tokens)
    actor_batch, corr = actor_update_batch(batch, alg, correct_rollout=not shortcut)
    if shortcut:
        own = UpdateLogprobs(actor_batch, alg)
        actor_batch = own.batch
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    metrics = ppo_update(model, opt, actor_batch, actor_loss_fn(model, cfg, 0.7, own), mini_batch_size=len(batch),
                         micro_batch_size=4, epochs=1, grad_clip=0.0, loss_agg_mode=cfg.loss_agg_mode, device=cpu,
                         max_tokens=20)
    if shortcut:
        batch["old_logprobs"] = own.logprobs(batch["response_mask"])
        corr = actor_update_batch(batch, alg)[1]
    grads = [b - p.detach() for b, p in zip(before, model.parameters())]
    return batch["old_logprobs"], {**metrics, **corr}, grads


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("is_level", ["", "token", "sequence", "geometric"])
def test_update_from_its_own_forward_equals_the_update_after_a_pass(policy_loss, is_level):
    """Packed rows, update micro-batches of <= 20 tokens, the KL loss and an entropy bonus. With a
    pass of the same micro-batches the pass's forward is the update's first forward, float for float:
    everything must be equal bit for bit. With the trainer's default pass budget (twice the
    update's: rows packed with other rows) kernels may round differently (float32: ~1e-7; on this
    CPU they do not): the losses, metrics and gradients must agree to 1e-5."""
    from spmd_rl.batching.batch import plan_micro_batches

    batch = _batch_with_engine_logprobs()
    lengths = batch["attention_mask"].sum(-1).tolist()
    assert plan_micro_batches(lengths, 4, 20) != plan_micro_batches(lengths, 4, 40)  # other rows packed together
    old, metrics, grads = _update(batch, policy_loss, is_level, shortcut=True, pass_tokens=0)
    for pass_tokens, tol in ((20, 0.0), (40, 1e-5)):
        want_old, want_metrics, want_grads = _update(batch, policy_loss, is_level, shortcut=False,
                                                     pass_tokens=pass_tokens)
        torch.testing.assert_close(old, want_old, rtol=0, atol=tol * 0.1)
        assert sorted(metrics) == sorted(want_metrics)
        for k, v in want_metrics.items():
            if k == "rollout_corr/truncated_frac":  # a count: a ratio within 1e-7 of the cap may flip
                assert metrics[k] == pytest.approx(v, abs=0.02 if tol else 0.0), (pass_tokens, k)
            else:
                assert metrics[k] == pytest.approx(v, rel=tol, abs=tol), (pass_tokens, k)
        for g, want in zip(grads, want_grads):
            torch.testing.assert_close(g, want, rtol=tol, atol=tol, msg=f"pass of {pass_tokens} tokens")
    if is_level:  # the weights were really in play: some truncated, some not
        assert 0 < metrics["rollout_corr/truncated_frac"] < 1
    assert metrics["ppo_kl"] == 0.0  # the ratio is exactly 1 with the shortcut
    assert metrics["kl_loss"] > 0 and any(float(g.abs().max()) > 0 for g in grads)


def test_rows_seen_twice_are_an_error():
    """The runtime guard: the shortcut forced onto two epochs (each row's forward twice, the second
    after an optimizer step) cannot hand back old log-probs."""
    from transformers import Qwen2ForCausalLM

    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.config.algorithm import AlgorithmConfig
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.update import ppo_update
    from tests.train.test_update import tiny_config

    batch = _batch_with_engine_logprobs()
    model = prepare_policy(Qwen2ForCausalLM(tiny_config()))
    own = UpdateLogprobs(batch, AlgorithmConfig())
    ppo_update(model, torch.optim.SGD(model.parameters(), lr=0.1), own.batch, actor_loss_fn(model, ActorConfig(), 1.0, own),
               mini_batch_size=len(batch), micro_batch_size=4, epochs=2, grad_clip=0.0, loss_agg_mode="token-mean",
               device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="not exactly once"):
        own.logprobs(batch["response_mask"])


# --------------------------------------------------------------------------- the trainer


def _trainer(run_dir, data_dir, overrides, rank):
    from spmd_rl.config.run_config import load_config
    from spmd_rl.runtime.distributed import init_distributed, seed_everything
    from spmd_rl.runtime.preemption import StopFlag
    from spmd_rl.trainer import Trainer

    cfg = load_config(TINY, [f"trainer.run_dir={run_dir}", "data.val_files=[]", "data.synthetic_size=64", "trainer.tensorboard=false",
                             "trainer.val_before_train=false", *overrides])
    env = init_distributed("cpu")
    preflight.validate(cfg, env.world_size)
    StopFlag._instance = StopFlag()  # no signal handlers (see test_sharded_init)
    seed_everything(cfg.trainer.seed + rank)
    return Trainer(cfg, env)


def _engine_in_bf16(trainer):
    """The engine gets the actor's weights rounded to bf16: its log-probs differ from the actor's
    (a real train/inference mismatch, for TIS to correct)."""
    load = trainer.engine.load_weights
    trainer.engine.load_weights = lambda weights: load((k, v.to(torch.bfloat16).to(v.dtype)) for k, v in weights)


TRAIN = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size_per_gpu=4",
         "model.remove_padding=true",
         "actor.max_token_len_per_gpu=48", "actor.use_kl_loss=true", 'actor.kl_loss_type="low_var_kl"',
         'algorithm.rollout_is="token"', "algorithm.rollout_is_threshold=1.0005"]


def _two_steps_body(rank, world, base):
    results = {}
    for force in ("false", "true"):
        trainer = _trainer(f"{base}/run_{force}", f"{base}/data", [*TRAIN, f"actor.force_old_logprob_pass={force}"],
                           rank)
        assert trainer.cfg.micro_batching("actor").forward_tokens == 96  # the pass packs other micro-batches
        _engine_in_bf16(trainer)
        steps = [trainer.train_step() for _ in range(2)]
        params = {n: p.full_tensor().clone() for n, p in trainer.actor.named_parameters()}
        results[force] = steps, params
        trainer.close()
    (short, short_params), (full, full_params) = results["false"], results["true"]
    for step, (got, want) in enumerate(zip(short, full), 1):
        assert "time/old_logprob" in want and "time/old_logprob" not in got, step
        keys = {k for k in want if not k.startswith(("time/", "perf/", "memory/"))}
        assert keys == {k for k in got if not k.startswith(("time/", "perf/", "memory/"))}, step
        assert {"actor/kl_loss", "rollout_corr/is_weight_mean", "rollout/logprob_diff_max"} <= keys
        for k in sorted(keys):
            # truncated_frac counts tokens over the cap: one within rounding of it may flip (1/32 on a rank)
            tol = 0.02 if k == "rollout_corr/truncated_frac" else 1e-5
            assert got[k] == pytest.approx(want[k], rel=tol, abs=tol), (step, k, got[k], want[k])
        assert got["actor/ppo_kl"] == 0.0 and abs(want["actor/ppo_kl"]) < 1e-6, step
        # the engine differs from the actor: TIS weights are in play, some capped
        assert got["rollout/logprob_diff_max"] > 1e-3 and 0 < got["rollout_corr/truncated_frac"] < 1, step
    for n, want in full_params.items():
        torch.testing.assert_close(short_params[n], want, rtol=1e-5, atol=1e-6, msg=n)


def test_trainer_shortcut_gives_the_separate_pass_update_on_two_ranks(tmp_path):
    """Two steps of GRPO with the KL loss and token TIS (an engine in bf16: real mismatch, weights
    capped at 1.0005), packed rows in token-budget micro-batches, 2 ranks: the shortcut's losses, grad
    norms, metrics and parameters are the separate pass's. The pass packs rows in micro-batches of
    <= 96 tokens, the update in <= 48: kernels whose summation order depends on the packed shape may
    round the log-probs differently (float32: ~1e-7 relative; on this CPU they come out bit for bit
    equal). Tolerance: rel/abs 1e-5 on the metrics (100x that rounding), 1e-6 on the parameters
    (Adam at lr 3e-3 moves a parameter by <= 6e-3 in two steps; a 1e-5 relative change of its
    steps stays below 1e-6)."""
    run_distributed(_two_steps_body, 2, str(tmp_path))


def _runs_the_pass_body(rank, world, base):
    for name, overrides in PASS_RUNS.items():
        trainer = _trainer(f"{base}/{name}", f"{base}/data", ["data.train_batch_size=4", "rollout.n=4", "actor.micro_batch_size_per_gpu=4",
                                                             "actor.ppo_mini_batch_size=4", *overrides], rank)
        m = trainer.train_step()
        trainer.close()
        if name == "on_policy":
            assert "time/old_logprob" not in m, name
        else:
            assert "time/old_logprob" in m, name  # the trainer ran the separate pass
        if "rollout_mask" in name:
            assert "rollout_corr/token_masked_frac" in m


PASS_RUNS = {
    "on_policy": [],
    "two_epochs": ["actor.ppo_epochs=2"],
    "two_mini_batches": ["actor.ppo_mini_batch_size=2"],
    "kl_in_reward_adaptive": ["algorithm.use_kl_in_reward=true", 'algorithm.kl_ctrl="adaptive"'],
    "rollout_mask": ['algorithm.rollout_mask="token"'],
    "reject_sequences": ["algorithm.rollout_reject_sequences=true"],
    "forced": ["actor.force_old_logprob_pass=true"],
}


def test_trainer_runs_the_pass_where_the_shortcut_would_change_the_update(tmp_path):
    """One rank, one step each: the separate pass runs (its time/old_logprob phase is logged) in
    every configuration the shortcut would change, and not in the on-policy one."""
    run_distributed(_runs_the_pass_body, 1, str(tmp_path))
