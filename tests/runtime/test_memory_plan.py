"""Each GPU's memory predicted at start-up (spmd_rl/runtime/memory_plan.py, spmd_rl/preflight/memory.py).

The parameter count against real transformers models built on the meta device; the training
state against a per-role sum written out here; the refusal for configs/qwen7b.toml on 2 ranks of
80 GB GPUs (it died in vLLM's wake_up after 95 s) and its absence on 4; the measured
update peaks of docs/performance.md within 10%; an out-of-memory error as one line naming its phase.
"""

import dataclasses
import json
import logging
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, Qwen2Config, Qwen3MoeConfig

from spmd_rl.config.run_config import load_config
from spmd_rl.errors import UserError, report
from spmd_rl.model.loading import ARCH_PRESETS, preset_config
from spmd_rl.preflight import memory as mc
from spmd_rl.preflight import speed_settings
from spmd_rl.runtime import memory_plan as mp
from tests.helpers import ROOT

GiB = 2**30
H100_TOTAL = 79.2 * GiB  # what torch.cuda.mem_get_info reports on an 80 GB H100
QWEN7B = os.path.join(ROOT, "configs", "qwen7b.toml")
QWEN25_7B_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 152064,
                    "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                    "num_attention_heads": 28, "num_key_value_heads": 4, "tie_word_embeddings": False,
                    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
                    "torch_dtype": "bfloat16"}
"""config.json of Qwen/Qwen2.5-7B-Instruct (its entries that matter here)."""


def meta_count(model_cls, config) -> int:
    with torch.device("meta"):
        model = model_cls.from_config(config)
    return sum(p.numel() for p in model.parameters())


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2)
CONFIGS = {
    "qwen2-tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2-untied": lambda: Qwen2Config(**TINY, tie_word_embeddings=False),
    "llama-untied": lambda: LlamaConfig(**TINY, tie_word_embeddings=False),
    "llama-untied-biases-head_dim": lambda: LlamaConfig(**TINY, tie_word_embeddings=False, attention_bias=True,
                                                        mlp_bias=True, head_dim=32),
    # a mixture in layers 2 and 4 (decoder_sparse_step 2), dense layer 1 by mlp_only_layers... and 3 by the step
    "qwen3_moe-sparse-step-mlp-only": lambda: Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 4}, head_dim=16,
                                                             moe_intermediate_size=24, num_experts=8,
                                                             num_experts_per_tok=2, decoder_sparse_step=2,
                                                             mlp_only_layers=[3]),
    **{f"preset-{name}": (lambda n=name: preset_config(n)) for name in ARCH_PRESETS},  # each of its family's class
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_the_model_transformers_builds(name):
    """The formula's count (from config.json's entries) is the real model's, causal LM and critic."""
    config = CONFIGS[name]()
    shape = mp.shape_from_config(config.to_dict())
    assert shape.parameters() == meta_count(AutoModelForCausalLM, config)
    if type(config) in AutoModelForTokenClassification._model_mapping:  # families with a critic class
        config.num_labels = 1
        assert shape.value_model_parameters() == meta_count(AutoModelForTokenClassification, config)


def test_head_chunk_is_the_log_prob_heads():
    """memory_plan keeps its own copy (it imports no torch): the two must agree."""
    from spmd_rl.model.logprob_head import CHUNK_ELEMENTS

    assert mp.HEAD_CHUNK_ELEMENTS == CHUNK_ELEMENTS


def test_qwen25_7b_has_its_published_parameter_count():
    assert mp.shape_from_config(QWEN25_7B_CONFIG).parameters() == 7_615_616_512


def qwen7b_config(tmp_path, *overrides):
    """configs/qwen7b.toml on a directory holding Qwen2.5-7B-Instruct's config.json (no weights)."""
    model_dir = tmp_path / "Qwen2.5-7B-Instruct"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN25_7B_CONFIG))
    return load_config(QWEN7B, [f'model.path="{model_dir}"', *overrides])


def test_training_state_is_the_sum_over_roles(tmp_path):
    """qwen7b on 2 ranks: actor fp32 masters 4 + 4 + 8 bytes a parameter, reference bf16 2 bytes,
    each halved; the update holds all of it, generation all but the gradients."""
    n = 7_615_616_512
    actor_params, actor_grads, actor_moments = n * 4 / 2, n * 4 / 2, n * 8 / 2
    ref_params = n * 2 / 2
    plan = mc.plan_for(qwen7b_config(tmp_path), 2, H100_TOTAL)
    update, generation = plan.phase("actor update").parts, plan.phase("generation").parts
    assert update["params"] == actor_params + ref_params
    assert update["grads"] == actor_grads
    assert update["optimizer"] == actor_moments
    assert "grads" not in generation and generation["params"] + generation["optimizer"] == (
        actor_params + actor_moments + ref_params)
    assert generation["vLLM"] == 0.5 * H100_TOTAL
    roles = [mp.Role("actor", n, 4, True), mp.Role("reference", n, 2, False)]
    assert mp.training_state_bytes(roles, 2) == {"params": actor_params + ref_params, "grads": actor_grads,
                                                 "optimizer": actor_moments}
    off = mc.plan_for(qwen7b_config(tmp_path, "rollout.offload_train_states=true"), 2, H100_TOTAL)
    assert "params" not in off.phase("generation").parts  # offloaded while the engine generates


