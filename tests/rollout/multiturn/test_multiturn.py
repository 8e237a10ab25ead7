"""Multi-turn rollouts (spmd_rl/rollout/multiturn/): the token layout of a trajectory, the bridge
from a tools chat template, tool failures, budgets, environments, the lockstep loop across ranks,
the config's refusals. Engines are doubles replaying scripted tokens where the point is the layout."""

import json
import time

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spmd_rl.batching.batch import build_rollout_batch, response_token_ids
from spmd_rl.config.run_config import config_from_dict
from spmd_rl.data.prompts import PromptRecord
from spmd_rl.errors import ConfigError
from spmd_rl.preflight import user_code
from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.rollout.multiturn import MultiTurnRollout
from spmd_rl.rollout.multiturn.bridge import Bridge, TemplateError
from spmd_rl.rollout.multiturn.parsers import CallError, HermesParser, ToolCall
from tests.helpers.dist_utils import run_distributed

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# A Qwen2.5-style ChatML template with tools (written here: no hub): tools in a system block, tool
# messages as <tool_response> blocks in a user turn, "<|im_end|>\n" after every turn.
CHATML_TOOLS = (  # (transformers renders with trim_blocks: a newline right after a {% %} tag is dropped)
    "{% if tools %}{{ '<|im_start|>system\\n# Tools' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n' if loop.first or messages[loop.index0 - 1].role != 'tool' else '\\n' }}"
    "{{ '<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_tokenizer(template=CHATML_TOOLS):
    """One token per printable character, plus the ChatML special tokens."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(["<pad>", IM_END, IM_START] + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token=IM_END,
                                  additional_special_tokens=[IM_START], chat_template=template,
                                  clean_up_tokenization_spaces=False)
    return tok


def Record(prompt_ids, ground_truth="", extra_info=None, index=0):
    return PromptRecord(index, prompt_ids, "test", ground_truth, extra_info or {})


class ScriptedEngine:
    """Replays scripted turns: for a prompt starting with script k's prompt, the next of its turns
    (cut at the call's limit, "length" then). Records every call's prompts, limits and seeds."""

    def __init__(self, scripts, eos):
        self.scripts = scripts  # [(prompt ids, [turn ids...])]
        self.eos = eos
        self.turn_start = chatml_tokenizer().encode(IM_START + "assistant\n", add_special_tokens=False)
        self.calls = []

    def generate(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        assert sampling.n == 1
        self.calls.append((prompts, max_new_tokens, sampling.seed, asks_logprobs))
        out = []
        for p, limit, asks in zip(prompts, max_new_tokens, asks_logprobs):
            k = next(i for i, (sp, _) in enumerate(self.scripts) if p[:len(sp)] == sp)
            rest = p[len(self.scripts[k][0]):]  # turns so far: the generation prompts after the prompt
            done = sum(rest[i:i + len(self.turn_start)] == self.turn_start for i in range(len(rest)))
            turn = self.scripts[k][1][done][:limit]
            reason = "stop" if turn and turn[-1] == self.eos else "length"
            out.append([Completion(turn, [-0.01 * (j + 1) for j in range(len(turn))] if asks else None, reason)])
        return out


def rollout_cfg(**kw):
    return config_from_dict({"rollout": kw}).rollout


def tools_cfg(*names, **kw):
    return rollout_cfg(tools=[{"function": f"tests.helpers.multiturn_tools:{n}"} for n in names], **kw)


def call(name, **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


# --------------------------------------------------------------------------- layout


def test_two_tool_calls_give_the_exact_row_and_mask():
    """A scripted trajectory: call add, call mul, answer. The row is the prompt, then the engine's
    sampled tokens (mask 1, their log-probs) and between them exactly the template's bridge text
    (mask 0, log-prob 0); decoded, it is the template's rendering of the whole conversation."""
    tok = chatml_tokenizer()
    mt = MultiTurnRollout(tools_cfg("add", "mul", max_turns=5), tok)
    user = [{"role": "user", "content": "(2+3)*4?"}]
    prompt = tok.apply_chat_template(user, tools=mt.schemas, add_generation_prompt=True, return_dict=False)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.convert_tokens_to_ids(IM_END)
    texts = [call("add", a=2, b=3), call("mul", a=5, b=4), "It is 20."]
    turns = [enc(t) + [eos] for t in texts]
    engine = ScriptedEngine([(prompt, turns)], eos)
    (comps,), metrics = mt.generate(engine, [Record(prompt)], SamplingParams(n=1, seed=5), budget=500)
    (c,) = comps
    bridge = [enc("\n<|im_start|>user\n<tool_response>\n" + r + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
              for r in ("5", "20")]
    assert c.token_ids == turns[0] + bridge[0] + turns[1] + bridge[1] + turns[2]
    assert c.mask == [1] * len(turns[0]) + [0] * len(bridge[0]) + [1] * len(turns[1]) + [0] * len(bridge[1]) + \
        [1] * len(turns[2])
    lp = lambda t: [-0.01 * (j + 1) for j in range(len(t))]  # noqa: E731
    assert c.logprobs == lp(turns[0]) + [0.0] * len(bridge[0]) + lp(turns[1]) + [0.0] * len(bridge[1]) + lp(turns[2])
    assert c.finish_reason == "stop" and c.reward is None
    conversation = user + [{"role": "assistant", "content": texts[0]}, {"role": "tool", "content": "5"},
                           {"role": "assistant", "content": texts[1]}, {"role": "tool", "content": "20"},
                           {"role": "assistant", "content": texts[2]}]
    rendered = tok.apply_chat_template(conversation, tools=mt.schemas, tokenize=False)
    assert tok.decode(prompt + c.token_ids) + "\n" == rendered  # the template's glue after the last turn: none
    # the conversation after the prompt, as a reward model scores it (model/reward_model.py)
    assert [{k: m[k] for k in ("role", "content")} for m in c.messages] == conversation[1:]
    assert metrics["multiturn/turns_mean"] == 3 and metrics["multiturn/tool_calls_mean"] == 2
    assert metrics["multiturn/stop_answer"] == 1 and metrics["multiturn/tool_errors_mean"] == 0
    seeds = [s for _, _, s, _ in engine.calls]
    assert len(set(seeds)) == 3 and seeds[0] == 5  # every turn its own seed
    # every turn may use what is left of the one budget
    assert [lim for _, (lim,), _, _ in engine.calls] == [500, 500 - len(turns[0] + bridge[0]),
                                                     500 - len(turns[0] + bridge[0] + turns[1] + bridge[1])]

    batch = build_rollout_batch([prompt], [comps], tok.pad_token_id)
    row, mask = batch["input_ids"][0], batch["response_mask"][0]
    assert row.tolist() == prompt + c.token_ids
    assert mask.tolist() == [0.0] * len(prompt) + [float(m) for m in c.mask]
    assert batch["attention_mask"][0].tolist() == [1] * (len(prompt) + len(c.token_ids))
    assert batch["rollout_logprobs"][0, len(prompt):].tolist() == pytest.approx(c.logprobs)
    assert int(batch["response_lens"][0]) == len(c.token_ids) and response_token_ids(batch, 0) == c.token_ids
    # the score sits on the last model token, the end of the row
    from spmd_rl.algo.algorithms import scores_to_token_rewards

    rewards = scores_to_token_rewards(torch.tensor([1.5]), batch["response_mask"])
    assert rewards[0, -1] == 1.5 and rewards.sum() == 1.5


def test_a_trajectory_asks_for_log_probs_on_every_turn_or_on_none():
    """rollout.logprob_sample_every = 2: the trajectories of prompts 0 and 2 ask on each of their
    turns and carry log-probs (0 on the bridges); those of prompt 1 ask on none and carry None, also
    when the live trajectories' positions shift from one turn to the next."""
    tok = chatml_tokenizer()
    mt = MultiTurnRollout(tools_cfg("add", max_turns=5), tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    eos = tok.convert_tokens_to_ids(IM_END)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tools=mt.schemas, add_generation_prompt=True,
                                       return_dict=False) for q in ("one?", "two?", "three?")]
    answer, tool = enc("done") + [eos], enc(call("add", a=1, b=2)) + [eos]
    scripts = [(prompts[0], [answer]), (prompts[1], [tool, answer]), (prompts[2], [tool, tool, answer])]
    engine = ScriptedEngine(scripts, eos)
    comps, _ = mt.generate(engine, [Record(p) for p in prompts], SamplingParams(n=2, seed=1, logprobs_every=2),
                           budget=500)
    assert [[c.logprobs is not None for c in cs] for cs in comps] == [[True, True], [False, False], [True, True]]
    assert [asks for _, _, _, asks in engine.calls] == [[True, True, False, False, True, True],
                                                        [False, False, True, True], [True, True]]
    c = comps[2][0]
    assert len(c.logprobs) == len(c.token_ids) and [lp for lp, m in zip(c.logprobs, c.mask) if not m] == \
        [0.0] * (len(c.mask) - sum(c.mask))
    batch = build_rollout_batch(prompts, comps, tok.pad_token_id)
    assert batch["has_rollout_logprobs"].tolist() == [True, True, False, False, True, True]


def test_bridge_leaves_the_sampled_end_of_turn_to_the_model_and_refuses_history_rewrites():
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    b = Bridge(tok, None, 0)
    text = lambda ids: tok.decode(ids)  # noqa: E731
    env_msg = [{"role": "user", "content": "try again"}]
    assert text(b.tokens(env_msg, eos)) == "\n<|im_start|>user\ntry again<|im_end|>\n<|im_start|>assistant\n"
    # a turn that ended on another stop token: the template's end-of-turn is part of the bridge
    assert text(b.tokens(env_msg, tok.encode(".", add_special_tokens=False)[0])).startswith("<|im_end|>\n<|im_start|>user")
    # tool output is cut in tokens
    cut = Bridge(tok, None, 3)
    assert "\nabc\n</tool_response>" in text(cut.tokens([{"role": "tool", "content": "abcdefgh"}], eos))
    # a template that rewrites earlier turns when messages follow (drops the assistant's content)
    rewriting = CHATML_TOOLS.replace("+ m.content + '<|im_end|>", "+ ('' if (m.role == 'assistant' and not loop.last) "
                                     "else m.content) + '<|im_end|>")
    assert rewriting != CHATML_TOOLS
    with pytest.raises(TemplateError, match="rewrites the conversation"):
        Bridge(chatml_tokenizer(rewriting), None, 0).tokens(env_msg, eos)
    with pytest.raises(ConfigError, match="chat template"):
        Bridge(chatml_tokenizer(None), None, 0)


def test_char_template_renders_tool_messages_and_keeps_single_turn_bytes():
    from spmd_rl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    chat = [{"role": "user", "content": "384"}]
    assert tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == "384="
    assert tok.apply_chat_template(chat + [{"role": "assistant", "content": "5"}], tokenize=False) == "384=5\n"
    b = Bridge(tok, None, 0)
    assert tok.decode(b.tokens([{"role": "tool", "content": "\n7"}], tok.eos_token_id)) == "\n\n7"
    assert tok.decode(b.tokens([{"role": "user", "content": "x"}], tok.eos_token_id)) == "\nx="


# --------------------------------------------------------------------------- parsing and tools


def test_hermes_parser_reads_several_calls_ignores_thinking_and_reports_malformed():
    p = HermesParser()
    text = "<think>maybe " + call("add", a=9, b=9) + "</think>" + call("add", a=1, b=2) + "then " + call("mul", a=3, b=4)
    assert p.parse(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3, "b": 4})]
    assert p.parse("just an answer") == []
    bad = p.parse("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>{\"name\": \"add\"")
    assert len(bad) == 3 and all(isinstance(c, CallError) for c in bad)
    assert p.parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [ToolCall("add", {"a": 1})]


