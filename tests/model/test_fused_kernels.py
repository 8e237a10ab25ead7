"""The fused-kernel switches on CPU (model.fused_kernels, model.fused_logprob_head): config keys,
liger's fallback (one warning, the unfused numbers bit for bit), switching back, and the compiled
decoder layers + log-prob head against eager (dynamo + AOTAutograd; inductor's C++ codegen takes
minutes on CPU, so the compiled kernels themselves are checked by tests/gpu/test_fused_gpu.py)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmd_rl import preflight
from spmd_rl.batching.batch import Batch
from spmd_rl.errors import ConfigError
from spmd_rl.model import fused_kernels
from spmd_rl.model.loading import prepare_policy
from spmd_rl.train.actor import forward_logprobs
from tests.config.test_config import valid_cfg
from tests.helpers.dist_utils import full, run_distributed


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))


def ragged_batch(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 97, (len(lens), max(lens)), generator=g)
    attn = torch.zeros(len(lens), max(lens), dtype=torch.long)
    for i, n in enumerate(lens):
        attn[i, :n] = 1
    return Batch({"input_ids": ids * attn, "attention_mask": attn})


def run(model, lens, seed=0):
    """log-probs, entropy (both differentiable) and the parameters' gradients of one packed batch."""
    model.zero_grad(set_to_none=True)
    logp, ent = forward_logprobs(model, ragged_batch(lens, seed), 0.7, with_entropy=True, entropy_grad=True)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ((logp * w).sum() + (ent * w.flip(-1)).sum()).backward()
    return logp.detach(), ent.detach(), [p.grad.clone() for p in model.parameters()]


def fallback_warnings(caplog):
    return [r for r in caplog.records if r.name == "spmd_rl.model.fused_kernels" and r.levelno == logging.WARNING]


def test_config_keys(tmp_path):
    cfg = valid_cfg(tmp_path, ['model.fused_kernels="liger"', 'model.fused_logprob_head="compile"'])
    assert (cfg.model.fused_kernels, cfg.model.fused_logprob_head) == ("liger", "compile")
    assert valid_cfg(tmp_path, ['model.fused_kernels="compile"']).model.fused_kernels == "compile"
    base = valid_cfg(tmp_path)
    assert (base.model.fused_kernels, base.model.fused_logprob_head) == ("none", "none")  # off by default
    preflight.validate(cfg, world_size=1)
    for overrides, needle in ((['model.fused_kernels="triton"'], "model.fused_kernels = 'triton' is not one of 'none', "
                               "'liger', 'compile'"),
                              (['model.fused_logprob_head="liger"'], "model.fused_logprob_head = 'liger' is not one of "
                               "'none', 'compile'"),
                              (['model.fused_logprob_head="compile"', "model.chunked_logprobs=false"],
                               "set model.chunked_logprobs = true")):
        with pytest.raises(ConfigError) as e:
            preflight.validate(valid_cfg(tmp_path, overrides), world_size=1)
        assert needle in str(e.value)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_liger_falls_back_with_one_warning_and_the_unfused_numbers(caplog, device_type):
    """On CPU, or without liger-kernel/Triton, "liger" runs the unfused modules: one warning per
    process whatever the number of models and calls, and the same numbers bit for bit. With
    device_type "cuda" on this CPU machine the modules are patched where liger-kernel imports, and
    the CPU tensors reaching them take the unfused code (the same single warning)."""
    fused_kernels._reset_warning()
    base = tiny_model()
    plain = prepare_policy(copy.deepcopy(base), remove_padding=True)
    want = run(plain, [5, 9, 3])
    with caplog.at_level(logging.WARNING, logger="spmd_rl.model.fused_kernels"):
        models = []
        for _ in range(2):  # actor and reference, say
            model = prepare_policy(copy.deepcopy(base), remove_padding=True)
            fused_kernels.apply(model, "liger", device_type=device_type)
            models.append(model)
        for model in models:
            got = run(model, [5, 9, 3])
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert all(torch.equal(a, b) for a, b in zip(got[2], want[2]))
    warnings = fallback_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "model.fused_kernels = 'liger'" in warnings[0].getMessage() and "unfused" in warnings[0].getMessage()
    patched = device_type == "cuda" and fused_kernels.liger_problem(None, "cuda") is None  # liger-kernel imports
    assert all(fused_kernels.active_mode(m) == ("liger" if patched else "none") for m in models)
    fused_kernels.restore(models[0])  # every patched module gets its own forward back
    assert not [n for n, m in models[0].named_modules() if n and "forward" in m.__dict__]
    assert fused_kernels.active_mode(models[0]) == "none"