def test_a_reward_model_counts_as_a_frozen_model_in_the_compute_dtype(tmp_path):
    """qwen7b on 2 ranks with a Qwen2.5-7B-shaped reward model: its parameters (the backbone and a
    one-label head of hidden_size weights, no bias in transformers' score layer: 1 more than counted
    here for the value head's bias) in bf16, halved, in every phase; no gradients or optimizer."""
    rm_dir = tmp_path / "rm"
    rm_dir.mkdir()
    (rm_dir / "config.json").write_text(json.dumps({**QWEN25_7B_CONFIG, "architectures": ["Qwen2ForSequenceClassification"],
                                                    "num_labels": 1}))
    without = mc.plan_for(qwen7b_config(tmp_path), 2, H100_TOTAL)
    with_rm = mc.plan_for(qwen7b_config(tmp_path, f'reward_model.path="{rm_dir}"'), 2, H100_TOTAL)
    backbone = 7_615_616_512 - QWEN25_7B_CONFIG["vocab_size"] * QWEN25_7B_CONFIG["hidden_size"]  # untied: no LM head
    rm_bytes = (backbone + QWEN25_7B_CONFIG["hidden_size"] + 1) * 2 / 2
    for phase in ("actor update", "generation"):
        parts, base = with_rm.phase(phase).parts, without.phase(phase).parts
        assert parts["params"] - base["params"] == rm_bytes, phase
        assert parts.get("grads") == base.get("grads") and parts["optimizer"] == base["optimizer"], phase


def test_bfloat16_masters_and_offloaded_optimizer(tmp_path):
    n = 7_615_616_512
    plan = mc.plan_for(qwen7b_config(tmp_path, 'model.dtype="bfloat16"', "actor.offload_optimizer=true"), 4,
                       H100_TOTAL)
    update = plan.phase("actor update").parts
    assert update["params"] == n * 2 / 4 + n * 2 / 4  # actor bf16 masters + bf16 reference
    assert update["grads"] == n * 2 / 4 and update["optimizer"] == 0  # the moments stay on the CPU
    assert update["activations"] >= n * 4 / 4  # ...but visit the GPU for the optimizer step


def test_qwen7b_on_2_ranks_of_80gb_is_refused_with_the_fixes(tmp_path):
    """The preset on 2 GPUs died in vLLM's wake_up; now it stops before any model loads."""
    cfg = qwen7b_config(tmp_path)
    with pytest.raises(mc.MemoryPlanError) as e:
        mc.check_memory(cfg, 2, H100_TOTAL)
    message = str(e.value)
    assert isinstance(e.value, UserError) and "\n" not in message
    assert "in generation exceeds the GPU's 79.2 GiB on 2 GPU(s)" in message
    assert "vLLM 39.6 + params 21.3 + optimizer 28.4" in message  # the numbers behind it
    for fix in ("rollout.offload_train_states = true", "shard over more GPUs (4 GPUs", "rollout.gpu_memory_utilization",
                "LoRA, model.lora_rank = 32", 'trainer.memory_check = "warn"'):
        assert fix in message, fix


def test_qwen7b_on_4_ranks_fits(tmp_path):
    plan = mc.check_memory(qwen7b_config(tmp_path), 4, H100_TOTAL)
    assert plan.fits and plan.peak.name == "generation"
    assert plan.line().startswith("memory: predicted peak per GPU 68.6 GiB in generation (actor update: ")
    assert plan.line().endswith(" of 79.2 GiB")