def test_tools_that_raise_hang_or_return_junk_answer_with_counted_errors():
    tok = chatml_tokenizer()
    mt = MultiTurnRollout(tools_cfg("add", "explode", "slow", "junk", max_turns=2, tool_timeout=0.3), tok)
    prompt = tok.encode("q", add_special_tokens=False)
    eos = tok.convert_tokens_to_ids(IM_END)
    enc = lambda s: tok.encode(s, add_special_tokens=False) + [eos]  # noqa: E731
    first = call("explode", x=1) + call("slow", x=1) + call("junk", x=1) + call("nope", x=1) + call("add", a=1) + \
        "<tool_call>{bad</tool_call>" + call("add", a=1, b=1)
    engine = ScriptedEngine([(prompt, [enc(first), enc("done")])], eos)
    t0 = time.perf_counter()
    (comps,), m = mt.generate(engine, [Record(prompt)], SamplingParams(n=1), budget=2000)
    assert time.perf_counter() - t0 < 2.5  # the hung tool did not hold the rollout (it sleeps 3 s)
    seen = tok.decode(comps[0].token_ids)
    for expected in ("tool 'explode' raised ValueError: boom", "tool 'slow' timed out after 0.3 s",
                     "tool 'junk' returned a int, not a string", "unknown tool 'nope'",
                     "tool 'add' raised TypeError", "not valid JSON", "<tool_response>\n2\n</tool_response>"):
        assert expected in seen, expected
    assert m["multiturn/tool_calls_mean"] == 7 and m["multiturn/tool_errors_mean"] == 6
    assert m["multiturn/tool_timeouts_mean"] == 1 and m["multiturn/tool_seconds_mean"] >= 0.3
    assert comps[0].finish_reason == "stop"
    mt.close()


