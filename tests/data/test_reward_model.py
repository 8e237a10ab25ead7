"""The reward model ([reward_model]): rendering a conversation with its own tokenizer, scores equal
to a plain transformers forward of the same texts on 1 and 2 ranks (FSDP-sharded), one-line errors
for directories that are no reward model, and a short end-to-end run with it on."""

import functools
import json
import os

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

from spmd_rl.config.run_config import load_config
from spmd_rl.model.files import ModelFilesError
from spmd_rl.model.reward_model import RewardModelError, conversation, plan_forwards, render
from spmd_rl.model.tokenizer import build_char_tokenizer
from spmd_rl.preflight import models as model_checks
from tests.helpers import ROOT
from tests.helpers.cpu_runs import run_cmd, tiny_cmd
from tests.helpers.dist_utils import run_distributed

TEXTS = [("384", "5"), ("12", "3 and more"), ("7", ""), ("what is 2+2?", "4\n#### 4"), ("99", "0")]


def save_rm(path, seed=0, num_labels=1, tokenizer=True, chat_template=True, head=True):
    """A tiny random Qwen2 reward model (Bradley-Terry: one label) with the char tokenizer."""
    tok = build_char_tokenizer()
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=num_labels,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    if head:
        model = Qwen2ForSequenceClassification(config)
    else:
        from transformers import Qwen2ForCausalLM
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(path)
    if tokenizer:
        if not chat_template:
            tok.chat_template = None
        tok.save_pretrained(path)
    return str(path)