def test_warn_and_off(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        plan = mc.check_memory(qwen7b_config(tmp_path, 'trainer.memory_check="warn"'), 2, H100_TOTAL)
    assert not plan.fits and "exceeds the GPU's 79.2 GiB" in caplog.text
    assert mc.check_memory(qwen7b_config(tmp_path, 'trainer.memory_check="off"'), 2, H100_TOTAL) is None


def test_active_parameters_of_a_mixture_count_the_routed_experts_only():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B active (its model card), by hand: the dense count less the
    experts a token skips (128 - 8 of 128 in each of 48 layers, 3 x 2048 x 768 each)."""
    shape = mp.shape_from_config(preset_config("qwen3-30b-a3b").to_dict())
    assert shape.parameters() == 30_532_122_624
    assert shape.active_parameters() == 30_532_122_624 - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    dense = mp.shape_from_config(preset_config("qwen2-0.5b").to_dict())
    assert dense.active_parameters() == dense.parameters()


def test_a_mixture_layer_holds_its_experts_activations_instead_of_a_dense_mlp():
    """Per mixture layer and token: the router's float32 logits and probabilities (8 bytes an expert) and, per
    routed copy (top-k), the permuted input and output, the routing weight and the expert's SwiGLU values; in
    place of a dense layer's MLP (SWIGLU_VALUES_PER_INTERMEDIATE bf16 values per unit of its intermediate size)."""
    shape = mp.shape_from_config(preset_config("qwen3-moe-tiny").to_dict())
    work = mp.Work(update_tokens=1000, forward_tokens=1000)
    experts = 1000 * 8 * 8 + 1000 * 2 * (2 * 64 + 1 + 3 * 32) * 2
    assert mp.expert_activation_bytes(shape, 1000, work) == experts
    dense_mlp = 1000 * 3 * shape.intermediate_size * 2
    mixture_layer = mp.layer_activation_bytes(shape, 1000, work) - dense_mlp + experts
    assert mp.mixture_layer_activation_bytes(shape, 1000, work) == pytest.approx(mixture_layer)
    dense = dataclasses_replace(shape)
    gathered = shape.layer_parameters() - dense.layer_parameters()  # FSDP gathers two layers, + float32 grads
    assert mp.update_activation_bytes(shape, work) - mp.update_activation_bytes(dense, work) == pytest.approx(
        2 * (experts - dense_mlp) + 2 * gathered * (2 + 4))  # both layers are mixtures
    assert mp.forward_activation_bytes(shape, work) - mp.forward_activation_bytes(dense, work) == pytest.approx(
        experts - dense_mlp + 2 * gathered * 2)


def test_a_shared_expert_adds_its_swiglu_values():
    """GLM-4.7-Flash's family: a mixture layer's always-on expert keeps a dense SwiGLU's values per token."""
    shape = mp.shape_from_config(preset_config("glm4-moe-lite-tiny").to_dict())
    work = mp.Work(update_tokens=1000, forward_tokens=1000)
    assert shape.shared_expert_intermediate_size == 32
    without = dataclasses.replace(shape, shared_expert_intermediate_size=0)
    assert (mp.mixture_layer_activation_bytes(shape, 1000, work) - mp.mixture_layer_activation_bytes(without, 1000, work)
            == 1000 * 3 * 32 * 2)


def dataclasses_replace(shape):
    """`shape` without its mixture: the same layers, dense."""
    return dataclasses.replace(shape, num_experts=0, experts_per_token=0, moe_intermediate_size=0, moe_layers=0)


def test_a_mixture_of_experts_model_is_predicted_and_an_unknown_family_is_not(tmp_path, caplog):
    """qwen3_moe is counted (its line is logged); a mixture family the formula does not know gets one warning."""
    cfg = qwen7b_config(tmp_path)
    moe = preset_config("qwen3-30b-a3b").to_dict()
    (tmp_path / "Qwen2.5-7B-Instruct" / "config.json").write_text(json.dumps(moe))
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        mc.check_memory(cfg, 8, 2 * H100_TOTAL)
    assert "not predicted" not in caplog.text
    caplog.clear()
    config = dict(QWEN25_7B_CONFIG, model_type="qwen2_moe", num_experts=64)
    (tmp_path / "Qwen2.5-7B-Instruct" / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        assert mc.check_memory(cfg, 2, H100_TOTAL) is None
    assert ("memory: not predicted" in caplog.text and "qwen2_moe with 64 experts: a mixture-of-experts family "
            "the memory formula does not count (it counts qwen3_moe, glm4_moe_lite)" in caplog.text)


def test_the_start_up_line_is_logged_before_the_models_on_a_gpu(monkeypatch, caplog):
    """build.check_memory logs the plan's line against the GPU's memory."""
    import spmd_rl.build as build

    monkeypatch.setattr(build, "raise_together", lambda fn: fn())
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (H100_TOTAL, H100_TOTAL))
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml"))
    env = type("Env", (), {"device": torch.device("cuda", 0), "world_size": 2, "local_rank": 1})()
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        plan = build.check_memory(cfg, env)
    assert plan is not None and f"memory: predicted peak per GPU {plan.peak.total / mp.GiB:.1f} GiB" in caplog.text
    assert f"of {H100_TOTAL / mp.GiB:.1f} GiB" in caplog.text


def test_a_cpu_run_logs_no_gpu_memory_line(monkeypatch, caplog):
    """Without a GPU there is nothing to predict or compare: the plan is made, no line is logged."""
    import spmd_rl.build as build

    monkeypatch.setattr(build, "raise_together", lambda fn: fn())
    cfg = load_config(os.path.join(ROOT, "configs", "tiny-cpu.toml"))
    env = type("Env", (), {"device": torch.device("cpu"), "world_size": 2})()
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        plan = build.check_memory(cfg, env)
    assert plan is not None and "memory:" not in caplog.text


MEASURED_UPDATE_PEAKS = [  # docs/performance.md: memory/update_actor_peak_gb (PyTorch's tensors), 1xH100,
    # bench_step.sh's work (micro-batches filled to ~95% of the budget), the preset's other settings
    ("qwen2-0.5b", 16384, 0.0, 23.7),  # docs/performance.md "Memory predicted at start-up", 2026-11-25
    ("qwen2-0.5b", 32768, 0.0, 37.1),  # docs/performance.md "Memory predicted at start-up", 2026-11-25
    ("qwen2-1.5b", 16384, 0.0, 55.9),  # docs/performance.md "Memory predicted at start-up", 2026-11-25
    ("qwen2-1.5b", 16384, 1.0, 28.9),  # docs/performance.md "Memory predicted at start-up", 2026-11-25 (head chunks 4x smaller then)
    ("qwen2-1.5b", 16384, 0.5, 41.2),  # docs/performance.md "Memory predicted at start-up", 2026-11-25
    ("qwen3-30b-a3b-4layers", 32768, 0.0, 68.5),  # docs/performance.md "Mixture of experts", 1xH200, 2026-11-28
]


def test_the_dense_mlp_part_of_the_fitted_constant_is_the_fitted_shapes():
    """FIT_INTERMEDIATE_PER_HIDDEN is the intermediate/hidden ratio of the dense shapes the constant is fitted to
    (the "fit" rows of MEASURED_UPDATE_PEAKS), and their MLP part leaves the layer a positive rest."""
    fitted = {arch for arch, _, checkpointed, _ in MEASURED_UPDATE_PEAKS if arch.startswith("qwen2-") and not checkpointed}
    ratios = [ARCH_PRESETS[arch]["intermediate_size"] / ARCH_PRESETS[arch]["hidden_size"] for arch in sorted(fitted)]
    assert sorted(fitted) == ["qwen2-0.5b", "qwen2-1.5b"]
    assert mp.FIT_INTERMEDIATE_PER_HIDDEN == pytest.approx(sum(ratios) / len(ratios), abs=0.05)
    assert mp.ACTIVATION_BYTES_PER_HIDDEN - mp.SWIGLU_VALUES_PER_INTERMEDIATE * 2 * mp.FIT_INTERMEDIATE_PER_HIDDEN > 0


@pytest.mark.parametrize("arch,tokens,checkpointed,measured", MEASURED_UPDATE_PEAKS)
def test_measured_update_peaks_within_10_percent(arch, tokens, checkpointed, measured):
    """What the formula predicts for PyTorch's tensors (its total less the CUDA context) against
    the update peaks measured on the GPU, for the settings of each measurement."""
    shape = mp.shape_from_config({"model_type": "qwen2", **ARCH_PRESETS[arch]})
    work = mp.Work(tokens, 32768, 2, checkpointed, True, "compile")
    engine = mp.Engine("vllm", 0.5, True, shape.parameters() * 2)
    plan = mp.plan_memory([mp.Role("actor", shape.parameters(), 4, True)], 1, {"actor": (shape, work)}, engine,
                          H100_TOTAL)
    update = plan.phase("actor update")
    predicted = (update.total - update.parts["overhead"]) / GiB
    assert predicted == pytest.approx(measured, rel=0.10)


def test_a_frozen_base_holds_no_float32_gradients_and_on_one_rank_no_gathered_copies():
    """Per parameter of the head and of FSDP2's two gathered layers in backward: a trained model holds its bf16
    copy and its float32 gradient (2 + 4 bytes), a frozen base (LoRA) on several ranks the copy alone (2), and on
    one rank, kept out of FSDP2 (loading.frozen_kept_whole), nothing; work_of sets the fields so."""
    shape = mp.shape_from_config({"model_type": "qwen2", **ARCH_PRESETS["qwen2-7b"]})
    head, layers = shape.vocab_size * shape.hidden_size, 2 * shape.layer_parameters()
    for (trained, gathered), per_parameter in {(True, True): 6, (False, True): 2, (False, False): 0}.items():
        work = mp.Work(16384, 32768, base_trained=trained, base_gathered=gathered)
        assert mp.fsdp_buffer_bytes(shape, work, backward=True) == layers * per_parameter
        chunks = mp.head_bytes(shape, 16384, work, backward=True) - head * per_parameter
        assert chunks == mp.head_bytes(shape, 16384, mp.Work(16384, 32768, base_gathered=False), backward=False)
    random_7b = ['model.init="random"', 'model.arch="qwen2-7b"', 'model.path=""', "model.gradient_checkpointing=false",
                 "actor.max_token_len_per_gpu=16384", "actor.logprob_max_token_len_per_gpu=32768"]
    lora, full = (load_config(os.path.join(ROOT, "configs", f"{name}.toml"), random_7b) for name in ("qwen7b-lora", "qwen7b"))
    works = [mc.work_of(lora, "actor", 1), mc.work_of(lora, "actor", 2), mc.work_of(full, "actor", 1)]
    assert [(w.base_trained, w.base_gathered) for w in works] == [(False, False), (False, True), (True, True)]


MEASURED_LORA_UPDATE_PEAKS = [  # memory/update_actor_peak_gb at a step after the first, the preset as shipped (no
    # checkpointing) but for the micro-batch's budget, set to its largest measured micro-batch's tokens: prompts of
    # 75.5 tokens, 8 responses each (docs/performance.md "Memory predicted at start-up")
    # preset, arch, GPUs, response tokens, micro-batch tokens, measured GiB
    # gpu_check's preset-30b-a3b-lora, 4xH200, 2026-11-28: 512 responses over 4 GPUs and 2 mini-batches, one micro-batch
    # a GPU; the experts are frozen (their inputs not kept) and Qwen3-MoE's attention is twice its hidden size wide,
    # with query-key norms (attention_extra_values)
    ("qwen3-30b-a3b-lora", "qwen3-30b-a3b", 4, 128, 13024, 77.16),
    # 1xH200, 2026-12-02, shared prompts, as many whole prompts a micro-batch as the 16,384-token budget holds:
    # bench_step's work, 5 prompts x (75.5 + 8 x 384) (the three LoRA presets), and gpu_check's preset rows, 11
    # prompts x (75.5 + 8 x 128): two shapes whose MLPs are narrower than the fitted Qwen2 shapes' (Qwen3-8B 3.0 x
    # hidden, Llama 3.1 8B 3.5 x; counted apart: layer_activation_bytes), at two micro-batch sizes
    ("qwen7b-lora", "qwen2-7b", 1, 384, 15740, 84.1),
    ("qwen3-8b-lora", "qwen3-8b", 1, 384, 15740, 91.9),
    ("llama3.1-8b-lora", "llama3.1-8b", 1, 384, 15740, 84.6),
    ("qwen3-8b-lora", "qwen3-8b", 1, 128, 12094, 75.2),
    ("llama3.1-8b-lora", "llama3.1-8b", 1, 128, 12094, 69.5),
]


@pytest.mark.parametrize("preset,arch,gpus,response,tokens,measured", MEASURED_LORA_UPDATE_PEAKS)
def test_the_lora_presets_measured_update_peaks_within_10_percent(preset, arch, gpus, response, tokens, measured):
    """The LoRA presets' plan for their largest measured micro-batch against the update peak of PyTorch's
    tensors less vLLM's pool (gpu_memory.PhaseMemory): the plan's update less the CUDA context and the
    engine's pool (awake, or its weights kept on the GPU asleep)."""
    cfg = load_config(os.path.join(ROOT, "configs", f"{preset}.toml"),
                      ['model.init="random"', f'model.arch="{arch}"', 'model.path=""', 'model.tokenizer="char"',
                       "data.max_prompt_length=128", f"data.max_response_length={response}",
                       f"actor.max_token_len_per_gpu={tokens}", "actor.logprob_max_token_len_per_gpu=32768",
                       "model.gradient_checkpointing=false", "rollout.max_num_seqs=512"])
    update = mc.plan_for(cfg, gpus, 139.8 * GiB).phase("actor update")
    pool = sum(update.parts.get(k, 0.0) for k in ("overhead", "vLLM awake", "vLLM weights"))
    assert (update.total - pool) / GiB == pytest.approx(measured, rel=0.10)


def test_out_of_memory_in_a_phase_is_one_line_naming_it(tmp_path, capsys):
    from spmd_rl.trainer import PhaseTimer

    plan = mc.plan_for(qwen7b_config(tmp_path), 2, H100_TOTAL)
    timer = PhaseTimer(torch.device("cpu"), plan)
    with pytest.raises(mc.OutOfMemory) as e:  # vLLM's sleep-mode allocator (cumem_allocator.cpp)
        with timer("wake"):
            raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:163")
    message = str(e.value)
    assert message.startswith("out of GPU memory in the step's wake phase (CUDA Error: out of memory at ")
    assert "predicted generation: vLLM 39.6 + " in message and "= 93.4 GiB of the GPU's 79.2 GiB" in message
    assert "rollout.offload_train_states = true" in message
    with pytest.raises(mc.OutOfMemory) as e:
        with timer("update_actor"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore lines")
    assert "update_actor phase (CUDA out of memory. Tried to allocate 2.00 GiB.)" in str(e.value)
    assert "predicted actor update: params 21.3" in str(e.value) and "actor.max_token_len_per_gpu" in str(e.value)
    report(e.value, rank=0)
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    with pytest.raises(RuntimeError, match="shapes differ"):  # other errors pass unchanged
        with timer("update_actor"):
            raise RuntimeError("shapes differ")


def test_with_offload_an_out_of_memory_in_the_weight_sync_names_the_weight_syncs_prediction(tmp_path):
    """With rollout.offload_train_states, the weight sync, the offload and the reload hold the training state
    beside the engine's weights: their out-of-memory line gives the weight sync's prediction, not generation's
    (the engine alone); without offload the plan has no weight sync phase and generation covers them."""
    from spmd_rl.trainer import PhaseTimer

    cfg = qwen7b_config(tmp_path)
    cfg.rollout.offload_train_states = True
    plan = mc.plan_for(cfg, 2, H100_TOTAL)
    for phase in ("weight_sync", "offload", "reload"):
        with pytest.raises(mc.OutOfMemory) as e:
            with PhaseTimer(torch.device("cpu"), plan)(phase):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")
        assert f"{phase} phase (CUDA" in str(e.value) and "predicted weight sync: params 21.3 + " in str(e.value)
        assert str(e.value).endswith(": set actor.offload_optimizer = true, use LoRA (model.lora_rank), or shard "
                                     "over more GPUs")  # not the offload it already has
    with pytest.raises(mc.OutOfMemory) as e:
        with PhaseTimer(torch.device("cpu"), plan)("generate"):
            raise torch.OutOfMemoryError("CUDA out of memory.")
    assert "predicted generation: vLLM 39.6 + vLLM asleep" in str(e.value)
    assert str(e.value).endswith(": lower rollout.gpu_memory_utilization, or shard over more GPUs")
    assert mc.plan_phase("generate", [p.name for p in plan.phases]) == "generation"
    assert mc.plan_phase("weight_sync", [p.name for p in mc.plan_for(qwen7b_config(tmp_path), 2, H100_TOTAL).phases]) \
        == "generation"


def test_lora_adapter_count_equals_pefts_and_the_base_is_frozen_in_the_compute_dtype(tmp_path):
    """The adapter's parameter count against PEFT's own on a tiny Qwen2 built on the meta device (every
    linear layer, and two of them); with LoRA the plan holds the base once, in bf16, with no gradients or
    optimizer state, and the adapter alone is trained: qwen7b fits one 80 GB GPU (issue's target) where
    the full actor needs four."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen2Config

    small = dict(vocab_size=96, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True)
    for targets in ((), ("q_proj", "down_proj")):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**small))
        peft = get_peft_model(model, LoraConfig(r=4, target_modules=list(targets) or "all-linear"))
        want = sum(p.numel() for n, p in peft.named_parameters() if "lora_" in n)
        assert mp.shape_from_config({"model_type": "qwen2", **small}).lora_parameters(4, targets) == want, targets

    n = 7_615_616_512
    shape = mp.shape_from_config(QWEN25_7B_CONFIG)
    adapter = shape.lora_parameters(32, ())
    plan = mc.plan_for(qwen7b_config(tmp_path, "model.lora_rank=32"), 1, H100_TOTAL)
    update = plan.phase("actor update").parts
    assert update["params"] == n * 2 + adapter * 4  # the bf16 base once (the reference is the actor) + the fp32 adapter
    assert update["grads"] == adapter * 4 and update["optimizer"] == adapter * 8
    assert plan.fits and not mc.plan_for(qwen7b_config(tmp_path), 1, H100_TOTAL).fits
    with pytest.raises(mc.MemoryPlanError, match=r"LoRA, model.lora_rank = 32 \(only the adapter trained; peak [\d.]+ GiB, fits\)"):
        mc.check_memory(qwen7b_config(tmp_path), 2, H100_TOTAL)


def test_the_optimizer_step_holds_adamws_temporary_and_the_offloaded_moments(tmp_path):
    """qwen7b on 2 ranks with actor.offload_optimizer: its update ran out of memory on two H100s
    (2026-11-26, docs/performance-history.md) where the plan without the
    optimizer step's own bytes predicted 68.0 GiB. The step brings the moments back (8 bytes a
    parameter) and AdamW's foreach step holds sqrt(v) of every parameter (4 more): refused."""
    n = 7_615_616_512
    plan = mc.plan_for(qwen7b_config(tmp_path, "actor.offload_optimizer=true"), 2, H100_TOTAL)
    update = plan.phase("actor update").parts
    assert update["optimizer step"] == n * 8 / 2 + n * 4 / 2 and "activations" not in update
    assert not plan.fits and plan.peak.name == "actor update"


def test_host_memory_line_for_the_engine_kept_at_sleep_level_1(tmp_path):
    """LoRA's adapter sync keeps vLLM's bf16 weights in pinned host memory while training (sleep level 1):
    the start-up says how much per node, and warns where it nears what the node has; level 2 keeps none."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight.memory import host_memory_line

    base = ['model.init="random"', 'model.path=""', 'model.arch="qwen2-7b"', 'model.tokenizer="char"',
            "trainer.save_every=-1"]
    cfg = load_config(os.path.join(ROOT, "configs", "qwen7b-lora.toml"), base)
    weights = 7_615_616_512 * 2  # Qwen2.5-7B's parameters (untied head) in bf16, TP = 1
    line, fits = host_memory_line(cfg, 8, 8, 512 * 2**30)
    assert line.startswith(f"host memory: {weights / 2**30:.1f} GiB per rank held for the run (vLLM weights asleep "
                           "(sleep level 1)") and fits, line
    assert f"{8 * weights / 2**30:.1f} GiB for this node's 8 rank(s)" in line, line
    line, fits = host_memory_line(cfg, 8, 8, 100 * 2**30)
    assert not fits and 'model.lora_sync = "merged"' in line, line
    assert host_memory_line(load_config(os.path.join(ROOT, "configs", "qwen7b-lora.toml"),
                                        [*base, "model.lora_sync=merged"]), 8, 8, 100 * 2**30) is None
    assert host_memory_line(load_config(os.path.join(ROOT, "configs", "qwen7b.toml"), base), 8, 8, None) is None


def test_host_memory_line_counts_offloaded_state_and_checkpoint_staging(tmp_path):
    """rollout.offload_train_states keeps each rank's training state in pinned host buffers for the
    run, and an asynchronous save keeps a staging copy of the trained models' parameters and moments:
    PPO at 7B on 4 ranks of one node, counted by hand from the shape's parameter counts (the offloaded
    part, 44.6 GiB, is what PPO at 7B on four H100s measured as memory/offloaded_gb: 44.58)."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight.memory import host_memory_line

    base = ['model.init="random"', 'model.path=""', 'model.arch="qwen2-7b"', 'model.tokenizer="char"',
            'algorithm.adv_estimator="gae"', "rollout.offload_train_states=true"]
    cfg = load_config(os.path.join(ROOT, "configs", "qwen7b.toml"), base)
    actor = 7_615_616_512  # fp32 masters, 2 AdamW moments; the bf16 reference; the critic: no head, a value head
    critic = actor - 152_064 * 3_584 + 3_584 + 1
    ref = 2 * actor if cfg.use_reference else 0
    offloaded = (12 * actor + 12 * critic + ref) / 4
    staging = (12 * actor + 12 * critic) / 4
    line, fits = host_memory_line(cfg, 4, 4, 1024 * 2**30)
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    assert fits and line == (f"host memory: {gib(offloaded + staging)} per rank held for the run (offloaded training "
                             f"state {gib(offloaded)}, checkpoint staging (trainer.async_save) {gib(staging)}), "
                             f"{gib(4 * (offloaded + staging))} for this node's 4 rank(s) of the 1024.0 GiB available"), line
    line, fits = host_memory_line(cfg, 4, 4, 400 * 2**30)  # 342.4 GiB of 400: more than four fifths
    assert not fits and line.endswith("too close to what the node has: rollout.offload_train_states = false; "
                                      "trainer.async_save = false"), line
    quiet = load_config(os.path.join(ROOT, "configs", "qwen7b.toml"), [*base[:-1], "trainer.async_save=false"])
    assert host_memory_line(quiet, 4, 4, None) is None


