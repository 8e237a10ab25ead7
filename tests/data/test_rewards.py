"""Reward extraction, scoring, dispatch by data_source and custom reward functions."""

import logging
import sys

import pytest

from spmd_rl.config.reward import RewardConfig
from spmd_rl.data.rewards import (
    RewardError,
    RewardFunction,
    extract_first_integer,
    extract_gsm8k_answer,
    load_custom_reward,
    score_gsm8k,
    score_synthetic,
)


@pytest.mark.parametrize("text,strict,flexible", [
    ("so 3 + 4 = 7\n#### 7", "7", "7"),
    ("#### 1,234", "1234", "1234"),
    ("she loses 5\n#### -5", "-5", "-5"),
    ("#### $18", "18", "18"),
    ("the answer is 42.", None, "42"),
    ("#### 3 is wrong, it is 8", "3", "8"),
    ("first #### 1 then #### 2", "2", "2"),
    ("10-3=7", None, "7"),
    ("total 1,000,000 dollars", None, "1000000"),
    ("list 1,2,3", None, "3"),
    ("no numbers here", None, None),
    ("#### 2.5", "2.5", "2.5"),
])
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_gsm8k_answer(text, "strict") == strict
    assert extract_gsm8k_answer(text, "flexible") == flexible


def test_gsm8k_score_and_format_bonus():
    assert score_gsm8k("#### 72", "72") == {"score": 1.0, "acc": 1.0}
    assert score_gsm8k("#### 72.00", "72") == {"score": 1.0, "acc": 1.0}
    assert score_gsm8k("I think 72", "72") == {"score": 0.0, "acc": 0.0}
    assert score_gsm8k("I think 72", "72", method="flexible") == {"score": 1.0, "acc": 1.0}
    assert score_gsm8k("work\n#### 71", "72", format_bonus=0.1) == {"score": 0.1, "acc": 0.0}
    assert score_gsm8k("work\n#### 72", "72", format_bonus=0.1) == {"score": 1.1, "acc": 1.0}
    # "####" inside a sentence is an answer (strict) but not the "#### N" line format.
    assert score_gsm8k("it is #### 72", "72", format_bonus=0.1) == {"score": 1.0, "acc": 1.0}


@pytest.mark.parametrize("text,first", [("7", "7"), ("ab7x12", "7"), ("73", "73"), ("-4 then 5", "-4"),
                                        ("x-4", "4"), ("none", None), ("", None)])
def test_synthetic_first_integer(text, first):
    assert extract_first_integer(text) == first


def test_synthetic_score_and_format_bonus():
    assert score_synthetic("5", "5") == {"score": 1.0, "acc": 1.0}
    assert score_synthetic("a5b", "5") == {"score": 1.0, "acc": 1.0}
    assert score_synthetic("56", "5") == {"score": 0.0, "acc": 0.0}
    assert score_synthetic("5", "5", format_bonus=0.5) == {"score": 1.5, "acc": 1.0}
    assert score_synthetic("4", "5", format_bonus=0.5) == {"score": 0.5, "acc": 0.0}
    assert score_synthetic("5 ", "5", format_bonus=0.5) == {"score": 1.0, "acc": 1.0}