# --------------------------------------------------------------------------- budgets, environments


def test_max_turns_and_the_token_budget_end_trajectories():
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    enc = lambda s: tok.encode(s, add_special_tokens=False) + [eos]  # noqa: E731
    prompts = [tok.encode(s, add_special_tokens=False) for s in ("a", "b", "c")]
    again = enc(call("add", a=1, b=1))
    engine = ScriptedEngine([(p, [again] * 4) for p in prompts], eos)
    mt = MultiTurnRollout(tools_cfg("add", max_turns=2), tok)
    bridge_len = len(mt.bridge.tokens([{"role": "tool", "content": "2"}], eos))
    budgets = [2 * len(again) + bridge_len, len(again) + bridge_len, 10]
    outs = []
    for p, budget in zip(prompts, budgets):  # max_turns; the bridge leaves no room; the turn is cut
        (comps,), m = mt.generate(engine, [Record(p)], SamplingParams(n=1), budget=budget)
        outs.append((comps[0], m))
    (a, ma), (b, mb), (c, mc) = outs
    assert ma["multiturn/stop_max_turns"] == 1 and ma["multiturn/turns_mean"] == 2 and len(a.token_ids) == budgets[0]
    assert mb["multiturn/stop_bridge_overflow"] == 1 and b.token_ids == again  # no bridge appended
    assert mc["multiturn/stop_length"] == 1 and c.token_ids == again[:10] and c.finish_reason == "length"
    for comp, budget in zip((a, b, c), budgets):
        assert len(comp.token_ids) <= budget and len(comp.mask) == len(comp.token_ids) == len(comp.logprobs)
        assert comp.mask[-1] == 1  # a trajectory ends on a model token