def plain_scores(path, chats):
    """A plain transformers forward of each rendered text alone (no padding, no FSDP)."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for chat in chats:
            if tok.chat_template:
                enc = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False, return_tensors="pt")
            else:
                enc = tok("\n".join(m["content"] for m in chat), return_tensors="pt")
            out.append(float(model(**enc).logits[0, 0]))
    return torch.tensor(out)


def test_conversation_and_rendering():
    tok = build_char_tokenizer()
    assert conversation("384", "5") == [{"role": "user", "content": "384"}, {"role": "assistant", "content": "5"}]
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "12"}]
    assert conversation(msgs, "3")[:2] == msgs
    turns = [{"role": "assistant", "content": "a"}, {"role": "tool", "content": "7"}, {"role": "assistant", "content": "8"}]
    assert conversation("ab", "a7=8", turns) == [{"role": "user", "content": "ab"}] + turns  # multi-turn: its messages
    assert tok.decode(render(tok, conversation("384", "5"))) == "384=5\n"  # the char template
    tok.chat_template = None
    assert tok.decode(render(tok, conversation("384", "5"))) == "384\n5"  # no template: contents, newline-joined


def test_a_chat_template_that_refuses_the_conversation_is_one_line():
    tok = build_char_tokenizer()
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}"
    with pytest.raises(RewardModelError, match=r"reward model's chat template cannot render the conversation "
                                               r"\(TemplateError: no tools; roles \['user', 'tool'\]\): set "
                                               "reward_model.tokenizer"):
        render(tok, [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}])


def _refusal_worker(rank, world, path):
    from spmd_rl.model.reward_model import RewardModel

    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}{% endif %}{% endfor %}"
    model = AutoModelForSequenceClassification.from_pretrained(path)
    chats = [[{"role": "user", "content": "a"}, {"role": "tool" if rank == 1 else "assistant", "content": "b"}]]
    with pytest.raises(RewardModelError, match="no tools"):  # on rank 0 too, with rank 1's message
        RewardModel(model, tok, torch.device("cpu"), micro_batch_size=2).score(chats)


def test_a_refusal_on_one_rank_stops_every_rank_with_its_message(tmp_path):
    run_distributed(_refusal_worker, 2, save_rm(tmp_path / "rm"))


def test_plan_forwards_sorts_by_length_and_keeps_the_budget():
    lengths = [3, 10, 4, 9, 2]
    assert plan_forwards(lengths, rows=2) == [[1, 3], [2, 0], [4]]
    plans = plan_forwards(lengths, rows=99, max_tokens=20)
    assert sorted(i for p in plans for i in p) == list(range(5))
    assert all(len(p) * lengths[p[0]] <= 20 or len(p) == 1 for p in plans), plans
    assert plan_forwards([50, 1], rows=8, max_tokens=20) == [[0], [1]]  # too long: a forward of its own


def _score_worker(rank, world, path, per_rank, max_tokens, template):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import build_sharded, load_reward_model, reward_pad_id
    from spmd_rl.model.reward_model import RewardModel

    tok = AutoTokenizer.from_pretrained(path)
    load = functools.partial(load_reward_model, path, torch.float32, reward_pad_id(path, tok))
    model = build_sharded(load, init_device_mesh("cpu", (world,)), torch.float32, False)
    rm = RewardModel(model, tok, torch.device("cpu"), micro_batch_size=2, max_tokens=max_tokens)
    mine = per_rank[rank]  # ranks hold different counts (rank 1 none at all on 2 ranks): forwards still agree
    chats = [conversation(p, r) for p, r in mine]
    got = rm.score(chats)
    want = plain_scores(path, chats) if chats else torch.zeros(0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world,max_tokens,template", [(1, 0, True), (2, 0, True), (2, 24, False)])
def test_scores_equal_a_plain_transformers_forward(tmp_path, world, max_tokens, template):
    path = save_rm(tmp_path / "rm", chat_template=template)
    per_rank = [TEXTS] if world == 1 else [TEXTS, []]
    if max_tokens:
        per_rank = [TEXTS[:2], TEXTS[2:]]
    run_distributed(_score_worker, world, path, per_rank, max_tokens, template)


def rm_config(**rm):
    overrides = [f"reward_model.{k}={json.dumps(v)}" for k, v in rm.items()]
    return load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml"), overrides)


@pytest.mark.parametrize("kind,message", [
    ("no_head", "is not a reward model: config.json's architectures are ['Qwen2ForCausalLM'], not a "
                "*ForSequenceClassification"),
    ("two_labels", "has num_labels = 2: a reward model gives one score per sequence"),
    ("no_tokenizer", "has no tokenizer files"),
    ("missing", "does not exist"),
])
def test_a_directory_that_is_no_reward_model_is_one_line(tmp_path, kind, message):
    path = tmp_path / "rm"
    if kind != "missing":
        save_rm(path, head=kind != "no_head", num_labels=2 if kind == "two_labels" else 1,
                tokenizer=kind != "no_tokenizer")
    with pytest.raises(ModelFilesError) as e:
        model_checks.check_reward_model_files(rm_config(path=str(path)))
    assert f"reward_model.path = {str(path)!r}" in str(e.value) and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_torchrun_refuses_a_causal_lm_as_reward_model_in_one_line_before_loading(tmp_path):
    from tests.test_user_errors import assert_one_line_error

    path = save_rm(tmp_path / "lm", head=False)
    p = run_cmd(tiny_cmd(tmp_path / "run", f"reward_model.path={path}"))
    assert_one_line_error(p, f"reward_model.path = {path!r} is not a reward model")
    assert not (tmp_path / "run").exists()  # refused by the config check, before anything was written


MULTI_TURN = ["data.synthetic_task=hidden", "data.max_response_length=16", "data.val_files=[]",
              "rollout.environment=spmd_rl.envs.hidden_digit:HiddenDigitEnv", "rollout.max_turns=2",
              "rollout.stop_token_ids=[3,4,5,6,7,8,9,10,11,12,48]"]  # tests/e2e/test_multiturn_e2e.py's task


@pytest.mark.parametrize("turns", ["single", "multi"])
def test_torchrun_with_a_reward_model_logs_its_share(tmp_path, turns):
    """2 ranks, 2 steps: reward/mean is the weighted sum of reward/rule_mean and reward/rm_mean
    (multi-turn: the rule part is the environment's reward; the RM reads the whole conversation)."""
    path = save_rm(tmp_path / "rm")
    run_dir = tmp_path / "run"
    more = MULTI_TURN if turns == "multi" else ["trainer.val_every=1"]
    p = run_cmd(tiny_cmd(run_dir, f"reward_model.path={path}", "reward_model.weight=2.0",
                         "reward.rule_weight=0.5", "reward_model.max_token_len_per_gpu=64", *more))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    steps = [m for m in steps if "reward/rm_mean" in m]
    assert len(steps) == 2, steps
    for m in steps:
        assert m["reward/rm_mean"] != 0.0 and "time/reward_model" in m
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/rule_mean"] + 2.0 * m["reward/rm_mean"], abs=1e-5)


def test_the_reward_model_moves_with_the_training_state():
    """rollout.offload_train_states: the reward model leaves the GPU while the engine generates, as the
    reference model does (Trainer._train_state lists what train.offload.TrainStateOffload moves)."""
    from types import SimpleNamespace

    from spmd_rl.trainer import Trainer

    actor, ref, rm = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    opt = torch.optim.AdamW(actor.parameters())
    fake = SimpleNamespace(actor=actor, critic=None, ref=ref, reward_model=SimpleNamespace(model=rm), actor_opt=opt,
                           critic_opt=None, cfg=SimpleNamespace(actor=SimpleNamespace(offload_optimizer=False)))
    models, optimizers = Trainer._train_state(fake)
    assert models == [actor, ref, rm] and optimizers == [opt]


class RecordingRM:
    def __init__(self):
        self.chats = None

    def score(self, chats):
        self.chats = chats
        return torch.arange(len(chats), dtype=torch.float32) / 10


def test_the_step_scores_weighted_parts_and_gives_the_rm_each_conversation():
    """Trainer.score: scores = reward.rule_weight x rule + reward_model.weight x RM; the RM gets [the
    data's prompt, the response] of a single-turn row and [prompt, the trajectory's messages] of a
    multi-turn one (meta["messages"], from Completion.messages)."""
    from types import SimpleNamespace

    from spmd_rl.batching.batch import build_rollout_batch
    from spmd_rl.data.rewards import RewardFunction
    from spmd_rl.rollout.base import Completion
    from spmd_rl.trainer import Trainer

    tok = build_char_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    turns = [{"role": "assistant", "content": "?"}, {"role": "user", "content": "7"}, {"role": "assistant", "content": "7"}]
    comps = [[Completion(enc("5"), None, "stop")],
             [Completion(enc("?") + enc("7") + enc("7"), None, "stop", mask=[1, 0, 1], messages=turns)]]
    meta = {"data_source": ["synthetic/successor"] * 2, "ground_truth": ["5", "77"], "extra_info": [{}, {}],
            "index": [0, 1], "prompt": ["384", [{"role": "user", "content": "ab"}]]}
    batch = build_rollout_batch([enc("384="), enc("ab")], comps, tok.pad_token_id, meta)
    cfg = rm_config(path="x", weight=2.0)
    cfg.reward.rule_weight = 0.5
    rm = RecordingRM()
    fake = SimpleNamespace(tokenizer=tok, reward_fn=RewardFunction(cfg.reward), reward_model=rm, cfg=cfg,
                           samples=SimpleNamespace(offer=lambda *args: None))  # trainer.log_samples: none picked
    Trainer.score(fake, batch)
    assert rm.chats == [[{"role": "user", "content": "384"}, {"role": "assistant", "content": "5"}],
                        [{"role": "user", "content": "ab"}, *turns]]
    torch.testing.assert_close(batch["rule_scores"], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(batch["scores"], 0.5 * torch.tensor([1.0, 1.0]) + 2.0 * torch.tensor([0.0, 0.1]))
    assert "prompt" not in batch.meta and "messages" not in batch.meta  # they do not travel with the rows
