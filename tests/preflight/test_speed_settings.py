"""The speed settings' "auto" (spmd_rl/preflight/speed_settings.py): the pick against the memory
plan's own numbers, walked here in the documented order from configs written as a user would; an
explicit value kept; the start-up line's numbers; no GPU; the saved config; a resume."""

import itertools
import json
import logging
import os

import pytest
import tomllib
import torch

from spmd_rl import preflight
from spmd_rl.config.run_config import load_config
from spmd_rl.config.toml_io import to_toml
from spmd_rl.errors import ConfigError
from spmd_rl.preflight import memory as mc
from spmd_rl.preflight import speed_settings as ss
from tests.config.test_config import valid_cfg
from tests.helpers import ROOT
from tests.runtime.test_memory_plan import QWEN25_7B_CONFIG

GiB = 2**30
H100 = 79.2 * GiB  # what torch.cuda.mem_get_info reports on an 80 GB H100
BIG = 139.8 * GiB  # a 141 GB card
AUTO = ["model.gradient_checkpointing=auto", "model.gradient_checkpointing_layers=auto",
        "actor.max_token_len_per_gpu=auto", "actor.logprob_max_token_len_per_gpu=auto", "actor.offload_optimizer=auto",
        "rollout.stay_awake=auto", "rollout.weights_stay_on_gpu=auto"]
RANDOM_05B = ['model.init="random"', 'model.path=""', 'model.arch="qwen2-0.5b"', 'model.tokenizer="char"']


def qwen7b_dir(tmp_path) -> str:
    model_dir = tmp_path / "Qwen2.5-7B-Instruct"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    return str(model_dir)


def preset(tmp_path, name, *overrides):
    base = RANDOM_05B if name.startswith("qwen0.5b") else [f'model.path="{qwen7b_dir(tmp_path)}"']
    return load_config(os.path.join(ROOT, "configs", f"{name}.toml"), [*base, *AUTO, *overrides])


def ladder(top, floor):
    """Budgets largest first: `top`, the powers of two between, `floor` (written out, not the module's)."""
    return [top] + [2**k for k in range(40, 0, -1) if floor < 2**k < top] + [floor]


def first_fit_by_hand(tmp_path, name, world, total, update_top, logprob_top, floor, *overrides):
    """Walk the documented order (checkpointing off, then on over the fewest layers; offload off,
    then on; the update's budget, largest first; the engine awake between steps, then asleep; with
    LoRA's adapter sync the engine's weights kept on the GPU, then not; the log-prob pass's budget,
    largest first) with configs written as overrides,
    each planned by plan_for, and return the first whose training phases stay within 90% of `total`
    and whose plan fits."""
    checkpointing = [("false", 1.0)] + [("true", s) for s in (0.25, 0.5, 0.75, 1.0)]
    stays = ("true", "false") if preset(tmp_path, name, *overrides).model.adapter_sync else ("false",)
    for (ckpt, share), offload, update, awake, stay, logprob in itertools.product(
            checkpointing, ("false", "true"), ladder(update_top, floor), ("true", "false"), stays,
            ladder(logprob_top, floor)):
        values = [f"model.gradient_checkpointing={ckpt}", f"model.gradient_checkpointing_layers={share}",
                  f"actor.offload_optimizer={offload}", f"actor.max_token_len_per_gpu={update}",
                  f"rollout.stay_awake={awake}", f"rollout.weights_stay_on_gpu={stay}",
                  f"actor.logprob_max_token_len_per_gpu={logprob}"]
        plan = mc.plan_for(preset(tmp_path, name, *overrides, *values), world, total)
        training = [p for p in plan.phases if p.name not in ("generation", "weight sync")]
        if plan.fits and all(p.total <= 0.9 * total for p in training):
            return {ss.CHECKPOINTING: ckpt == "true", ss.LAYERS: share, ss.OFFLOAD: offload == "true",
                    ss.UPDATE: update, ss.AWAKE: awake == "true", ss.STAY: stay == "true", ss.LOGPROB: logprob}
    return None