def test_reward_function_dispatches_by_data_source():
    fn = RewardFunction(RewardConfig())
    out = fn(["openai/gsm8k", "my_gsm8k_variant", "synthetic/successor"],
             ["#### 3", "#### 4", "9x"], ["3", "5", "9"], [{}, {}, {}])
    assert out == [{"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}, {"score": 1.0, "acc": 1.0}]


def test_unknown_data_source_names_the_fix():
    fn = RewardFunction(RewardConfig())
    with pytest.raises(RewardError, match=r"'lighteval/MATH'.*custom_function"):
        fn(["lighteval/MATH"], ["1"], ["1"], [{}])
    with pytest.raises(RewardError, match="custom_function"):
        fn.check_data_sources(["synthetic/successor", "lighteval/MATH"])


def test_with_an_environment_a_source_without_scorer_is_the_environments_alone(caplog):
    """No refusal: such a trajectory's reward is the environment's (spmd_rl/trainer.py's score takes
    it where given); one it gave none scores 0. Sources with a scorer are scored as without one."""
    fn = RewardFunction(RewardConfig())
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        fn.check_data_sources(["my/task", "synthetic/successor", "my/task"], environment="env.py:Env")
    assert "data_source 'my/task' has no scorer: rollout.environment's reward is the reward" in caplog.text
    out = fn(["my/task", "synthetic/successor", "synthetic/successor"], ["7", "9", "8"], ["7", "9", "9"], [{}] * 3)
    assert out == [{"score": 0.0, "acc": 0.0}, {"score": 1.0, "acc": 1.0}, {"score": 0.0, "acc": 0.0}]
    assert fn.sync_failures().count == 0
    with pytest.raises(RewardError, match="or let rollout.environment give the reward"):
        RewardFunction(RewardConfig()).check_data_sources(["my/task"], environment="")


def test_mismatched_lengths_rejected():
    with pytest.raises(RewardError, match="differ in length"):
        RewardFunction(RewardConfig())(["synthetic/x"], ["1", "2"], ["1"], [{}])


CUSTOM_MODULE = '''
def as_float(data_source, response, ground_truth, extra_info):
    return 2.0 if response == ground_truth else -1.0

def as_dict(data_source, response, ground_truth, extra_info):
    return {"score": 0.5, "acc": 1.0 if extra_info.get("ok") else 0.0}

def dict_without_acc(data_source, response, ground_truth, extra_info):
    return {"score": 0.0}

def bad_return(data_source, response, ground_truth, extra_info):
    return "high"

def too_few_args(response):
    return 1.0

NOT_CALLABLE = 3
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_custom_reward_float_and_dict(custom_module):
    fn = RewardFunction(RewardConfig(custom_function=f"{custom_module}:as_float"))
    assert fn(["anything"], ["a"], ["a"], [{}]) == [{"score": 2.0, "acc": 1.0}]
    assert fn(["anything"], ["b"], ["a"], [{}]) == [{"score": -1.0, "acc": 0.0}]
    fn = RewardFunction(RewardConfig(custom_function=f"{custom_module}:as_dict"))
    assert fn(["x", "x"], ["r", "r"], ["g", "g"], [{"ok": True}, {}]) == [
        {"score": 0.5, "acc": 1.0}, {"score": 0.5, "acc": 0.0}]
    fn = RewardFunction(RewardConfig(custom_function=f"{custom_module}:dict_without_acc"))
    assert fn(["x"], ["r"], ["g"], [{}]) == [{"score": 0.0, "acc": 0.0}]


def test_custom_reward_bad_return_value(custom_module):
    fn = RewardFunction(RewardConfig(custom_function=f"{custom_module}:bad_return"))
    with pytest.raises(RewardError, match="must return a number"):
        fn(["x"], ["r"], ["g"], [{}])


def test_custom_reward_from_file_path(tmp_path):
    path = tmp_path / "file_rewards.py"
    path.write_text(CUSTOM_MODULE)
    assert load_custom_reward(f"{path}:as_float")("s", "a", "a", {}) == 2.0


@pytest.mark.parametrize("spec,message", [
    ("no_colon_here", "must look like"),
    ("surely_missing_module_xyz:fn", "not found"),
    ("{mod}:missing_fn", "has no attribute 'missing_fn'"),
    ("{mod}:NOT_CALLABLE", "not a function"),
])
def test_load_custom_reward_errors(custom_module, spec, message):
    with pytest.raises(RewardError, match=message):
        load_custom_reward(spec.format(mod=custom_module))


def test_bad_custom_function_fails_at_construction(custom_module):
    with pytest.raises(RewardError, match="must accept"):
        RewardFunction(RewardConfig(custom_function=f"{custom_module}:too_few_args"))
    with pytest.raises(RewardError, match="not found"):
        RewardFunction(RewardConfig(custom_function="surely_missing_module_xyz:fn"))