def test_the_host_memory_line_is_logged_once_per_node_with_the_adapter_sync(monkeypatch, caplog):
    """build.check_memory adds the host-memory line on a node's first rank (here: vLLM asleep at level 1)."""
    import spmd_rl.build as build

    monkeypatch.setattr(build, "raise_together", lambda fn: fn())
    cfg = load_config(os.path.join(ROOT, "configs", "qwen7b-lora.toml"),
                      ['model.init="random"', 'model.path=""', 'model.arch="qwen2-7b"', 'model.tokenizer="char"'])
    speed_settings.resolve(cfg, 8, None)  # the preset's "auto" settings, as the entry point chooses them on CPU
    for local_rank, logged in ((0, True), (1, False)):
        caplog.clear()
        env = type("Env", (), {"device": torch.device("cpu"), "world_size": 8, "local_rank": local_rank,
                               "local_world_size": 8})()
        with caplog.at_level(logging.INFO, logger="spmd_rl"):
            build.check_memory(cfg, env)
        assert ("held for the run (vLLM weights asleep (sleep level 1)" in caplog.text) == logged, caplog.text


def test_the_30b_a3b_lora_preset_is_predicted_to_fit_four_80_gb_gpus_and_not_one(tmp_path):
    """configs/qwen3-30b-a3b-lora.toml with its "auto" speed settings chosen: its plan fits four H100s; on
    one (the engine at TP=1) the 61 GB base alone leaves no room, and the plan says so."""
    model_dir = tmp_path / "Qwen3-30B-A3B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_config("qwen3-30b-a3b").to_dict()))
    preset = os.path.join(ROOT, "configs", "qwen3-30b-a3b-lora.toml")
    four = load_config(preset, [f'model.path="{model_dir}"'])
    speed_settings.resolve(four, 4, H100_TOTAL)
    assert mc.plan_for(four, 4, H100_TOTAL).fits
    one = load_config(preset, [f'model.path="{model_dir}"', "rollout.tensor_parallel_size=1"])
    speed_settings.resolve(one, 1, H100_TOTAL)
    plan = mc.plan_for(one, 1, H100_TOTAL)
    assert not plan.fits and plan.peak.total > H100_TOTAL


