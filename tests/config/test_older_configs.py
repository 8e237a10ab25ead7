"""A config.toml written by an older version reads as that version behaved (spmd_rl/config/older_configs.py):
a key it lacks is never None, and a real change is still refused in one line."""

import json
import os

import pytest

from spmd_rl import preflight
from spmd_rl.config.older_configs import OLD_BEHAVIOUR
from spmd_rl.config.presets import resolve_config
from spmd_rl.config.run_config import Config, load_config
from spmd_rl.config.toml_io import to_dict, to_toml, tomllib
from spmd_rl.errors import ConfigError
from spmd_rl.preflight.resume import check_resume_config, config_changes, flatten
from tests.checkpoint.test_old_checkpoint import OLD_RUNS, written_by

# What differs between each fixture's config.toml and today's config for the command that wrote it,
# read off the two configs: the run directory and data files (the fixture's were elsewhere), the
# memory check that version did not have, the samples and scoring-error warnings it did not show, the
# partial rollouts' pool that took no new prompts mid-step, vLLM's LoRA kernels where matmuls apply the
# adapter now, and the CPU preset's sleep level, set since.
EXPECTED_CHANGES = {
    "0.1.0-9d108d1": {"trainer.run_dir", "data.train_files", "trainer.memory_check", "rollout.sleep_level",
                      "trainer.log_samples", "reward.warn_error_share", "rollout.partial_pool_batches",
                      "rollout.lora_matmul"},
    "0.1.0-730471c-lora": {"trainer.run_dir", "data.train_files", "trainer.log_samples", "reward.warn_error_share",
                           "rollout.partial_pool_batches", "rollout.lora_matmul"},
}


def saved_without(*keys):
    """Today's default config.toml with `keys` removed: one written before they existed."""
    saved = tomllib.loads(to_toml(Config()))
    for key in keys:
        section, name = key.split(".")
        del saved[section][name]
    return saved


def test_a_missing_key_reads_as_its_off_default_or_the_old_behaviour_table():
    saved = saved_without("model.lora_rank", "model.lora_alpha", "reward_model.path", "trainer.memory_check")
    assert config_changes(saved, to_dict(Config())) == {"trainer.memory_check": ("off", "error")}
    new = Config()
    new.trainer.memory_check = "off"
    assert config_changes(saved, to_dict(new)) == {}


def test_a_real_change_of_a_key_the_old_version_lacked_is_still_refused_in_one_line(tmp_path):
    (tmp_path / "config.toml").write_text(to_toml(Config()).replace("lora_rank = 0\n", ""))
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    new = load_config(None, [f"trainer.run_dir={tmp_path}", "model.lora_rank=4"])
    with pytest.raises(ConfigError) as e:
        check_resume_config(new)
    assert str(e.value).startswith("cannot resume with model.lora_rank changed (0 -> 4)")
    assert "\n" not in str(e.value)


def test_the_old_behaviour_table_names_keys_of_today_with_values_they_take():
    defaults = flatten(to_dict(Config()))
    for key, value in OLD_BEHAVIOUR.items():
        assert key in defaults and value != defaults[key], key  # a key whose default is the old value needs no entry
        preflight.validate(load_config(resolve_config("tiny-cpu"), [f"{key}={json.dumps(value)}"]), world_size=2)


@pytest.mark.parametrize("name", sorted(EXPECTED_CHANGES))
def test_the_real_old_config_toml_against_today_s_config_of_its_command(name):
    with open(os.path.join(OLD_RUNS, name, "config.toml"), "rb") as f:
        saved = tomllib.load(f)
    overrides = [o.replace("RUN", "/resumed/run") for o in written_by(name)["overrides"]]
    changes = config_changes(saved, to_dict(load_config(resolve_config("tiny-cpu"), overrides)))
    assert set(changes) == EXPECTED_CHANGES[name], changes
    assert all(old is not None for old, _ in changes.values()), changes


def test_every_fixture_is_checked_here():
    assert sorted(EXPECTED_CHANGES) == sorted(os.listdir(OLD_RUNS))