# 64 prompts x 8 per step, mini-batches of 32 prompts, sequences of at most 512 + 1024 tokens: the batch
# could fill 32 * 8 * 1536 and 64 * 8 * 1536 tokens; "auto" goes no higher than 32768 (BUDGET_MAX, written out)
CASES = {
    "7b-lora-80": ("qwen7b-lora", 1, H100, 32768, 32768),
    "7b-lora-141": ("qwen7b-lora", 1, BIG, 32768, 32768),
    "0.5b-80": ("qwen0.5b-gsm8k", 1, H100, 32768, 32768),
    "0.5b-40": ("qwen0.5b-gsm8k", 1, H100 / 2, 32768, 32768),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_pick_is_the_fastest_candidate_the_plan_says_fits(tmp_path, case):
    name, world, total, update_top, logprob_top = CASES[case]
    expected = first_fit_by_hand(tmp_path, name, world, total, update_top, logprob_top, 1536)
    cfg = preset(tmp_path, name)
    choice = ss.resolve(cfg, world, total)
    assert expected is not None and choice.fits
    assert {k: ss.value_of(cfg, k) for k in ss.SPEED_KEYS if k != ss.SEQS} == expected
    assert cfg.auto_chosen == tuple(ss.SPEED_KEYS)
    cfg.model.check()  # the chosen values pass the keys' own checks
    cfg.actor.check_batches(cfg, "actor", world)
    cfg.check_ranges()


def test_the_picks_differ_by_gpu_and_match_the_issue_at_7b_lora(tmp_path):
    """LoRA at 7B on an 80 GB GPU: checkpointing off with 8192 tokens per micro-batch (the refusal's
    own fix for that GPU); a 141 GB card takes twice the budget. Both keep the engine's weights."""
    small, big = preset(tmp_path, "qwen7b-lora"), preset(tmp_path, "qwen7b-lora")
    ss.resolve(small, 1, H100)
    ss.resolve(big, 1, BIG)
    assert (small.model.gradient_checkpointing, small.actor.max_token_len_per_gpu) == (False, 8192)
    assert (big.model.gradient_checkpointing, big.actor.max_token_len_per_gpu) == (False, 16384)
    assert small.actor.offload_optimizer is False and big.actor.offload_optimizer is False
    assert small.rollout.weights_stay_on_gpu is True and big.rollout.weights_stay_on_gpu is True  # room beside both


def test_an_explicit_value_is_never_overridden(tmp_path):
    """Where "auto" would turn checkpointing off and take larger budgets, the user's values stay."""
    cfg = preset(tmp_path, "qwen7b-lora", "model.gradient_checkpointing=true", "actor.max_token_len_per_gpu=4096")
    choice = ss.resolve(cfg, 1, BIG)
    assert cfg.model.gradient_checkpointing is True and cfg.actor.max_token_len_per_gpu == 4096
    assert ss.CHECKPOINTING not in choice.keys and ss.UPDATE not in choice.keys
    assert cfg.model.gradient_checkpointing_layers == 0.25  # auto: the fewest layers that fit
    assert set(cfg.auto_chosen) == {ss.LAYERS, ss.LOGPROB, ss.OFFLOAD, ss.AWAKE, ss.STAY, ss.SEQS}
    # nothing fits (7B in full on 2 GPUs): the least memory among the auto keys, the explicit ones kept
    cfg = load_config(os.path.join(ROOT, "configs", "qwen7b.toml"), [f'model.path="{qwen7b_dir(tmp_path)}"', *AUTO,
                                                                     "actor.offload_optimizer=false"])
    choice = ss.resolve(cfg, 2, H100)
    assert not choice.fits and cfg.actor.offload_optimizer is False and cfg.model.gradient_checkpointing is True
    assert choice.line().startswith("speed settings (auto): nothing fits within 90% of 79.2 GiB; the least memory: ")


def test_the_line_gives_the_plans_numbers(tmp_path):
    cfg = preset(tmp_path, "qwen7b-lora")
    line = ss.resolve(cfg, 1, H100).line()
    chosen = mc.plan_for(cfg, 1, H100)
    peak = max((p for p in chosen.phases if p.name not in ("generation", "weight sync")), key=lambda p: p.total)
    faster = mc.plan_for(preset(tmp_path, "qwen7b-lora", "model.gradient_checkpointing=false",
                                "model.gradient_checkpointing_layers=1.0", "actor.offload_optimizer=false",
                                "actor.max_token_len_per_gpu=16384", "rollout.weights_stay_on_gpu=true",
                                f"actor.logprob_max_token_len_per_gpu={cfg.actor.logprob_max_token_len_per_gpu}"), 1, H100)
    assert line.startswith(f"speed settings (auto): gradient checkpointing off, optimizer on the GPU, update 8192 "
                           f"tokens/GPU, vLLM weights kept on the GPU asleep, log-prob {cfg.actor.logprob_max_token_len_per_gpu} tokens/GPU, vLLM "
                           f"up to {cfg.rollout.max_num_seqs} sequences at once (training peak "
                           f"{peak.total / GiB:.1f} GiB in {peak.name}, within 90% of 79.2 GiB; faster would not fit: "
                           f"update 16384 tokens/GPU {faster.phase('actor update').total / GiB:.1f} GiB in actor update, "), line
    awake = mc.plan_for(preset(tmp_path, "qwen7b-lora", *(f"{k}={str(ss.value_of(cfg, k)).lower()}" for k in ss.SPEED_KEYS
                                                          if k != ss.AWAKE), "rollout.stay_awake=true"), 1, H100)
    assert f"vLLM awake between steps {awake.phase('actor update').total / GiB:.1f} GiB in actor update" in line
    assert awake.phase("actor update").parts["vLLM awake"] == 0.6 * H100  # vLLM sizes its KV cache to its share
    assert "\n" not in line


def test_without_a_gpu_auto_takes_the_keys_defaults(tmp_path):
    for _ in range(2):
        cfg = preset(tmp_path, "qwen7b-lora")
        choice = ss.resolve(cfg, 1, None)
        assert (cfg.model.gradient_checkpointing, cfg.model.gradient_checkpointing_layers, cfg.actor.offload_optimizer,
                cfg.actor.max_token_len_per_gpu, cfg.actor.logprob_max_token_len_per_gpu) == (False, 1.0, False, 0, 0)
        assert choice.line().endswith("(no GPU: the keys' defaults)")
    assert ss.resolve(load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml")), 2, None) is None  # nothing auto


def test_the_entry_point_resolves_before_anything_reads_the_keys(monkeypatch):
    """build.choose_speed_settings on a CPU rank: the keys' defaults, and the line."""
    import spmd_rl.build as build

    monkeypatch.setattr(build, "raise_together", lambda fn: fn())
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml"), ["model.gradient_checkpointing=auto"])
    env = type("Env", (), {"device": torch.device("cpu"), "world_size": 2})()
    assert build.choose_speed_settings(cfg, env).startswith("speed settings (auto): gradient checkpointing off (no GPU")
    assert cfg.model.gradient_checkpointing is False and build.choose_speed_settings(cfg, env) is None


def test_auto_is_accepted_and_junk_refused_in_one_line(tmp_path):
    preflight.validate(valid_cfg(tmp_path, ["model.remove_padding=true", *AUTO]), world_size=1)
    for override, message in (
            ("model.gradient_checkpointing=maybe", "model.gradient_checkpointing must be true, false or \"auto\", got 'maybe'"),
            ("actor.max_token_len_per_gpu=big", "actor.max_token_len_per_gpu must be an integer or \"auto\", got 'big'"),
            ("actor.logprob_max_token_len_per_gpu=1.5", "must be an integer or \"auto\", got 1.5"),
            ("model.gradient_checkpointing_layers=Auto", "model.gradient_checkpointing_layers must be a number or \"auto\""),
            ("actor.offload_optimizer=1", "actor.offload_optimizer must be true, false or \"auto\", got 1")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [override])
        assert message in str(e.value) and "\n" not in str(e.value)


def test_the_saved_config_records_the_values_and_that_auto_chose_them(tmp_path):
    cfg = preset(tmp_path, "qwen7b-lora", "actor.offload_optimizer=false")
    ss.resolve(cfg, 1, H100)
    text = to_toml(cfg, cfg.toml_notes())
    saved = tomllib.loads(text)
    assert saved["model"]["gradient_checkpointing"] is False and saved["actor"]["max_token_len_per_gpu"] == 8192
    assert 'max_token_len_per_gpu = 8192  # "auto" chose this' in text
    assert "offload_optimizer = false\n" in text  # set by the user: no note


def test_a_resume_chooses_again_and_a_change_is_logged_not_silent(tmp_path, caplog):
    """The same GPU chooses the same values (no change); another GPU may choose others, which the
    resume check lists (none of these keys changes what the checkpoint holds, so none is refused)."""
    from spmd_rl.preflight.resume import check_resume_config

    first = preset(tmp_path, "qwen7b-lora", f"trainer.run_dir={tmp_path}")
    ss.resolve(first, 1, H100)
    (tmp_path / "config.toml").write_text(to_toml(first, first.toml_notes()))
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    same = preset(tmp_path, "qwen7b-lora", f"trainer.run_dir={tmp_path}")
    ss.resolve(same, 1, H100)
    assert check_resume_config(same) == {}
    other = preset(tmp_path, "qwen7b-lora", f"trainer.run_dir={tmp_path}")
    ss.resolve(other, 1, BIG)
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        changes = check_resume_config(other)
    assert changes["actor.max_token_len_per_gpu"] == (8192, 16384)
    assert "actor.max_token_len_per_gpu: 8192 -> 16384" in caplog.text


# vLLM's own count of one measured engine, for the KV-cache prediction: a random Qwen2.5-7B shape
# (bench_step's work, configs/qwen7b-lora.toml) on a 141 GB H200 at rollout.gpu_memory_utilization 0.6
# logged "GPU KV cache size: 1,288,896 tokens" (docs/performance.md, "Memory predicted at start-up")
MEASURED_KV_TOKENS_7B_H200 = 1_288_896
H200 = 139.8 * GiB


def test_the_predicted_kv_cache_is_within_5_percent_below_vllms_count(tmp_path):
    """Below (a sequence "auto" admits is never preempted) and close (it admits nearly all that fit)."""
    from spmd_rl.runtime import memory_plan as mp

    cfg = preset(tmp_path, "qwen7b-lora", "rollout.gpu_memory_utilization=0.6")
    shape = mc.model_shape(cfg)
    token_bytes = 28 * 2 * 4 * 128 * 2  # layers x (key, value) x KV heads x head_dim x bf16, written out
    assert mp.kv_bytes_per_token(shape, 1, 2) == token_bytes
    assert mp.kv_bytes_per_token(shape, 2, 2) == token_bytes / 2  # 2 of the 4 KV heads a rank
    assert mp.kv_bytes_per_token(shape, 8, 2) == token_bytes / 4  # one head each, repeated
    tokens = mp.engine_kv_tokens(mc.engine_of(cfg, shape), H200, token_bytes)
    assert 0.95 * MEASURED_KV_TOKENS_7B_H200 <= tokens <= MEASURED_KV_TOKENS_7B_H200


@pytest.mark.parametrize("total, overrides, expected, bound", [
    (BIG, (), 512, "a call's most"),  # 64 prompts x 8 in one call
    (H100, (), 512, "a call's most"),  # the KV cache holds fewer of 1536 tokens: each call's cap decides
    (BIG, ("data.train_batch_size=128",), 512, "vLLM's CUDA graphs' most"),  # 1024 asked
    (BIG, ("data.train_batch_size=16",), 256, "a call's most"),  # validation: 256 prompts x 1
    (BIG, ("data.train_batch_size=16", "data.val_files=[]"), 128, "a call's most"),  # 16 x 8
    (BIG, ("rollout.partial_rollouts=true", "data.train_batch_size=16", "data.val_files=[]"), 384,
     "a call's most"),  # the partial rollouts' pool: three batches (rollout.partial_pool_batches)
    (BIG, ("rollout.partial_rollouts=true", "rollout.partial_pool_batches=2", "data.train_batch_size=16",
           "data.val_files=[]"), 256, "a call's most"),
])
def test_engine_sequences_are_a_calls_most_within_cuda_graphs_and_the_line_says_what_the_kv_cache_holds(
        tmp_path, total, overrides, expected, bound):
    cfg = preset(tmp_path, "qwen7b-lora", *overrides)
    share = cfg.rollout.gpu_memory_utilization * total  # the KV cache's sequences of full length, by hand
    weights = mc.model_shape(cfg).parameters() * 2
    fit = int((share - weights - 2 * GiB) // (28 * 2 * 4 * 128 * 2)) // 1536
    choice = ss.resolve(cfg, 1, total)
    assert cfg.rollout.max_num_seqs == expected and ss.SEQS in cfg.auto_chosen
    assert (f"; vLLM sequences: {bound} (a call has up to " in choice.line() and
            f"each call runs as many as the KV cache holds at the responses' expected lengths (it holds {fit} sequences "
            f"of 1536 tokens)" in choice.line())
    if total == H100:
        assert 256 < fit < 512
    cfg.check_ranges()


def test_engine_sequences_keep_a_set_value_and_the_hf_engines_default(tmp_path):
    cfg = preset(tmp_path, "qwen7b-lora", "rollout.max_num_seqs=64")
    ss.resolve(cfg, 1, BIG)
    assert cfg.rollout.max_num_seqs == 64 and ss.SEQS not in cfg.auto_chosen
    cfg = preset(tmp_path, "qwen7b-lora", 'rollout.engine="hf"')
    ss.resolve(cfg, 1, BIG)
    assert cfg.rollout.max_num_seqs == 256 and "vLLM sequences" not in ss.choose(
        preset(tmp_path, "qwen7b-lora", 'rollout.engine="hf"'), 1, BIG).line()
    cfg = preset(tmp_path, "qwen7b-lora")
    ss.resolve(cfg, 1, None)  # no GPU
    assert cfg.rollout.max_num_seqs == 256


def test_the_engines_weights_stay_before_the_log_prob_budget_grows_and_only_with_the_adapter_sync(tmp_path):
    """rollout.weights_stay_on_gpu comes after the update's budget and before the log-prob pass's. A case
    where the two compete (a 50 GiB GPU, the log-prob head unchunked so that its pass is the peak): the
    weights stay at the largest log-prob budget that fits beside them, where the other order would send
    them to host memory for a larger budget. Without the adapter sync "auto" is off."""
    fixed = ["model.gradient_checkpointing=true", "model.gradient_checkpointing_layers=1.0",
             "actor.max_token_len_per_gpu=1536", "actor.offload_optimizer=false", "rollout.gpu_memory_utilization=0.5",
             "model.chunked_logprobs=false", 'model.fused_logprob_head="none"']
    total = 50 * GiB

    def fits(stay, logprob):
        plan = mc.plan_for(preset(tmp_path, "qwen7b-lora", *fixed, f"rollout.weights_stay_on_gpu={stay}",
                                  f"actor.logprob_max_token_len_per_gpu={logprob}"), 1, total)
        return plan.fits and all(p.total <= 0.9 * total for p in plan.phases if p.name not in ("generation", "weight sync"))

    budgets = ladder(32768, 1536)
    by_hand = next((stay, b) for stay in (True, False) for b in budgets if fits(str(stay).lower(), b))
    other_order = next((stay, b) for b in budgets for stay in (True, False) if fits(str(stay).lower(), b))
    assert by_hand[0] is True and other_order[0] is False  # they compete here
    cfg = preset(tmp_path, "qwen7b-lora", *fixed, "actor.logprob_max_token_len_per_gpu=auto")
    choice = ss.resolve(cfg, 1, total)
    assert (cfg.rollout.weights_stay_on_gpu, cfg.actor.logprob_max_token_len_per_gpu) == by_hand
    assert "vLLM weights kept on the GPU asleep" in choice.line()
    merged = preset(tmp_path, "qwen7b-lora", "model.lora_sync=merged")
    ss.resolve(merged, 1, BIG)
    assert merged.rollout.weights_stay_on_gpu is False and ss.STAY in merged.auto_chosen



def test_the_engine_stays_awake_where_training_fits_beside_it_before_its_weights_are_kept(tmp_path):
    """rollout.stay_awake comes after the update's budget and before the weights kept asleep. bench_step's
    work (64 x 8 sequences of 128 + 512 tokens) with the KV cache sized to it: a 141 GB card fits the update at
    16384 tokens beside the whole engine, an 80 GB one does not (its faster neighbour in the line, with the
    plan's number); where vLLM sizes the KV cache to its share, or the training state is offloaded, or the
    engine is the HF one, it stays asleep."""
    work = ["data.max_prompt_length=128", "data.max_response_length=512", 'rollout.kv_cache_tokens="auto"']
    big = preset(tmp_path, "qwen7b-lora", *work)
    choice = ss.resolve(big, 1, BIG)
    assert (big.rollout.stay_awake, big.actor.max_token_len_per_gpu, big.model.gradient_checkpointing) == (True, 16384,
                                                                                                          False)
    assert "vLLM awake between steps" in choice.line() and "kept on the GPU asleep" not in choice.line()
    assert big.engine_stays_awake()
    small = preset(tmp_path, "qwen7b-lora", *work)
    line = ss.resolve(small, 1, H100).line()
    assert small.rollout.stay_awake is False and small.rollout.weights_stay_on_gpu is True
    values = [f"{k}={str(ss.value_of(small, k)).lower()}" for k in ss.SPEED_KEYS if k != ss.AWAKE]
    awake = mc.plan_for(preset(tmp_path, "qwen7b-lora", *work, *values, "rollout.stay_awake=true"), 1, H100)
    assert awake.phase("actor update").total > 0.9 * H100
    assert f"vLLM awake between steps {awake.phase('actor update').total / GiB:.1f} GiB in actor update" in line
    for other in (["rollout.kv_cache_tokens=0"], ["rollout.offload_train_states=true"], ['rollout.engine="hf"']):
        cfg = preset(tmp_path, "qwen7b-lora", *work, *other)
        ss.resolve(cfg, 1, BIG)
        assert cfg.rollout.stay_awake is False and not cfg.engine_stays_awake(), other
    user = preset(tmp_path, "qwen7b-lora", *work, "rollout.stay_awake=false")
    ss.resolve(user, 1, BIG)
    assert user.rollout.stay_awake is False and ss.AWAKE not in user.auto_chosen


def test_stay_awake_is_refused_with_the_hf_engine_and_with_the_offloaded_state(tmp_path):
    for other, words in ((['rollout.engine="hf"'], "the HF engine never sleeps"),
                         (["rollout.offload_train_states=true"], "rollout.offload_train_states moves")):
        cfg = preset(tmp_path, "qwen7b-lora", "rollout.stay_awake=true", *other)
        with pytest.raises(ConfigError, match=words):
            cfg.rollout.check_engine(1, 1)
    preset(tmp_path, "qwen7b-lora", "rollout.stay_awake=true").rollout.check_engine(1, 1)