def test_the_30b_a3b_full_preset_fits_eight_141_gb_or_sixteen_80_gb_gpus_and_not_eight_80_gb(tmp_path):
    """configs/qwen3-30b-a3b.toml (every parameter trained, "auto" speed settings chosen): its plan fits
    8 x H200 and 16 x H100; 8 x H100 is refused, the refusal naming 16 GPUs and LoRA as fixes that fit."""
    model_dir = tmp_path / "Qwen3-30B-A3B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(preset_config("qwen3-30b-a3b").to_dict()))
    preset = os.path.join(ROOT, "configs", "qwen3-30b-a3b.toml")
    h200 = 139.8 * 2**30
    for world, total in ((8, h200), (16, H100_TOTAL)):
        cfg = load_config(preset, [f'model.path="{model_dir}"'])
        speed_settings.resolve(cfg, world, total)
        assert mc.plan_for(cfg, world, total).fits, (world, total)
    cfg = load_config(preset, [f'model.path="{model_dir}"'])
    with pytest.raises(mc.MemoryPlanError) as e:
        speed_settings.resolve(cfg, 8, H100_TOTAL)
        mc.check_memory(cfg, 8, H100_TOTAL)
    assert "shard over more GPUs (16 GPUs: peak" in str(e.value) and "model.lora_rank = 32" in str(e.value), str(e.value)


