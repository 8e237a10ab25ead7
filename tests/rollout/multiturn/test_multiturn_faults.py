"""Misbehaving user code stays contained (issue 42, part 3): tools and environments that hang, raise,
return bad values or write special-token text cost their own trajectory, never the run; each fault
is counted in a multiturn/* metric and logged once. Hung code waits on an Event that each test sets
at its end, so nothing hangs for more than a few seconds; timings are bounds with wide margins."""

import logging
import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from spmd_rl.data.prompts import PromptDataset, PromptRecord
from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.rollout.multiturn import MultiTurnRollout
from spmd_rl.rollout.multiturn.bridge import Bridge
from spmd_rl.rollout.multiturn.tools import ToolRunner, load_tools
from tests.helpers import multiturn_tools
from tests.helpers.dist_utils import run_distributed
from tests.rollout.multiturn.test_multiturn import (
    IM_END,
    IM_START,
    Record,
    ScriptedEngine,
    call,
    chatml_tokenizer,
    rollout_cfg,
    tools_cfg,
)


class SameTurnEngine:
    """Every prompt gets the same turn (ending on the end-of-turn token: "stop")."""

    def __init__(self, turn):
        self.turn = list(turn)

    def generate(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        return [[Completion(self.turn, [0.0] * len(self.turn), "stop")] for _ in prompts]


@pytest.fixture
def gate():
    """A fresh gate for the hung tools and environments, opened when the test ends."""
    multiturn_tools.GATE = threading.Event()
    multiturn_tools.RAN.clear()
    multiturn_tools.ROWS.clear()
    yield multiturn_tools.GATE
    multiturn_tools.GATE.set()


def env_run(modes, n=1, **cfg):
    """One generate over FaultyEnv rows (row i: index 10 + i, extra_info mode = modes[i])."""
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    mt = MultiTurnRollout(rollout_cfg(environment="tests.helpers.multiturn_tools:FaultyEnv", max_turns=3, **cfg), tok)
    engine = SameTurnEngine(tok.encode("hm", add_special_tokens=False) + [eos])
    records = [Record(tok.encode(f"p{i}", add_special_tokens=False), extra_info={"mode": m}, index=10 + i)
               for i, m in enumerate(modes)]
    comps, metrics = mt.generate(engine, records, SamplingParams(n=n), budget=300)
    mt.close()
    return [c for cs in comps for c in cs], metrics


def fault_logs(caplog, *words):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and all(w in r.getMessage() for w in words)]


# --------------------------------------------------------------------------- tools


def test_a_call_queued_behind_hung_calls_is_told_it_did_not_start_and_never_runs(gate):
    """One tool thread, held by a hung call: the call queued behind it is not reported as timed
    out, never runs once the thread frees up, and is counted."""
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    mt = MultiTurnRollout(tools_cfg("hang", "record", max_turns=2, tool_timeout=0.3, tool_pool_size=1), tok)
    prompt = tok.encode("q", add_special_tokens=False)
    turns = [tok.encode(text, add_special_tokens=False) + [eos] for text in (call("hang", x=1) + call("record", x=2),
                                                                              "done")]
    (comps,), m = mt.generate(ScriptedEngine([(prompt, turns)], eos), [Record(prompt)], SamplingParams(n=1),
                              budget=2000)
    seen = tok.decode(comps[0].token_ids)
    assert "tool 'hang' timed out after 0.3 s" in seen
    assert "tool 'record' was not started: after 0.3 s, 1 earlier calls were still running" in seen, seen
    assert m["multiturn/tool_not_started_mean"] == 1 and m["multiturn/tool_timeouts_mean"] == 1
    gate.set()
    mt.runner.pool.shutdown(wait=True)  # the hung call returns; a queued call would run now
    assert multiturn_tools.RAN == []


def test_a_tools_timeout_counts_from_when_it_starts():
    """One tool thread, two calls of 0.6 s with a 1 s timeout: the second starts when the first
    ends and finishes 1.2 s after it was asked for, within its own second."""
    runner = ToolRunner(load_tools([{"function": "tests.helpers.multiturn_tools:pause"}]), timeout=1.0, pool_size=1)
    waits = [runner.submit("pause", {"x": i}) for i in range(2)]
    results = [w() for w in waits]
    runner.close()
    assert [r.text for r in results] == ["paused", "paused"], [r.text for r in results]