def test_environment_keeps_state_across_turns_and_gives_the_reward():
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    mt = MultiTurnRollout(rollout_cfg(environment="tests.helpers.multiturn_tools:CountingEnv", max_turns=9), tok)
    prompt = tok.encode("p", add_special_tokens=False)
    say = tok.encode("hm", add_special_tokens=False) + [eos]
    engine = ScriptedEngine([(prompt, [say] * 4)], eos)
    (comps,), m = mt.generate(engine, [Record(prompt, extra_info={"turns": 3})], SamplingParams(n=2), budget=400)
    assert len(comps) == 2  # n trajectories, each with its own environment
    for c in comps:
        text = tok.decode(c.token_ids)
        assert text.count("<|im_start|>user\n1<|im_end|>") == 1 and text.count("<|im_start|>user\n2<|im_end|>") == 1
        assert c.reward == 3.0 and c.finish_reason == "stop"
    assert m["multiturn/turns_mean"] == 3
    batch = build_rollout_batch([prompt], [comps], tok.pad_token_id, {"data_source": ["test"]})
    assert batch.meta["env_reward"] == [3.0, 3.0]
    assert [[m["role"] for m in ms] for ms in batch.meta["messages"]] == [["assistant", "user"] * 2 + ["assistant"]] * 2


# --------------------------------------------------------------------------- the loop across ranks