def test_lora_parameters_of_latent_attention_are_peft_s():
    """GLM-4.7-Flash's family: the adapter of model.lora_target_modules = [] (a mixture's attention: the latent
    attention's five projections) counts as many parameters as PEFT puts in."""
    from spmd_rl.model.lora import LoraSettings, add_adapter

    config = preset_config("glm4-moe-lite-tiny")
    with torch.device("meta"):
        model = add_adapter(AutoModelForCausalLM.from_config(config), LoraSettings(8, 16.0, (), torch.float32))
    peft = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert mp.shape_from_config(config.to_dict()).lora_parameters(8, ()) == peft > 0


def test_the_engines_weights_kept_on_the_gpu_are_in_every_training_phase_and_out_of_host_memory():
    """rollout.weights_stay_on_gpu: the engine's bf16 weights (its TP share) stay beside training, in the
    update and the log-prob pass, not in generation (vLLM's share holds them) and not in the host-memory
    line; the refusal where they do not fit names the switch with the peak it gives."""
    from spmd_rl.config.run_config import load_config
    from spmd_rl.preflight.memory import check_memory, host_memory_line, plan_for

    base = ['model.init="random"', 'model.path=""', 'model.arch="qwen2-7b"', 'model.tokenizer="char"',
            "trainer.save_every=-1", "model.gradient_checkpointing=false", "actor.max_token_len_per_gpu=8192",
            "actor.logprob_max_token_len_per_gpu=8192"]
    weights = 7_615_616_512 * 2  # Qwen2.5-7B's parameters (untied head) in bf16, TP = 1

    def cfg(stay, *more):
        return load_config(os.path.join(ROOT, "configs", "qwen7b-lora.toml"),
                           [*base, f"rollout.weights_stay_on_gpu={stay}", *more])

    kept, sent = plan_for(cfg("true"), 1, 79.2 * 2**30), plan_for(cfg("false"), 1, 79.2 * 2**30)
    for phase in ("actor update", "log-prob pass"):
        assert kept.phase(phase).parts["vLLM weights"] == weights
        assert kept.phase(phase).total - sent.phase(phase).total == pytest.approx(weights)
        assert "vLLM weights" not in sent.phase(phase).parts
    assert kept.phase("generation").parts == sent.phase("generation").parts
    assert host_memory_line(cfg("true"), 1, 1, None) is None
    assert host_memory_line(cfg("false"), 1, 1, None)[0].startswith("host memory: 14.2 GiB per rank")
    # 16384 tokens with the weights kept do not fit a 95 GiB GPU; without them they do
    over = cfg("true", "actor.max_token_len_per_gpu=16384")
    with pytest.raises(mc.MemoryPlanError) as e:
        check_memory(over, 1, 95 * 2**30)
    without = plan_for(cfg("false", "actor.max_token_len_per_gpu=16384"), 1, 95 * 2**30)
    assert without.fits
    assert f"rollout.weights_stay_on_gpu = false (peak {without.peak.total / 2**30:.1f} GiB, fits)" in str(e.value)