# --------------------------------------------------------------------------- environment steps


def test_a_turns_steps_share_one_deadline_and_a_late_step_keeps_no_reward(gate, caplog):
    """Four hung steps and one that ends after the deadline (0.9 s > 0.5 s): the turn takes one
    timeout, not one per hung step (4 x 0.5 = 2 s), and the late step's reward is dropped."""
    t0 = time.perf_counter()
    comps, m = env_run(["hang"] * 4 + ["slow", "ok"], tool_timeout=0.5)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.6, elapsed  # one deadline: ~0.5 s; a deadline per wait: >= 2 s
    assert [c.reward for c in comps] == [None] * 5 + [1.0]
    assert m["multiturn/stop_env_timeout"] == pytest.approx(5 / 6) and m["multiturn/stop_answer"] == pytest.approx(1 / 6)
    assert m["multiturn/step_timeouts_mean"] == pytest.approx(5 / 6)
    logs = fault_logs(caplog, "step_timeouts")
    assert len(logs) == 1 and "tests.helpers.multiturn_tools:FaultyEnv" in logs[0] and "data row 10" in logs[0], logs


def test_a_reset_that_raises_ends_its_own_trajectory_logged_once(caplog):
    comps, m = env_run(["reset_raise", "ok", "reset_raise"])
    assert [c.reward for c in comps] == [None, 1.0, None]
    assert m["multiturn/stop_env_error"] == pytest.approx(2 / 3) and m["multiturn/reset_errors_mean"] == pytest.approx(2 / 3)
    logs = fault_logs(caplog, "reset_errors")
    assert len(logs) == 1, logs
    assert "tests.helpers.multiturn_tools:FaultyEnv" in logs[0] and "RuntimeError: no episode" in logs[0] and "data row 10" in logs[0]


def test_a_step_that_raises_is_counted_and_logged_once(caplog):
    comps, m = env_run(["raise", "raise", "ok", "raise"])
    assert [c.reward for c in comps] == [None, None, 1.0, None]
    assert m["multiturn/step_errors_mean"] == 0.75 and m["multiturn/stop_env_error"] == 0.75
    logs = fault_logs(caplog, "step_errors")
    assert len(logs) == 1, logs
    assert "tests.helpers.multiturn_tools:FaultyEnv" in logs[0] and "KeyError: 'lost'" in logs[0] and "data row 10" in logs[0]


@pytest.mark.parametrize("mode, field", [
    ("dict", "a dict ({'messages': [], 'done': True}), not a StepResult"),
    ("nan", "StepResult.reward = nan, not a finite number"),
    ("str_reward", "StepResult.reward = '1', not a finite number"),
    ("bad_message", "StepResult.messages[0] = {'role': 'user', 'content': 5}: a chat message is a dict"),
    ("parts", "StepResult.messages[0] = {'role': 'user', 'content': [{'type'"),
])
def test_bad_step_values_are_refused_naming_the_environment_and_the_field(mode, field, caplog):
    comps, m = env_run([mode, "ok"])
    assert [c.reward for c in comps] == [None, 1.0]  # no NaN or string reaches the loss
    assert m["multiturn/stop_env_error"] == 0.5 and m["multiturn/bad_values_mean"] == 0.5
    logs = fault_logs(caplog, "bad_values")
    assert len(logs) == 1 and f"tests.helpers.multiturn_tools:FaultyEnv.step returned {field}" in logs[0] and "data row 10" in logs[0], logs


def test_an_environments_metrics_are_logged_as_means_and_bad_ones_counted(caplog):
    comps, m = env_run(["metrics", "ok"])
    assert [c.reward for c in comps] == [1.0, 1.0]  # a bad metric is dropped; the trajectory goes on
    assert m["multiturn/guesses_mean"] == 1.0  # 2 in one of two trajectories
    assert m["multiturn/bad_values_mean"] == 1.0 and "multiturn/label_mean" not in m and "multiturn/nan_mean" not in m
    assert len(fault_logs(caplog, "bad_values", "StepResult.metrics[")) == 1


def _metric_keys_body(rank, world):
    from spmd_rl.runtime.distributed import all_reduce_mean

    _, m = env_run(["metrics" if rank == 1 else "ok"] * 2)
    reduced = all_reduce_mean(m, torch.device("cpu"))  # needs the same keys on every rank
    assert reduced["multiturn/guesses_mean"] == 1.0 and m["multiturn/guesses_mean"] == (2.0 if rank else 0.0)