class CollectiveEngine:
    """Like a TP group's vLLM engine: every generate is a collective (an all_gather), so a rank that
    stops calling it hangs the others. Rank 0's trajectories answer at once; rank 1's call a tool
    three times first."""

    def __init__(self, rank, eos, tool_turn, answer):
        self.rank, self.eos, self.tool_turn, self.answer, self.calls = rank, eos, tool_turn, answer, 0

    def generate(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        import torch.distributed as dist

        sizes = [None, None]
        dist.all_gather_object(sizes, len(prompts))
        self.calls += 1
        turn = self.answer if self.rank == 0 or self.calls > 3 else self.tool_turn
        return [[Completion(list(turn), [0.0] * len(turn), "stop")] for _ in prompts]


def _lockstep_body(rank, world):
    tok = chatml_tokenizer()
    eos = tok.convert_tokens_to_ids(IM_END)
    enc = lambda s: tok.encode(s, add_special_tokens=False) + [eos]  # noqa: E731
    engine = CollectiveEngine(rank, eos, enc(call("add", a=1, b=2)), enc("3"))
    mt = MultiTurnRollout(tools_cfg("add", max_turns=8), tok)
    prompts = [Record(tok.encode(f"p{i}", add_special_tokens=False)) for i in range(2)]
    (comps, m) = mt.generate(engine, prompts, SamplingParams(n=2), budget=1000)
    assert engine.calls == 4, engine.calls  # rank 0 called with empty lists after its turn 1
    assert m["multiturn/turns_mean"] == (1 if rank == 0 else 4)
    assert all(c.finish_reason == "stop" for cs in comps for c in cs)


def test_lockstep_loop_ends_on_every_rank_when_one_ranks_trajectories_finish_first():
    run_distributed(_lockstep_body, 2)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("rollout, message", [
    ({"tools": [{"function": "no_such_module:f"}]}, "rollout.tools\\[0\\].function = 'no_such_module:f': module "
                                                     "'no_such_module' not found"),
    ({"tools": [{"function": "tests.helpers.multiturn_tools:nope"}]}, "has no attribute 'nope'"),
    ({"tools": [{"function": "tests.helpers.multiturn_tools:NOT_CALLABLE"}]}, "is a int, not a function"),
    ({"tools": [{"function": "tests.helpers.multiturn_tools:untyped"}]}, "'untyped' has no usable schema .*missing a type hint"),
    ({"tools": [{"fn": "tests.helpers.multiturn_tools:add"}]}, "each \\[\\[rollout.tools\\]\\] entry is one key"),
    ({"tools": [{"function": "tests.helpers.multiturn_tools:add"}], "environment": "tests.helpers.multiturn_tools:CountingEnv"},
     "cannot be used together"),
    ({"environment": "tests.helpers.multiturn_tools:CountingEnv", "max_turns": 0}, "rollout.max_turns = 0 must be >= 1"),
    ({"environment": "tests.helpers.multiturn_tools:add"}, "has no reset or step method"),
    ({"tools": [{"function": "tests.helpers.multiturn_tools:add"}], "tool_parser": "tests.helpers.multiturn_tools:Missing"}, "no attribute 'Missing'"),
])
def test_config_refuses_bad_multi_turn_settings_in_one_line(rollout, message):
    cfg = config_from_dict({"rollout": rollout})
    with pytest.raises(ConfigError, match=message) as e:
        cfg.rollout.check_multi_turn()  # the keys together
        user_code.check_multi_turn_code(cfg)  # what they name imports and fits
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- training on gaps


def test_masked_loss_packed_equals_padded_and_bridge_tokens_do_not_count(tmp_path):
    """Rows with gaps in the mask (multi-turn): the token-mean loss and its gradients are the same
    packed and padded, and equal the reference computed from the model tokens alone."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from spmd_rl.algo.algorithms import agg_loss
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import forward_logprobs

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48,
                                                 num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2)).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(1)
    tok = lambda n: torch.randint(3, 50, (n,), generator=g).tolist()  # noqa: E731
    comps = [[Completion(tok(9), [0.0] * 9, "stop", [1, 1, 0, 0, 0, 1, 1, 0, 1])],
             [Completion(tok(4), [0.0] * 4, "stop")],
             [Completion(tok(12), [0.0] * 12, "length", [1] * 3 + [0] * 6 + [1] * 3)]]
    batch = build_rollout_batch([tok(3), tok(5), tok(2)], comps, 0)
    mask = batch["response_mask"]
    adv = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    out = {}
    for packed in (False, True):
        model = load_causal_lm(str(tmp_path), torch.float64, remove_padding=packed)
        logp, _ = forward_logprobs(model, batch, 1.0)
        loss = agg_loss(-logp * adv, mask, "token-mean")
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[packed] = (loss.detach(), logp.detach(), grads)
    torch.testing.assert_close(out[True][0], out[False][0], rtol=0, atol=1e-12)
    for n in out[False][2]:
        torch.testing.assert_close(out[True][2][n], out[False][2][n], rtol=0, atol=1e-10, msg=n)
    # reference: the mean over the model's tokens, listed from the completions' own masks
    logp = out[False][1]
    terms = []
    for i, (p, (c,)) in enumerate(zip([3, 5, 2], comps)):
        for j, m in enumerate(c.mask or [1] * len(c.token_ids)):
            if m:
                terms.append(-logp[i, p + j] * adv[i, p + j])
    assert len(terms) == int(mask.sum()) == 5 + 4 + 6
    torch.testing.assert_close(out[False][0], torch.stack(terms).mean(), rtol=0, atol=1e-12)


def test_hf_engine_cuts_each_prompt_at_its_own_limit():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from spmd_rl.rollout.hf_engine import HFEngine

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    engine = HFEngine(model, 0, [1], torch.device("cpu"))
    prompts = [[5, 6, 7], [8, 9], [10]]
    sp = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    full = engine.generate(prompts, sp)
    cut = engine.generate(prompts, sp, max_new_tokens=[2, 6, 4])
    for f, c, k in zip(full, cut, [2, 6, 4]):  # greedy: a cut row is the uncut row's first k tokens
        assert c[0].token_ids == f[0].token_ids[:k] and c[0].logprobs == pytest.approx(f[0].logprobs[:k])
        assert c[0].finish_reason == ("length" if len(f[0].token_ids) > k or f[0].finish_reason == "length" else "stop")


# --------------------------------------------------------------------------- metrics over several generate calls


def test_merged_metrics_of_two_calls_are_those_of_all_their_trajectories():
    """merge_trajectory_metrics of two calls' metrics (3 and 1 trajectories) == trajectory_metrics
    of the 4 trajectories together."""
    from spmd_rl.rollout.multiturn import merge_trajectory_metrics
    from spmd_rl.rollout.multiturn.loop import trajectory_metrics

    def traj(turns, calls, stop):
        return type("T", (), {"turns": turns, "counts": {"tool_calls": calls}, "stop": stop})()

    first = [traj(1, 0, "answer"), traj(3, 2, "max_turns"), traj(2, 1, "answer")]
    second = [traj(4, 5, "length")]
    merged: dict = {}
    for call in (first, second):
        merge_trajectory_metrics(merged, trajectory_metrics(call, ("tool_calls",)))
    want = trajectory_metrics(first + second, ("tool_calls",))
    assert merged == pytest.approx(want) and merged["multiturn/trajectories"] == 4
    assert merged["multiturn/turns_mean"] == 2.5 and merged["multiturn/stop_answer"] == 0.5


def _dynamic_sampling_body(rank, world, base):
    import spmd_rl.algo.dynamic_sampling as ds
    import spmd_rl.rollout.multiturn as mt
    from spmd_rl.trainer import PhaseTimer
    from tests.e2e.test_multiturn_e2e import HIDDEN
    from tests.train.test_old_logprobs import _trainer

    rounds, keys = [], set()
    original = mt.trajectory_metrics
    mt.trajectory_metrics = lambda trajectories, ks: rounds.append(list(trajectories)) or keys.update(ks) or \
        original(trajectories, ks)
    ds.is_informative = lambda scores, rows: False  # every group uniform: all max_rounds rounds are drawn
    trainer = _trainer(f"{base}/run", f"{base}/data", [*HIDDEN, "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=4",
                                                       "algorithm.dynamic_sampling=true",
                                                       "algorithm.dynamic_sampling_max_rounds=3"], rank)
    try:
        timer = PhaseTimer(trainer.device)
        _, sampled = trainer.sample_batch(timer)
    finally:
        trainer.close()
    assert sampled["dynamic_sampling/rounds"] == 3 and len(rounds) == 3
    want = original([t for r in rounds for t in r], tuple(keys))
    got = {k: v for k, v in timer.metrics.items() if k.startswith("multiturn/")}
    assert got == pytest.approx(want) and got["multiturn/trajectories"] == 48, (got, want)
    last = original(rounds[-1], tuple(keys))
    assert any(last[k] != pytest.approx(want[k]) for k in want if k != "multiturn/trajectories"), \
        "the rounds' trajectories are alike: this test could not tell the last round from all"


def test_dynamic_sampling_reports_the_multi_turn_metrics_of_every_round(tmp_path):
    """Dynamic sampling's three rounds of multi-turn rollouts: the step's multiturn/* metrics are
    those of all 48 trajectories drawn, not of the last round's 16."""
    run_distributed(_dynamic_sampling_body, 1, str(tmp_path))
