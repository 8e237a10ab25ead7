"""Whole LoRA runs of the trainer on CPU: GRPO learns the tiny task with the adapter alone, the
checkpoint holds the adapter, the export writes the merged model and PEFT's adapter directory, it
resumes on another number of ranks, and a resume with another adapter is refused.

The model is the tiny preset's shape with initializer_range 0.1 instead of 0.02: LoRA leaves the
embeddings and the (tied) head frozen, and at 0.02 a random head's logits span about +-1.3 whatever
the decoder does (|norm(h)| = 8 times rows of norm 0.16), so no adapter can put more than ~5% on
the right digit (measured: reward 0.03 after 80 steps at lr 2e-2). Full fine-tuning scales the
embeddings itself."""

import os

import pytest

from tests.helpers.cpu_runs import read_metrics, reward_ends, run, torchrun_cmd

pytest.importorskip("peft")


def tiny_model(tmp_path):
    from spmd_rl.model.loading import random_model_config

    config = random_model_config("tiny")
    config.initializer_range = 0.1
    path = tmp_path / "model"
    config.save_pretrained(path)
    return path


def test_the_tiny_models_frozen_head_bounds_its_logits_and_tiny_lora_does_not():
    """What the start-up warning says of LoRA on model.arch = "tiny": with the embeddings (the tied head)
    frozen, a logit is at most |E_t| x |final norm's output| (RMSNorm at weight 1: sqrt(hidden)), about
    1.3 at tiny's initializer range and about 6 at tiny-lora's; the warning is given for the one only."""
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.build import tiny_lora_problem
    from spmd_rl.config.run_config import load_config
    from spmd_rl.model.loading import random_model_config
    from tests.helpers.cpu_runs import TINY

    bounds = {}
    for arch in ("tiny", "tiny-lora"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(random_model_config(arch))
        emb = model.get_output_embeddings().weight
        bounds[arch] = (emb.norm(dim=1).max() * model.config.hidden_size ** 0.5).item()
    assert bounds["tiny"] < 1.6 and bounds["tiny-lora"] > 5, bounds
    warned = {arch: tiny_lora_problem(load_config(TINY, [f'model.arch="{arch}"', "model.lora_rank=8"]))
              for arch in ("tiny", "tiny-lora")}
    assert warned["tiny-lora"] is None and "use model.arch = \"tiny-lora\" with actor.lr = 2e-3" in warned["tiny"]
    assert tiny_lora_problem(load_config(TINY)) is None


def check_export(ckpt, base_dir, merged_dir, tmp_path):
    """The run's merged export (trainer.export_hf_dir) is PEFT's adapter, exported by
    `python -m spmd_rl.export --adapter-out`, on the base; and not the base (verl #4553)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from spmd_rl.export import main as export

    assert export(["--checkpoint", str(ckpt), "--out", str(tmp_path / "merged_again"),
                   "--adapter-out", str(tmp_path / "adapter")]) == 0
    ids = torch.randint(0, 60, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir)(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        base_logits = base(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(input_ids=ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)
    assert (merged - base_logits).abs().max() > 0.1


def test_lora_grpo_learns_on_two_ranks_and_resumes_on_one(tmp_path):
    import torch.distributed.checkpoint as dcp

    run_dir = tmp_path / "run"
    # the setting docs/lora.md gives for LoRA on the default job
    common = [f"trainer.run_dir={run_dir}", 'model.arch="tiny-lora"', "model.lora_rank=8", "trainer.tensorboard=false"]
    # 80 steps of this model, reward at step 40 / 80 (val acc at 80): full fine-tuning at lr 3e-3 0.87 / 0.87
    # (0.86); LoRA r8 alpha 32 at lr 2e-3 0.45 / 0.65 (0.81), 5e-3 0.30 / 0.61 (0.66), 1e-2 0.10 / 0.14 (0.05).
    # Here ~10x the full lr is too much: alpha / r = 4 already scales the adapter's update.
    out = run(torchrun_cmd(2, *common, "actor.lr=2e-3", "trainer.total_steps=40",
                           f"trainer.export_hf_dir={tmp_path / 'merged'}"))
    assert "(LoRA rank 8, alpha 32: 0.02M trained, the base frozen; the engine gets the base once" in out
    assert "does not learn with LoRA" not in out
    m = read_metrics(run_dir)
    steps = sorted(s for s in m if "reward/mean" in m[s])
    assert steps == list(range(1, 41)), steps
    first, last = reward_ends(m, steps)
    assert last > first + 0.15 and m[40]["val/acc"] > 0.35, (first, last, m[40]["val/acc"])
    # the engine got the base once and the adapter every step (fp32 on CPU)
    assert max(m[s]["rollout/logprob_diff_max"] for s in steps) < 1e-4
    ckpt = run_dir / "checkpoints" / "step_40"
    keys = [k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("actor.model.")]
    assert len(keys) == 2 * 7 * 2 and all(".lora_" in k for k in keys), keys
    check_export(ckpt, run_dir / "init_model", tmp_path / "merged", tmp_path)

    out = run(torchrun_cmd(1, *common, "actor.lr=2e-3", "trainer.total_steps=42"))
    assert f"resumed from {ckpt} at step 40" in out
    assert "resuming a checkpoint of 2 ranks on 1" in out
    assert f"the base from {run_dir / 'init_model'}, the adapter left for the checkpoint" in out
    m = read_metrics(run_dir)
    assert m[42]["reward/mean"] >= 0 and max(m[s]["rollout/logprob_diff_max"] for s in (41, 42)) < 1e-4

    refused = torchrun_cmd(1, *[c for c in common if c != "model.lora_rank=8"], "model.lora_rank=4",
                           "trainer.total_steps=44")
    with pytest.raises(AssertionError, match=r"error: cannot resume with model.lora_rank changed \(8 -> 4\)"):
        run(refused)
    assert os.path.isdir(ckpt)


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_lora_with_packing_token_budgets_and_gradient_checkpointing(tmp_path, monkeypatch, sync):
    """One rank in-process, 3 steps: packed micro-batches cut by tokens, every layer checkpointed,
    the chunked log-prob head; the adapter trains and the engine samples the actor's policy: with the
    adapter sync, given the base at the first step only and the adapter at every step; merged, given
    every weight at every step."""
    from spmd_rl.ppo import main
    from tests.helpers.cpu_runs import TINY

    calls = count_engine_loads(monkeypatch)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    run_dir = tmp_path / "run"
    rc = main(["--config", TINY, f"trainer.run_dir={run_dir}", "trainer.total_steps=3", "trainer.val_every=0",
               "data.train_batch_size=4", "data.synthetic_size=64", "trainer.tensorboard=false", "rollout.n=4",
               "actor.micro_batch_size_per_gpu=8", "actor.entropy_coeff=0.01", "actor.ppo_epochs=2", "model.lora_rank=4",
               "actor.lr=5e-3", f"model.lora_sync={sync}",
               "model.remove_padding=true", "actor.max_token_len_per_gpu=64", "model.gradient_checkpointing=true"])
    assert rc == 0
    m = read_metrics(run_dir)
    assert all(m[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))
    assert max(m[s]["rollout/logprob_diff_max"] for s in (1, 2, 3)) < 1e-4
    syncs = 4  # 3 steps and the validation at the end
    assert calls == ({"load_weights": 1, "load_adapter": syncs} if sync == "adapter" else
                     {"load_weights": syncs, "load_adapter": 0}), calls


# --------------------------------------------------------------------------- LoRA with the other features


def count_engine_loads(monkeypatch) -> dict[str, int]:
    """Counts of the HF engine's full-weight loads and adapter loads, in this process."""
    from spmd_rl.rollout.hf_engine import HFEngine

    calls = {"load_weights": 0, "load_adapter": 0}
    for method in calls:
        original = getattr(HFEngine, method)

        def counted(self, *args, _original=original, _method=method):
            calls[_method] += 1
            return _original(self, *args)

        monkeypatch.setattr(HFEngine, method, counted)
    return calls


def run_in_process(tmp_path, steps, *overrides):
    """One rank in this process, `steps` steps of the tiny preset with LoRA, no validation; the metrics
    and the log. Every step the engine sampled the actor's policy and the adapter got a gradient (the
    entropy bonus gives one where every reward of a step is 0, as often at random weights)."""
    from spmd_rl.ppo import main
    from tests.helpers.cpu_runs import TINY

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    run_dir = tmp_path / "run"
    assert main(["--config", TINY, f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
                 "trainer.val_every=0", "data.val_files=[]", "data.train_batch_size=4", "data.synthetic_size=64", "trainer.tensorboard=false", "rollout.n=4",
                 "actor.micro_batch_size_per_gpu=8", "model.lora_rank=4", "actor.lr=5e-3", "actor.entropy_coeff=0.01",
                 *overrides]) == 0
    m = read_metrics(run_dir)
    assert sorted(s for s in m if "reward/mean" in m[s]) == list(range(1, steps + 1))
    assert all(m[s]["actor/grad_norm"] > 0 for s in m), m
    assert max(m[s]["rollout/logprob_diff_max"] for s in m) < 1e-4, m
    return m, (run_dir / "trainer.log").read_text()


def test_lora_multi_turn_with_a_tool_and_the_adapter_sync(tmp_path, monkeypatch):
    """Trajectories of two turns with the calculator between them (tests/helpers/multiturn_tools.py's
    LastDigitCalls: the character tokenizer cannot write hermes calls): the engine gets the base
    once and the adapter every step, and samples the actor's policy over the whole trajectory (the
    tool's tokens masked out)."""
    calls = count_engine_loads(monkeypatch)
    m, _ = run_in_process(tmp_path, 3, "data.max_response_length=16", "rollout.max_turns=2",
                          'rollout.tools=[{function = "spmd_rl.tools.calculator:calculate"}]',
                          'rollout.tool_parser="tests.helpers.multiturn_tools:LastDigitCalls"',
                          "rollout.stop_token_ids=[3,4,5,6,7,8,9,10,11,12,48]")
    for s in (1, 2, 3):
        assert m[s]["multiturn/tool_calls_mean"] > 0.5 and m[s]["multiturn/tool_errors_mean"] == 0, m[s]
        assert m[s]["multiturn/turns_mean"] > 1.5 and 0 < m[s]["response/model_token_share"] < 1, m[s]
    assert calls == {"load_weights": 1, "load_adapter": 4}, calls  # 3 steps and the validation at the end


def test_lora_ppo_with_a_critic(tmp_path, monkeypatch):
    """PPO (GAE) with the KL penalty in the reward: the critic is trained in full, the actor through its
    adapter alone, its reference the actor with the adapter disabled."""
    from spmd_rl import build

    trained = []
    make_optimizer = build.make_optimizer

    def recording(model, *args, **kwargs):
        opt = make_optimizer(model, *args, **kwargs)
        trained.append((type(model).__name__, sum(p.numel() for g in opt.param_groups for p in g["params"]),
                        sum(p.numel() for p in model.parameters())))
        return opt

    monkeypatch.setattr(build, "make_optimizer", recording)
    m, _ = run_in_process(tmp_path, 3, 'algorithm.adv_estimator="gae"', "critic.lr=1e-3",
                          "critic.ppo_mini_batch_size=4", "critic.micro_batch_size_per_gpu=16",
                          "algorithm.use_kl_in_reward=true", "algorithm.kl_coef=0.05")
    assert m[1]["critic/values_mean"] == 0.0 and m[3]["critic/values_mean"] != 0.0  # the value head moved
    assert m[3]["critic/grad_norm"] > 0 and m[3]["critic/vf_loss"] > 0, m[3]
    assert m[1]["kl/reward_penalty"] == 0 and m[3]["kl/reward_penalty"] != 0, m  # the adapter moved off the base
    (actor, actor_trained, actor_all), (critic, critic_trained, critic_all) = trained
    assert actor_trained < actor_all / 10 and critic_trained == critic_all, trained


def small_lora_run(tmp_path, name, *more):
    """torchrun arguments of a 2-step LoRA run of the tiny preset (4 prompts x 4 samples a step),
    entropy bonus on, no validation."""
    return [f"trainer.run_dir={tmp_path / name}", "data.val_files=[]", "data.synthetic_size=64", "trainer.val_every=0", "trainer.tensorboard=false",
            "trainer.total_steps=2", "data.train_batch_size=4", "rollout.n=4", "model.lora_rank=4", "actor.lr=5e-3",
            "actor.entropy_coeff=0.01", *more]


def same_update(a: dict[int, dict], b: dict[int, dict]) -> None:
    """Steps 1-2 of run `b` against run `a`: `b` trains and its engine samples its actor's policy; the same
    rollouts, and the same update (float32 sums in another order: rel 1e-5)."""
    for s in (1, 2):
        assert b[s]["actor/grad_norm"] > 0 and b[s]["rollout/logprob_diff_max"] < 1e-4, b[s]
        for key in ("reward/mean", "response/length_mean"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-6, abs=1e-9), (s, key)
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert b[s][key] == pytest.approx(a[s][key], rel=1e-5, abs=1e-8), (s, key)


def test_lora_with_ulysses_gives_the_update_without_it(tmp_path):
    """2 ranks as one SP group of 2 (trainer.ulysses_size = 2) against the same 2 ranks data-parallel:
    the same rollouts, the same adapter update (losses, entropy, gradient norm; float32 sums in
    another order, rel 1e-5), and the engine samples the actor's policy through the adapter sync."""
    common = ("model.remove_padding=true", "actor.micro_batch_size_per_gpu=8", "actor.max_token_len_per_gpu=64")
    out = run(torchrun_cmd(2, *small_lora_run(tmp_path, "ulysses2", *common, "trainer.ulysses_size=2")))
    assert "SP groups of 2 ranks sharing each micro-batch" in out and "the engine gets the base once" in out, out[-3000:]
    run(torchrun_cmd(2, *small_lora_run(tmp_path, "ulysses1", *common)))
    a, b = read_metrics(tmp_path / "ulysses1"), read_metrics(tmp_path / "ulysses2")
    same_update(a, b)


def test_lora_with_hsdp_and_the_adapter_sync(tmp_path):
    """4 ranks as 2 replicas of 2 shards (trainer.fsdp_size = 2) against the same 4 ranks as one shard
    group: the engine gets the base once and the adapter each step and samples the actor's policy;
    the replicas' adapters stay equal, so step 2 samples what plain FSDP samples, and the updates
    agree (float32 sums in another order, rel 1e-5)."""
    common = ("actor.micro_batch_size_per_gpu=4",)
    out = run(torchrun_cmd(4, *small_lora_run(tmp_path, "hsdp", *common, "trainer.fsdp_size=2")))
    assert "world=4 (HSDP: 2 replicas x shard groups of 2)" in out and "the engine gets the base once" in out, out[-3000:]
    run(torchrun_cmd(4, *small_lora_run(tmp_path, "fsdp", *common)))
    a, b = read_metrics(tmp_path / "fsdp"), read_metrics(tmp_path / "hsdp")
    same_update(a, b)