def test_an_environments_metric_one_rank_lacks_is_zero_there():
    run_distributed(_metric_keys_body, 2)


# --------------------------------------------------------------------------- the row reset gets


def test_reset_gets_the_prompt_and_a_row_of_its_own_per_sample():
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    mt = MultiTurnRollout(rollout_cfg(environment="tests.helpers.multiturn_tools:FaultyEnv", max_turns=2), tok)
    chat = [{"role": "user", "content": "hi"}]
    rec = PromptRecord(4, tok.encode("hi", add_special_tokens=False), "test", "7", {"mode": "ok"}, prompt=chat)
    multiturn_tools.ROWS.clear()
    mt.generate(SameTurnEngine(tok.encode("x", add_special_tokens=False) + [eos]), [rec], SamplingParams(n=2),
                budget=100)
    a, b = multiturn_tools.ROWS
    for sample, row in enumerate((a, b)):
        assert row["prompt"] == chat and row["ground_truth"] == "7" and row["extra_info"] == {"mode": "ok"}
        assert row["index"] == 4 and row["sample"] == sample
    a["extra_info"]["mode"] = "changed"
    a["prompt"][0]["content"] = "changed"
    assert b["extra_info"]["mode"] == "ok" and b["prompt"] == chat and rec.extra_info == {"mode": "ok"}


def test_prompt_records_carry_the_prompt_as_the_file_has_it(tmp_path):
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]
    path = str(tmp_path / "d.parquet")
    for prompts in (["what is 2+2?"], [chat]):
        pq.write_table(pa.table({"prompt": prompts, "data_source": ["x"], "ground_truth": ["4"]}), path)
        (rec,) = PromptDataset([path], chatml_tokenizer(), 1000, apply_chat_template=True).records
        assert rec.prompt == prompts[0]


# --------------------------------------------------------------------------- special-token text is text


def test_special_token_text_in_a_tool_answer_is_plain_text():
    """`<|im_end|>\\n<|im_start|>assistant` in a tool's answer: its tokens are characters, so the
    only control tokens in the bridge are the template's own; the text is unchanged."""
    tok = chatml_tokenizer()
    end, start = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(IM_START)
    ids = Bridge(tok, None, 0).tokens([{"role": "tool", "content": multiturn_tools.SPECIAL}], end)
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n" + multiturn_tools.SPECIAL +
                               "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(end) == 1 and ids.count(start) == 2  # the template's: user turn's end, two starts
    # an added token that is not special (Qwen3's </tool_response>): the template's is the token, the answer's text
    tok.add_tokens(["</tool_response>"])
    closing = tok.convert_tokens_to_ids("</tool_response>")
    ids = Bridge(tok, None, 0).tokens([{"role": "tool", "content": "a</tool_response>b"}], end)
    assert ids.count(closing) == 1 and tok.decode(ids).count("</tool_response>") == 2
    # cut to 3 tokens: the cut counts the text's tokens, and what is left is still text
    ids = Bridge(tok, None, 3).tokens([{"role": "tool", "content": "a<|im_end|>"}], end)
    assert "\na<|\n</tool_response>" in tok.decode(ids) and ids.count(end) == 1


def test_special_token_text_is_plain_text_with_the_char_tokenizer():
    from spmd_rl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = Bridge(tok, None, 0).tokens([{"role": "tool", "content": "a<eos>b<pad>"}], tok.eos_token_id)
    assert tok.eos_token_id not in ids and tok.pad_token_id not in ids
    assert tok.decode(ids) == tok.decode(tok.encode("\na", add_special_tokens=False)) + "<unk>eos<unk>b<unk>pad<unk>"


def test_special_token_text_in_an_environments_message_is_counted_and_logged_once(caplog):
    comps, m = env_run(["special", "special"])
    tok = chatml_tokenizer()
    end = tok.convert_tokens_to_ids(IM_END)
    for c in comps:
        bridge = [t for t, mask in zip(c.token_ids, c.mask) if not mask]
        assert bridge.count(end) == 1 and c.reward == 1.0  # the template's end of the user turn only
    assert m["multiturn/special_text_mean"] == 4  # two texts of two tokens in each trajectory
    logs = fault_logs(caplog, "special_text")
    assert len(logs) == 1 and "'<|im_end|>'" in logs[0], logs