def test_prepare_policy_passes_the_switches():
    fused_kernels._reset_warning()
    model = prepare_policy(tiny_model(), True, True, fused_kernels="compile", fused_logprob_head="compile")
    assert fused_kernels.active_mode(model) == "compile" and model.spmd_logprob_head == "compile"
    assert all("forward" in layer.__dict__ for layer in fused_kernels.decoder_layers(model))
    with pytest.raises(ValueError, match="fused_logprob_head = 'liger'"):
        prepare_policy(tiny_model(), fused_logprob_head="liger")


def test_compiled_layers_and_head_match_eager_without_recompiling(monkeypatch):
    """fused_kernels = "compile" + fused_logprob_head = "compile": the same log-probs, entropy and
    gradients as eager (float32 tolerance), and a second packed batch of other lengths and another
    sequence count reuses the graphs (dynamic shapes: no recompile per micro-batch)."""
    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    base = tiny_model()
    eager = prepare_policy(copy.deepcopy(base), remove_padding=True)
    fused = prepare_policy(copy.deepcopy(base), True, True, fused_kernels="compile", fused_logprob_head="compile")
    batches = ([5, 9, 3], [7, 4, 8, 2, 6])
    graphs = []
    for lens in batches:
        want, got = run(eager, lens), run(fused, lens)
        graphs.append(fused_kernels.compiled_graphs())
        for a, b in zip(got[:2], want[:2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(got[2], want[2]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert graphs[1] == graphs[0] > 0, graphs
    with torch.no_grad():  # no-grad passes (the old / reference log-probs) too
        want = forward_logprobs(eager, ragged_batch([6, 2, 9]), 1.0)[0]
        torch.testing.assert_close(forward_logprobs(fused, ragged_batch([6, 2, 9]), 1.0)[0], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="fake CUDA tensors need a CUDA build of torch")
def test_compiled_layer_on_cuda_is_one_graph_with_the_varlen_kernel(monkeypatch):
    """What dynamo makes of a decoder layer on CUDA, traced here on fake CUDA tensors (no GPU): one
    graph per layer class, no graph break, PyTorch's varlen attention op inside it, the maximum
    length symbolic and the attention scale a constant, and three packed batches of other lengths
    and sequence counts reuse it."""
    import itertools

    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    from spmd_rl.model import varlen_attention

    config = tiny_model().config
    config._attn_implementation = varlen_attention.register()
    monkeypatch.setattr(varlen_attention, "_VARLEN_KW", varlen_attention._varlen_kwargs())  # register() does on a GPU
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward  # runs on the fake tensors

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": record})
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with mode, torch.device("cuda"):
            layer, rotary = Qwen2DecoderLayer(config, 0), Qwen2RotaryEmbedding(config)
    finally:
        torch.set_default_dtype(default_dtype)
    forward = fused_kernels.compiled(Qwen2DecoderLayer.forward, dynamic=True)
    for lens in ([5, 9, 3], [7, 4, 8, 2, 6], [30, 2]):
        with mode, torch.device("cuda"):
            hidden = torch.randn(1, sum(lens), config.hidden_size, requires_grad=True)
            positions = torch.cat([torch.arange(n) for n in lens])[None]
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            out = fused_kernels._call_compiled_layer(
                forward, layer, hidden, attention_mask=None, position_ids=positions, past_key_values=None,
                use_cache=False, position_embeddings=rotary(hidden, positions), cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                max_length_q=max(lens), max_length_k=max(lens))
        assert out.shape == hidden.shape and out.device.type == "cuda"
    assert len(graphs) == 1, [g.code for g in graphs]
    code = graphs[0].code
    assert "torch.ops.torch_attn._varlen_attn(" in code and "l_kwargs_max_length_q_" in code, code
    assert f", {(config.hidden_size // config.num_attention_heads) ** -0.5}, " in code, code  # the scale, a constant


def _layer_symbols_under_fsdp_body(rank, world, base):
    from spmd_rl.model.loading import apply_fsdp
    from spmd_rl.runtime.distributed import fsdp_mesh

    symbols = []

    def record(gm, example_inputs):  # the symbols of each graph dynamo makes, by where they come from
        shape_env = torch._guards.detect_fake_mode(example_inputs).shape_env
        symbols.append(sorted(s.name for sources in shape_env.var_to_sources.values() for s in sources))
        return gm.forward

    fused_kernels.COMPILE_OPTIONS = {"backend": record}  # this worker process only
    model = prepare_policy(tiny_model(), True, True, fused_kernels="compile")
    apply_fsdp(model, fsdp_mesh("cpu", world), torch.float32)
    graphs = []
    for lens in ([5, 9, 3], [7, 4, 8, 2, 6]):
        run(model, lens)
        graphs.append(len(symbols))
    assert graphs[1] == graphs[0], f"a second micro-batch of other lengths compiled again: {graphs}"
    layer_graphs = [names for names in symbols if any("hidden_states" in n for n in names)]
    assert layer_graphs, symbols
    from_the_module = sorted({n for names in layer_graphs for n in names if n.startswith("L['self']")})
    assert not from_the_module, f"module attributes became symbols of the compiled layer: {from_the_module}"


def test_compiled_layer_under_fsdp_keeps_the_modules_ints_constant(tmp_path):
    """Decoder layers wrapped by FSDP2's fully_shard, compiled with dynamic shapes: no symbol of their
    graphs comes from the layer itself (head_dim, the head counts), only from its inputs (why:
    fused_kernels._call_compiled_layer), and a micro-batch of other lengths compiles nothing new
    (here, on CPU, the graphs on either side of the attention's graph break). That the longest
    sequence stays symbolic on CUDA: test_compiled_layer_on_cuda_is_one_graph_with_the_varlen_kernel."""
    run_distributed(_layer_symbols_under_fsdp_body, 1, str(tmp_path))


class GraphRuns:
    """A torch.compile backend: dynamo + AOTAutograd without inductor (as "aot_eager") that counts
    the runs of the compiled forward graphs, apart in the forward and in the backward (where a
    forward graph runs only for a checkpoint's recompute)."""

    def __init__(self):
        self.runs = {"forward": 0, "backward": 0}

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager, boxed_nop

        def forward_compiler(graph, graph_inputs):
            run_graph = boxed_nop(graph, graph_inputs)

            def run(args):
                self.runs["backward" if torch._C._current_autograd_node() is not None else "forward"] += 1
                return run_graph(args)

            run._boxed_call = True
            return run

        return aot_eager(gm, example_inputs, fw_compiler=forward_compiler)


def checkpointing_run(kernels, share, fsdp=False):
    """A float64 tiny model with decoder kernels `kernels` ("none", "compile") and `share` of its
    layers checkpointed (set_gradient_checkpointing; with `fsdp` through apply_fsdp, FSDP2 over
    this process): the elements autograd saved in its forward, the runs of its compiled forward
    graphs in forward and backward, the eager runs of a decoder layer's MLP (outside any compiled
    graph), and run()'s log-probs, entropy and gradients (full tensors)."""
    from transformers.models.qwen2 import modeling_qwen2

    from spmd_rl.model.loading import apply_fsdp, set_gradient_checkpointing
    from tests.batching.test_packing import saved_elements

    graph_runs, eager_mlp, mlp_forward = GraphRuns(), [0], modeling_qwen2.Qwen2MLP.forward

    def counted_mlp_forward(self, x):
        eager_mlp[0] += not torch.compiler.is_compiling()
        return mlp_forward(self, x)

    options = fused_kernels.COMPILE_OPTIONS
    fused_kernels.COMPILE_OPTIONS = {"backend": graph_runs}
    modeling_qwen2.Qwen2MLP.forward = counted_mlp_forward
    try:
        model = prepare_policy(tiny_model().double(), True, True, fused_kernels=kernels)
        if fsdp:
            from spmd_rl.runtime.distributed import fsdp_mesh

            apply_fsdp(model, fsdp_mesh("cpu", 1), torch.float64, gradient_checkpointing=share)
        else:
            set_gradient_checkpointing(model, share)
        model.train()
        batch = ragged_batch([5, 9, 3])
        saved, _ = saved_elements(lambda: forward_logprobs(model, batch, 0.7, with_entropy=True, entropy_grad=True))
        graph_runs.runs.update(forward=0, backward=0)  # those of run()'s forward and backward alone
        logp, ent, grads = run(model, [5, 9, 3])
    finally:
        modeling_qwen2.Qwen2MLP.forward = mlp_forward
        fused_kernels.COMPILE_OPTIONS = options
    grads = [full(g) for g in grads]
    return saved, graph_runs.runs, eager_mlp[0], [logp, ent, *grads]


def check_checkpointed_compiled_layers(fsdp, rtol, atol):
    """What checkpointing compiled layers must do, seen from outside the layers (no hook, no count of
    calls to a layer's forward): autograd saves fewer activations than for the eager model without
    checkpointing (the compiled layers save about a fifth less by themselves, so under half);
    every forward graph runs again in the backward (the recompute goes through the compiled layer)
    and no layer code runs eagerly; log-probs, entropy and gradients are the eager model's."""
    saved_kept, _, _, want = checkpointing_run("none", 0, fsdp)
    saved, runs, eager_mlp, got = checkpointing_run("compile", True, fsdp)
    assert saved < 0.5 * saved_kept, (f"checkpointed compiled layers saved {saved} elements for backward, "
                                      f"the eager model {saved_kept} without checkpointing")
    assert eager_mlp == 0, f"the decoder layers ran eagerly ({eager_mlp} MLP runs outside compiled graphs)"
    assert runs["backward"] == runs["forward"] > 0, \
        f"compiled forward graphs ran {runs['forward']} times in forward, {runs['backward']} in the recompute"
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


def test_checkpointed_compiled_layers_save_less_and_recompute_compiled():
    """configs/qwen7b.toml checkpoints activations and compiles its layers (check_checkpointed_compiled_layers;
    float64, the same numbers as eager up to rounding). transformers 5.24 checkpoints inside the
    layer class's forward, which the compiled per-instance forward skips
    (fused_kernels.set_layer_checkpointing); before the compiled layer checkpointed itself, this
    model's layers compiled nothing there and ran eagerly, forward and recompute."""
    check_checkpointed_compiled_layers(False, rtol=1e-9, atol=1e-12)


def _checkpointed_compiled_layers_under_fsdp_body(rank, world):
    check_checkpointed_compiled_layers(True, rtol=1e-5, atol=1e-7)  # gradients reduced in float32 (apply_fsdp)


def test_checkpointed_compiled_layers_under_fsdp_save_less_and_recompute_compiled(tmp_path):
    """The same through apply_fsdp (FSDP2's hooks outside the checkpoint), as the trainer runs it.
    Before the compiled layer checkpointed itself, transformers 5.24 checkpointed nothing here: its
    wrapper of the FSDP subclass's forward is the outermost one, and the compiled forward, the
    layer class's wrapper, took itself for an inner one."""
    run_distributed(_checkpointed_compiled_layers_under_fsdp_body, 1)


def test_compile_stats_count_this_process_compiles(monkeypatch):
    """The step metrics / first-step log line of torch.compile (spmd_rl/fused_kernels.compile_stats):
    a new compiled function adds a graph and seconds; Inductor's cache counters are read as they are."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    before = fused_kernels.compile_stats()
    f = fused_kernels.compiled(lambda x: torch.sin(x) * 2 + 1)
    y = f(torch.randn(4, requires_grad=True))
    counters["inductor"]["fxgraph_cache_hit"] += 3  # what a warm restart's Inductor records
    after = fused_kernels.compile_stats()
    grew = {k: after[k] - before[k] for k in after}
    assert grew["perf/compiled_graphs"] == 1
    assert grew["perf/compile_s"] > 0 and grew["perf/compile_cache_hits"] == 3
    # the split: tracing and the backend are parts of compile_s; the backward is not compiled yet
    assert 0 < grew["perf/compile_trace_s"] < grew["perf/compile_s"], grew
    assert 0 < grew["perf/compile_backend_s"] < grew["perf/compile_s"], grew
    assert grew["perf/compile_trace_s"] + grew["perf/compile_backend_s"] <= grew["perf/compile_s"], grew
    assert 0 < grew["perf/compile_guards_s"] < grew["perf/compile_s"] - grew["perf/compile_trace_s"], grew
    assert grew["perf/compile_cache_load_s"] == 0, grew  # aot_eager: no AOTAutograd cache to load from
    assert grew["perf/compile_lazy_backward_s"] == 0, grew
    y.sum().backward()  # aot_eager compiles the backward graph at its first backward, once
    lazy = fused_kernels.compile_stats()["perf/compile_lazy_backward_s"] - before["perf/compile_lazy_backward_s"]
    f(torch.randn(4, requires_grad=True)).sum().backward()
    assert 0 < lazy == fused_kernels.compile_stats()["perf/compile_lazy_backward_s"] - before["perf/compile_lazy_backward_s"]
    line = fused_kernels.compile_line(after)
    assert line.startswith(f"torch.compile so far: {after['perf/compiled_graphs']:.0f} graphs in ") and " hits, " in line
    assert f"tracing {after['perf/compile_trace_s']:.1f}s" in line and f"Inductor {after['perf/compile_backend_s']:.1f}s" in line
    assert f"guards {after['perf/compile_guards_s']:.1f}s" in line and "loading cached graphs" in line


def _one_compiled_step(rank, base, overrides):
    """The metrics of one trainer step on a small packed batch, compiled with aot_eager (dynamo and
    AOTAutograd without Inductor), with `overrides` on top."""
    from tests.train.test_old_logprobs import _trainer

    fused_kernels.COMPILE_OPTIONS = {"backend": "aot_eager"}  # this worker process only
    trainer = _trainer(f"{base}/run", f"{base}/data", [
        "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size_per_gpu=4",
        "model.remove_padding=true", *overrides], rank)
    m = trainer.train_step()
    trainer.close()
    return m


def _compiled_steps_body(rank, world, base):
    """In this process: a step of a trainer without a reference model, then one of a new trainer with
    one (the KL loss), both compiling decoder layers and log-prob head. Writes the first step's metrics
    and the graphs each step compiled."""
    graphs, metrics = {}, None
    for use_reference in (False, True):
        before = fused_kernels.compiled_graphs()
        m = _one_compiled_step(rank, f"{base}/{use_reference}", [
            'model.fused_kernels="compile"', 'model.fused_logprob_head="compile"', "actor.force_old_logprob_pass=true",
            f"actor.use_kl_loss={str(use_reference).lower()}"])
        assert ("time/ref_logprob" in m) == use_reference, sorted(m)
        graphs[str(use_reference)] = fused_kernels.compiled_graphs() - before
        metrics = metrics or m
    with open(f"{base}/results.json", "w") as f:
        json.dump({"graphs": graphs, "metrics": metrics}, f)


@pytest.fixture(scope="module")
def compiled_steps(tmp_path_factory):
    """_compiled_steps_body's results, one process for the tests that read them (it starts with no graphs)."""
    base = tmp_path_factory.mktemp("compiled_steps")
    run_distributed(_compiled_steps_body, 1, str(base))
    return json.loads((base / "results.json").read_text())


def test_a_step_with_compile_reports_its_compile_metrics(compiled_steps):
    """A trainer step with torch.compile (model.fused_kernels and model.fused_logprob_head = "compile")
    carries the compile metrics."""
    m = compiled_steps["metrics"]
    assert m["perf/compiled_graphs"] >= 1 and m["perf/compile_s"] > 0, m
    assert m["perf/compile_cache_hits"] == m["perf/compile_cache_misses"] == 0  # aot_eager: no Inductor


def test_the_reference_model_compiles_no_graph_of_its_own(compiled_steps):
    """The reference model's no-grad pass reuses the graphs the actor's no-grad log-prob pass
    compiled (spmd_rl/build.py: the reference keeps requires_grad, which torch.compile guards on):
    after a step without a reference model, a step of a new trainer with one compiles no graph, its
    actor's passes and its reference's all reusing the first step's (with the reference's
    requires_grad off, its layers compiled graphs of their own)."""
    graphs = compiled_steps["graphs"]
    assert graphs["False"] > 0 and graphs["True"] == 0, graphs


def test_head_passes_with_and_without_entropy_share_one_statistics_graph(monkeypatch):
    """The compiled head's statistics are one graph whether a pass keeps the entropy (the update)
    or not (the reference's and the old log-prob pass): a warm restart traces one graph fewer.
    Both passes still give the eager numbers."""
    from spmd_rl.model.logprob_head import token_logprobs

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(23, 16, generator=g), torch.randn(97, 16, generator=g)
    targets = torch.randint(0, 97, (23,), generator=g)
    before = fused_kernels.compiled_graphs()
    counts = []
    for with_entropy in (False, True):
        got = token_logprobs(hidden, weight, targets, 0.7, with_entropy=with_entropy, chunk=10, fused="compile")
        want = token_logprobs(hidden, weight, targets, 0.7, with_entropy=with_entropy, chunk=10)
        counts.append(fused_kernels.compiled_graphs() - before)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert (got[1] is None) == (not with_entropy)
        if with_entropy:
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert counts == [1, 1], counts


def lora_model():
    """tiny_model() with PEFT's LoRA layers on every linear layer of its decoder, B made non-zero so
    that the adapter changes the model (PEFT starts B at 0)."""
    from spmd_rl.model.lora import LoraSettings, add_adapter

    model = add_adapter(tiny_model(), LoraSettings(4, 8.0, (), torch.float32))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


def assert_lora_outputs_match(got_model, want_model):
    """Log-probs, entropy and the adapter's gradients (the only ones) of one packed batch, against
    `want_model`'s."""
    results = []
    for model in (want_model, got_model):
        logp, ent = forward_logprobs(model, ragged_batch([5, 9, 3]), 0.7, with_entropy=True, entropy_grad=True)
        w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
        ((logp * w).sum() + (ent * w.flip(-1)).sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert len(grads) == 2 * 7 * 2 and all(".lora_" in n and g is not None for n, g in grads.items())
        results.append((logp.detach(), ent.detach(), grads))
    (want_logp, want_ent, want_grads), (logp, ent, grads) = results
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    assert min(float(g.abs().max()) for g in want_grads.values()) > 0
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-5, msg=n)


def test_compiled_layers_with_lora_match_eager_and_see_the_adapter_switch(monkeypatch):
    """fused_kernels = "compile" with PEFT's LoRA layers inside the compiled decoder layers: the same
    log-probs, entropy and adapter gradients as eager, and with the adapter disabled (the reference
    policy, lora.adapter_disabled) the base's log-probs: the compiled graphs do not keep the adapter
    after PEFT's switch."""
    pytest.importorskip("peft")
    from spmd_rl.model.lora import adapter_disabled

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    plain = prepare_policy(tiny_model(), remove_padding=True)
    base = lora_model()
    eager = prepare_policy(copy.deepcopy(base), remove_padding=True)
    fused = prepare_policy(copy.deepcopy(base), True, True, fused_kernels="compile")
    assert_lora_outputs_match(fused, eager)
    batch = ragged_batch([6, 2, 9])
    with torch.no_grad():
        adapted = forward_logprobs(fused, batch, 1.0)[0]
        want_base = forward_logprobs(plain, batch, 1.0)[0]
        assert (adapted - want_base).abs().max() > 1e-2
        with adapter_disabled(fused):
            torch.testing.assert_close(forward_logprobs(fused, batch, 1.0)[0], want_base, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(forward_logprobs(fused, batch, 1.0)[0], adapted, rtol=0, atol=0)


def test_liger_patches_with_lora_run_the_adapter(monkeypatch):
    """fused_kernels = "liger" with PEFT's LoRA layers: the patched MLP calls its projections as
    modules, so PEFT's layers run inside it. liger's Triton kernels need CUDA (on CPU "liger" falls
    back, test above); here its three Functions are plain-torch stand-ins, to check the wiring: the
    patched modules ran, and log-probs, entropy and adapter gradients are eager's."""
    pytest.importorskip("peft")
    from transformers.models.qwen2 import modeling_qwen2 as mq

    ran = {"rms_norm": 0, "silu_mul": 0}

    class RMSNorm:
        @staticmethod
        def apply(x, weight, eps, offset, casting, in_place, row_mode):
            ran["rms_norm"] += 1
            h = x.float()
            return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    class SiLUMul:
        @staticmethod
        def apply(a, b, *scales):
            ran["silu_mul"] += 1
            return torch.nn.functional.silu(a) * b

    monkeypatch.setattr(fused_kernels, "_liger_ops", lambda: (RMSNorm, None, SiLUMul))
    monkeypatch.setattr(fused_kernels, "liger_problem", lambda *args: None)
    monkeypatch.setattr(fused_kernels, "_on_cuda", lambda x: True)
    monkeypatch.setattr(fused_kernels, "_ORIGINAL_ROPE", {})  # the RoPE dispatcher, undone after the test
    monkeypatch.setattr(mq, "apply_rotary_pos_emb", mq.apply_rotary_pos_emb)
    base = lora_model()
    eager = prepare_policy(copy.deepcopy(base), remove_padding=True)
    liger = prepare_policy(copy.deepcopy(base), True, True, fused_kernels="liger")
    assert fused_kernels.active_mode(liger) == "liger"
    assert_lora_outputs_match(liger, eager)
    assert ran["silu_mul"] >= 2 and ran["rms_norm"] >= 5, ran  # 2 layers' MLPs, their norms and the final one