def test_the_engine_awake_is_in_every_training_phase_with_its_kv_cache():
    """rollout.stay_awake: the whole engine stays beside training: with rollout.kv_cache_tokens its bf16
    weights, its KV cache (written out: Qwen2.5-7B's 28 layers x 4 KV heads x 128 x key and value x 2
    bytes a token, 512 sequences x 640 tokens in blocks of 64, and vLLM's null block) and
    ENGINE_RUNTIME_GIB; where vLLM sizes its KV cache, its whole share of the device. Generation counts
    the engine alike, awake or not. The refusal names rollout.stay_awake = false with the peak it gives."""
    from spmd_rl.preflight.memory import check_memory, plan_for

    base = ['model.init="random"', 'model.path=""', 'model.arch="qwen2-7b"', 'model.tokenizer="char"',
            "trainer.save_every=-1", "model.gradient_checkpointing=false", "actor.max_token_len_per_gpu=16384",
            "actor.logprob_max_token_len_per_gpu=32768", "rollout.weights_stay_on_gpu=true",
            "data.max_prompt_length=128", "data.max_response_length=512"]  # bench_step's work: 640 tokens
    weights = 7_615_616_512 * 2
    kv = (512 * 640 // 64 + 1) * 64 * 28 * 4 * 128 * 2 * 2
    big = 139.8 * GiB

    def cfg(awake, *more):
        return load_config(os.path.join(ROOT, "configs", "qwen7b-lora.toml"),
                           [*base, f"rollout.stay_awake={awake}", *more])

    sized = 'rollout.kv_cache_tokens="auto"'
    awake, asleep = plan_for(cfg("true", sized), 1, big), plan_for(cfg("false", sized), 1, big)
    for phase in ("actor update", "log-prob pass"):
        parts = awake.phase(phase).parts
        assert parts["vLLM awake"] == pytest.approx(weights + kv + 2 * GiB)
        assert "vLLM weights" not in parts  # in the awake engine's part
        assert awake.phase(phase).total - asleep.phase(phase).total == pytest.approx(kv + 2 * GiB)
    assert awake.phase("generation").parts == asleep.phase("generation").parts
    assert awake.phase("generation").parts["vLLM"] == pytest.approx(weights + kv + 2 * GiB)  # the sized cache
    share = plan_for(cfg("true", "rollout.kv_cache_tokens=0"), 1, big)  # vLLM fills 0.6 of the device
    assert share.phase("actor update").parts["vLLM awake"] == share.phase("generation").parts["vLLM"] == 0.6 * big
    # the sized cache fits a 141 GB GPU within the 90% the speed settings keep; on 80 GB it is refused
    assert awake.phase("actor update").total < 0.9 * big
    with pytest.raises(mc.MemoryPlanError) as e:
        check_memory(cfg("true", 'rollout.kv_cache_tokens="auto"', "actor.max_token_len_per_gpu=8192"), 1, H100_TOTAL)
    asleep80 = plan_for(cfg("false", 'rollout.kv_cache_tokens="auto"', "actor.max_token_len_per_gpu=8192"), 1, H100_TOTAL)
    assert asleep80.fits
    assert f"rollout.stay_awake = false (peak {asleep80.peak.total / GiB:.1f} GiB, fits)" in str(e.value)
