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
