"""preflight.validate: the settings' own checks and those that need the model, the engine or the
machine, in one order (spmd_rl/preflight/__init__.py)."""

import pytest

from spmd_rl import preflight
from spmd_rl.errors import ConfigError
from tests.config.test_config import valid_cfg


@pytest.mark.parametrize("overrides, first", [
    # the preset is looked up (preflight) between the config's own model checks, as one check
    (['model.arch="gpt5"', 'model.tokenizer=""'], "model.arch = 'gpt5' is not a preset"),
    (['model.arch=""', 'model.tokenizer=""'], 'model.init = "random" needs model.arch'),
    # PEFT and vLLM's largest rank (preflight) after the config's LoRA names, before the files
    (["model.lora_rank=600", 'model.lora_target_modules=["lm_head"]'], "model.lora_target_modules names lm_head"),
    (["model.lora_rank=600", "model.gradient_checkpointing_layers=0.5"], "model.gradient_checkpointing_layers"),
    (["model.lora_rank=600", 'model.path="/nonexistent"'], "model.lora_rank = 600 is above the largest rank"),
])
def test_the_first_failing_check_speaks(tmp_path, overrides, first):
    """With two mistakes, the refusal is the one of the check that runs first (preflight.validate's order)."""
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, overrides), world_size=1)
    assert str(e.value).startswith(first), str(e.value)


@pytest.mark.parametrize("overrides, words", [
    (['rollout.environment="my_env:Env"'], "rollout.partial_rollouts does not carry multi-turn episodes over yet"),
    (["algorithm.dynamic_sampling=true"], "rollout.partial_rollouts and algorithm.dynamic_sampling cannot"),
    (['rollout.calculate_log_probs="off"'], "rollout.calculate_log_probs = 'off' but rollout.partial_rollouts"),
    (['rollout.stale_policy="keep"'], "rollout.stale_policy"),
    (["rollout.max_staleness=0"], "rollout.max_staleness"),
])
def test_partial_rollouts_refuse_what_they_cannot_carry(tmp_path, overrides, words):
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, ["rollout.partial_rollouts=true", *overrides]), world_size=1)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    preflight.validate(valid_cfg(tmp_path, overrides[:0] + ["rollout.partial_rollouts=true"]), world_size=1)


@pytest.mark.parametrize("profile, words", [
    ("lognormal:mean=100", "rollout.length_profile = 'lognormal:mean=100': lognormal takes positive mean, sigma and cap"),
    ("zipf:3", "rollout.length_profile = 'zipf:3': use lognormal:mean=M,sigma=S,cap=C, uniform:N or hist:FILE"),
    ("hist:/nonexistent.json", "rollout.length_profile = 'hist:/nonexistent.json': cannot read the histogram"),
])
def test_a_length_profile_that_does_not_parse_is_one_line(tmp_path, profile, words):
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, [f'rollout.length_profile="{profile}"']), world_size=1)
    assert str(e.value).startswith(words) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="rollout.length_profile shapes single-turn responses"):
        preflight.validate(valid_cfg(tmp_path, ['rollout.length_profile="uniform:8"', 'rollout.environment="my_env:Env"']),
                           world_size=1)
    preflight.validate(valid_cfg(tmp_path, ['rollout.length_profile="lognormal:mean=100,sigma=1,cap=400"']), world_size=1)
