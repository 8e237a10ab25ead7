"""rollout.engine_kwargs: parsing (TOML, overrides, config.toml round trip), the refusals at config
check with their one-line messages, the pass-through into vllm.LLM's arguments, and resume.

No test needs vLLM: the names vllm.LLM takes are given as VLLM_0_26_NAMES (EngineArgs' fields and
LLM.__init__'s parameters, read with ast from vLLM 0.26.0's vllm/engine/arg_utils.py and
vllm/entrypoints/llm.py). Where vLLM is installed, the last test checks them against the real one.
"""

import logging
import sys

import pytest
import tomllib

from spmd_rl import preflight
from spmd_rl.config.run_config import Config, config_from_dict, load_config
from spmd_rl.config.toml_io import to_dict, to_toml
from spmd_rl.errors import ConfigError
from spmd_rl.preflight.resume import check_resume_config, config_changes
from spmd_rl.rollout.vllm import kwargs as vllm_kwargs
from spmd_rl.rollout.vllm.engine import engine_kwargs, step_capture_sizes
from spmd_rl.rollout.vllm.kwargs import FIXED, ROLLOUT_KEYS, check_engine_kwargs

VLLM_0_26_NAMES = frozenset("""
    _api_process_count _api_process_rank additional_config aggregate_engine_logging all2all_backend
    allow_deprecated_quantization allowed_local_media_path allowed_media_domains async_scheduling
    attention_backend attention_config block_size calculate_kv_scales chat_template code_revision
    collect_detailed_traces compilation_config config_format convert cp_kv_cache_interleave_size
    cpu_distributed_timeout_seconds cpu_offload_gb cpu_offload_params cudagraph_capture_sizes cudagraph_metrics
    data_parallel_address data_parallel_backend data_parallel_external_lb data_parallel_hybrid_lb
    data_parallel_multi_port_external_lb data_parallel_rank data_parallel_rpc_port data_parallel_size
    data_parallel_size_local data_parallel_start_rank dbo_decode_token_threshold dbo_prefill_token_threshold
    dcp_comm_backend dcp_kv_cache_interleave_size decode_context_parallel_size default_mm_loras device_ids
    diffusion_config disable_cascade_attn disable_chunked_mm_input disable_custom_all_reduce
    disable_hybrid_kv_cache_manager disable_log_stats disable_nccl_for_dp_synchronization disable_sliding_window
    distributed_executor_backend distributed_timeout_seconds download_dir dtype ec_transfer_config
    enable_bf16x3_router_gemm enable_chunked_prefill enable_cumem_allocator enable_dbo enable_elastic_ep
    enable_ep_weight_filter enable_eplb enable_expert_parallel enable_flashinfer_autotune
    enable_layerwise_nvtx_tracing enable_logging_iteration_details enable_lora
    enable_mamba_cache_stochastic_rounding enable_mfu_metrics enable_mixed_moe_lora_format enable_mm_embeds
    enable_mm_processor_stats enable_moe_shared_loras enable_prefix_caching enable_prompt_embeds
    enable_return_routed_experts enable_sleep_mode enable_tower_connector_lora enforce_eager eplb_config
    expert_placement_strategy fail_on_environ_validation fully_sharded_loras gdn_prefill_backend
    generation_config gpu_memory_utilization hf_config_path hf_overrides hf_token ignore_patterns
    interleave_mm_strings io_processor_plugin ir_op_priority jit_monitor_mode jit_monitor_verbose kernel_config
    kv_cache_dtype kv_cache_dtype_skip_layers kv_cache_memory_bytes kv_cache_metrics kv_cache_metrics_sample
    kv_events_config kv_offloading_backend kv_offloading_size kv_sharing_fast_prefill kv_transfer_config
    language_model_only limit_mm_per_prompt linear_backend load_format logits_processors logprobs_mode
    long_prefill_token_threshold lora_dtype lora_target_modules mamba_backend mamba_block_size mamba_cache_dtype
    mamba_cache_mode mamba_cache_philox_rounds mamba_config mamba_ssm_cache_dtype master_addr master_port
    max_cpu_loras max_cudagraph_capture_size max_logprobs max_long_partial_prefills max_lora_rank max_loras
    max_model_len max_num_batched_tokens max_num_partial_prefills max_num_scheduled_tokens max_num_seqs
    max_parallel_loading_workers media_io_kwargs mm_encoder_attn_backend mm_encoder_attn_dtype
    mm_encoder_fp8_scale_path mm_encoder_fp8_scale_save_margin mm_encoder_fp8_scale_save_path mm_encoder_only
    mm_encoder_tp_mode mm_ipc_gpu_memory_gb mm_processor_cache_gb mm_processor_cache_type mm_processor_kwargs
    mm_shm_cache_max_object_size_mb mm_tensor_ipc model model_class_overrides model_impl
    model_loader_extra_config model_weights moe_backend nnodes node_rank num_gpu_blocks_override numa_bind
    numa_bind_cpus numa_bind_nodes offload_backend offload_group_size offload_num_in_group offload_params
    offload_prefetch_step optimization_level otlp_traces_endpoint override_attention_dtype
    override_generation_config performance_mode pipeline_parallel_size pooler_config
    prefill_context_parallel_size prefill_schedule_interval prefix_caching_hash_algo prefix_match_unit
    profiler_config pt_load_map_location quantization quantization_config ray_workers_use_nsight
    reasoning_config reasoning_parser reasoning_parser_plugin renderer_num_workers revision runner
    safetensors_load_strategy safetensors_prefetch_block_size safetensors_prefetch_num_threads scheduler_cls
    scheduler_reserve_full_isl scheduling_policy seed served_model_name show_hidden_metrics_for_version
    shutdown_timeout skip_mm_profiling skip_tokenizer_init spec_method spec_model spec_tokens
    specialize_active_lora speculative_config stream_interval structured_outputs_config tensor_parallel_size
    tokenizer tokenizer_mode tokenizer_revision tokens_only trust_remote_code ubatch_size use_fp64_gumbel
    use_tqdm_on_load video_pruning_rate watermark weight_transfer_config worker_cls worker_extension_cls
""".split())


@pytest.fixture
def fake_vllm(monkeypatch):
    """vLLM "installed" with 0.26's argument names, for validation through Config.validate."""
    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)
    monkeypatch.setattr(vllm_kwargs, "vllm_llm_arg_names", lambda: VLLM_0_26_NAMES)


def valid_cfg(tmp_path, *overrides):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    return load_config(None, [f'data.train_files=["{data}"]', 'model.init="random"', 'model.arch="tiny"',
                              'model.tokenizer="char"', f"trainer.run_dir={tmp_path}/run", 'rollout.engine="vllm"',
                              *overrides])


def refusal(engine_kwargs, engine="vllm"):
    cfg = Config()
    cfg.rollout.engine, cfg.rollout.engine_kwargs = engine, engine_kwargs
    with pytest.raises(ConfigError) as e:
        check_engine_kwargs(cfg.rollout, lambda: VLLM_0_26_NAMES)
    return str(e.value)


# --------------------------------------------------------------------------- parsing


def test_from_a_toml_table_an_inline_table_and_overrides(tmp_path):
    toml = tmp_path / "c.toml"
    toml.write_text('[rollout]\nengine = "vllm"\n[rollout.engine_kwargs]\nasync_scheduling = true\n'
                    'compilation_config = {mode = 3, cudagraph_mode = "FULL_AND_PIECEWISE"}\n')
    cfg = load_config(str(toml))
    assert cfg.rollout.engine_kwargs == {"async_scheduling": True,
                                         "compilation_config": {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}}
    toml.write_text('[rollout]\nengine_kwargs = {kv_cache_dtype = "fp8", max_logprobs = 5}\nn = 2\n')
    assert load_config(str(toml)).rollout.engine_kwargs == {"kv_cache_dtype": "fp8", "max_logprobs": 5}
    # section.key.entry sets one entry (nested tables too, plain words are strings); section.key replaces the table
    cfg = load_config(str(toml), ["rollout.engine_kwargs.async_scheduling=true", "rollout.engine_kwargs.max_logprobs=1",
                                  "rollout.engine_kwargs.compilation_config.mode=2",
                                  "rollout.engine_kwargs.kv_cache_dtype=fp8_e5m2"])
    assert cfg.rollout.engine_kwargs == {"kv_cache_dtype": "fp8_e5m2", "max_logprobs": 1, "async_scheduling": True,
                                         "compilation_config": {"mode": 2}}
    cfg = load_config(str(toml), ["rollout.engine_kwargs={async_scheduling=true}", "rollout.engine_kwargs.b=[1, 2]"])
    assert cfg.rollout.engine_kwargs == {"async_scheduling": True, "b": [1, 2]}
    assert load_config(str(toml), ["rollout.engine_kwargs={}"]).rollout.engine_kwargs == {}
    assert Config().rollout.engine_kwargs == {} and Config().rollout.engine_kwargs is not Config().rollout.engine_kwargs


def test_config_toml_round_trip():
    cfg = load_config(None, ['rollout.engine_kwargs={async_scheduling=true, "a.b"=1, x-y=-2.5e-3, s="q\\"uote",'
                             ' compilation_config={cudagraph_mode="FULL", sizes=[1, 2], inner={}}, empty=[]}'])
    text = to_toml(cfg)
    assert ('engine_kwargs = {async_scheduling = true, "a.b" = 1, x-y = -0.0025, s = "q\\"uote", compilation_config = '
            '{cudagraph_mode = "FULL", sizes = [1, 2], inner = {}}, empty = []}') in text.splitlines()
    assert config_from_dict(tomllib.loads(text)) == cfg
    assert config_from_dict(tomllib.loads(to_toml(Config()))).rollout.engine_kwargs == {}


@pytest.mark.parametrize("overrides, message", [
    (["rollout.engine_kwargs=5"], "rollout.engine_kwargs must be a table, got 5: write rollout.engine_kwargs={name=value} "
     "or rollout.engine_kwargs.name=value on the command line, a [rollout.engine_kwargs] table in the config file"),
    (["rollout.engine_kwargs=async_scheduling"], "rollout.engine_kwargs must be a table, got 'async_scheduling'"),
    (["actor.lr.x=1"], "override key 'actor.lr.x' must be section.key (e.g. actor.lr): only table keys "
     "(rollout.engine_kwargs) take section.key.entry"),
    (["rollout.engine_kwargs.a=1", "rollout.engine_kwargs.a.b=2"],
     "override 'rollout.engine_kwargs.a.b=2': rollout.engine_kwargs.a is 1, not a table"),
    (["rollout.engine_kwargs={a=[1979-05-27]}"],
     "rollout.engine_kwargs.a[0] = datetime.date(1979, 5, 27): a date or time is not a value here; quote it as a string"),
    (["rollout.engine_kwarg.a=1"], "unknown config key 'rollout.engine_kwarg' (did you mean rollout.engine_kwargs, "
     "rollout.engine?)"),
])
def test_malformed_engine_kwargs_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(message), str(e.value)


# --------------------------------------------------------------------------- refusals


def test_engine_kwargs_need_the_vllm_engine():
    assert refusal({"async_scheduling": True, "max_logprobs": 2}, engine="hf") == (
        "rollout.engine_kwargs (async_scheduling, max_logprobs) are arguments of vllm.LLM but rollout.engine = 'hf': "
        'set rollout.engine = "vllm", or remove rollout.engine_kwargs')


@pytest.mark.parametrize("name, reason", [
    ("load_format", "the engine starts from dummy weights and gets the actor's weights at every step"),
    ("model", "the engine is built on the actor's model directory (model.path) and gets the actor's weights at every "
              "step"),
    ("distributed_executor_backend", "the engine runs inside each torchrun process (external_launcher)"),
    ("enable_sleep_mode", "the engine sleeps between rollouts so that training gets its memory (rollout.sleep_level "
                          "sets how deep)"),
    ("skip_tokenizer_init", "the engine takes and returns token ids; its stop tokens come from the model's config "
                            "files"),
    ("logprobs_mode", "the actor's importance ratio needs each sampled token's log-prob after temperature "
                      "(processed_logprobs)"),
    ("worker_cls", "weight syncs load into the model of vLLM's own worker in this process"),
    ("data_parallel_size", "the engine's layout comes from the launch: one replica per rollout.tensor_parallel_size "
                           "consecutive torchrun ranks, each on its own rank's GPU"),
    ("pipeline_parallel_size", "the engine's layout comes from the launch"),
])
def test_what_the_colocated_engine_fixes_is_refused_with_the_reason(name, reason):
    message = refusal({"async_scheduling": True, name: 1})
    assert message.startswith(f"rollout.engine_kwargs.{name} cannot be set: {reason}") and message.endswith(
        "; remove it"), message


@pytest.mark.parametrize("name", sorted(n for n in ROLLOUT_KEYS if "." not in n))
def test_what_a_rollout_key_sets_is_refused_naming_the_key(name):
    key = ROLLOUT_KEYS[name]  # rollout.<name>, or the key that sets it (kv_cache_memory_bytes: kv_cache_tokens)
    assert refusal({name: 1}) == (f"rollout.engine_kwargs.{name} duplicates {key}: set {key} "
                                  "instead, and remove it from rollout.engine_kwargs")


def test_capture_sizes_inside_compilation_config_name_the_rollout_key():
    assert refusal({"compilation_config": {"custom_ops": ["none"], "cudagraph_capture_sizes": [1, 2]}}) == (
        "rollout.engine_kwargs.compilation_config.cudagraph_capture_sizes duplicates rollout.cudagraph_capture_sizes: "
        "set rollout.cudagraph_capture_sizes instead, and remove it from rollout.engine_kwargs")
    check_engine_kwargs(Config().rollout.__class__(engine="vllm", engine_kwargs={"compilation_config": 3}),
                        lambda: VLLM_0_26_NAMES)  # an int compilation_config (the mode) is fine


def test_every_refused_name_is_one_vllm_takes():
    """A misspelt entry in FIXED or ROLLOUT_KEYS would refuse nothing."""
    assert not {n.split(".")[0] for n in [*FIXED, *ROLLOUT_KEYS]} - VLLM_0_26_NAMES


@pytest.mark.parametrize("name, hint", [
    ("async_schedulng", " (did you mean async_scheduling?)"),
    ("max_num_seq", " (did you mean rollout.max_num_seqs?)"),  # a rollout key's name: the key to set
    ("cuda_graph_sizes", " (did you mean rollout.cudagraph_capture_sizes or cudagraph_metrics?)"),
    ("enable_sleepmode", ""),  # refused names are not suggested
    ("warp_speed", ""),
])
def test_a_name_vllm_does_not_take_is_refused_with_the_closest(name, hint):
    assert refusal({"async_scheduling": True, name: 1}) == (
        f"rollout.engine_kwargs.{name} is not an argument of vllm.LLM{hint}: fix or remove it (see vLLM's EngineArgs)")


def test_without_vllm_the_vllm_engine_is_one_line(monkeypatch):
    cfg = Config()
    cfg.rollout.engine = "vllm"
    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: "No module named 'vllm'")
    with pytest.raises(ConfigError) as e:
        check_engine_kwargs(cfg.rollout)
    assert str(e.value) == (f"rollout.engine = \"vllm\" needs vLLM, which {sys.executable} cannot import (No module "
                            "named 'vllm'): install it (pip install -e \".[vllm]\" on a GPU machine), or set "
                            "rollout.engine = \"hf\"")

    def broken():
        raise ImportError("libcudart.so.12: cannot open shared object file")

    cfg.rollout.engine_kwargs = {"async_scheduling": True}  # the names are read from vLLM itself: an import
    with pytest.raises(ConfigError, match=r"cannot import \(ImportError: libcudart.so.12: cannot open shared object "
                                          r"file\): install it"):
        check_engine_kwargs(cfg.rollout, broken)
    cfg.rollout.engine_kwargs = {"load_format": "auto"}  # refusals need no vLLM
    with pytest.raises(ConfigError, match="load_format cannot be set"):
        check_engine_kwargs(cfg.rollout, broken)


def test_config_validation_runs_the_check(tmp_path, fake_vllm):
    preflight.validate(valid_cfg(tmp_path, "rollout.engine_kwargs={async_scheduling=true, compilation_config={custom_ops=[\"none\"]}}"))
    with pytest.raises(ConfigError, match="rollout.engine_kwargs.seed duplicates rollout.seed"):
        preflight.validate(valid_cfg(tmp_path, "rollout.engine_kwargs.seed=3"))
    with pytest.raises(ConfigError, match="rollout.engine_kwargs.async_schedulin is not an argument"):
        preflight.validate(valid_cfg(tmp_path, "rollout.engine_kwargs.async_schedulin=true"))
    with pytest.raises(ConfigError, match="are arguments of vllm.LLM but rollout.engine = 'hf'"):
        preflight.validate(valid_cfg(tmp_path, 'rollout.engine="hf"', "rollout.engine_kwargs.async_scheduling=true"))
    with pytest.raises(ConfigError, match="actor.lr = 0.0 must be > 0"):  # the other checks come first
        preflight.validate(valid_cfg(tmp_path, "actor.lr=0", "rollout.engine_kwargs.seed=3"))


# --------------------------------------------------------------------------- pass-through, resume


def test_engine_kwargs_come_after_ours_and_overrides_last():
    cfg = Config()
    ours = engine_kwargs(cfg, "/m", 7)
    cfg.rollout.engine_kwargs = {"async_scheduling": True, "compilation_config": {"custom_ops": ["none"]},
                                 "max_logprobs": 1}
    kw = engine_kwargs(cfg, "/m", 7, max_logprobs=4, enforce_eager=True)
    assert list(kw) == [*ours, "async_scheduling", "max_logprobs"]
    # a compilation_config table adds its entries to ours (rollout.vllm_compile's)
    assert kw == {**ours, "async_scheduling": True, "max_logprobs": 4, "enforce_eager": True,
                  "compilation_config": {**ours["compilation_config"], "custom_ops": ["none"]}}
    kw["compilation_config"]["custom_ops"].append("x")  # vLLM may change what it is given: not the config
    assert cfg.rollout.engine_kwargs["compilation_config"] == {"custom_ops": ["none"]}


def test_routed_experts_are_asked_for_on_an_moe_model_with_replay_only(tmp_path):
    import json

    moe, dense = tmp_path / "moe", tmp_path / "dense"
    for d, config in ((moe, {"model_type": "qwen3_moe", "num_experts": 8}), (dense, {"model_type": "qwen3"})):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
    cfg = Config()
    assert engine_kwargs(cfg, str(moe), 0)["enable_return_routed_experts"] is True  # actor.router_replay = "engine"
    assert "enable_return_routed_experts" not in engine_kwargs(cfg, str(dense), 0)
    cfg.actor.router_replay = "off"
    assert "enable_return_routed_experts" not in engine_kwargs(cfg, str(moe), 0)
    assert refusal({"enable_return_routed_experts": True}).startswith(
        "rollout.engine_kwargs.enable_return_routed_experts cannot be set: set from actor.router_replay")


@pytest.mark.parametrize("arch,targets,expected", [
    ("qwen3-moe-tiny", [], ["k_proj", "o_proj", "q_proj", "v_proj"]),  # not its fused experts, nor its router
    # latent attention; not the dense first layer's MLP nor the shared experts (PEFT would map those names
    # to the fused experts)
    ("glm4-moe-lite-tiny", [], ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]),
    ("tiny", [], ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ("tiny", ["q_proj", "self_attn.v_proj"], ["q_proj", "v_proj"])])
def test_the_engines_lora_layers_wrap_what_the_actors_adapter_adapts(tmp_path, arch, targets, expected):
    """With the adapter sync, vLLM's LoRA layers wrap the modules whose LoRA layers PEFT put in the
    actor (add_adapter), found from the model directory's config.json alone."""
    import torch
    from transformers import AutoModelForCausalLM

    from spmd_rl.model.loading import preset_config
    from spmd_rl.model.lora import LoraSettings, add_adapter

    config = preset_config(arch)
    config.save_pretrained(tmp_path)
    cfg = Config()
    cfg.model.lora_rank, cfg.model.lora_target_modules, cfg.model.lora_sync = 8, targets, "merged"
    assert "lora_target_modules" not in engine_kwargs(cfg, str(tmp_path), 0)  # merged sync: no LoRA layers
    cfg.model.lora_sync = "adapter"
    with torch.device("meta"):
        actor = add_adapter(AutoModelForCausalLM.from_config(config), LoraSettings(8, 16.0, tuple(targets), torch.float32))
    adapted = sorted({n.split(".lora_A.")[0].rsplit(".", 1)[-1] for n, _ in actor.named_parameters() if ".lora_A." in n})
    kw = engine_kwargs(cfg, str(tmp_path), 0)
    assert kw["enable_lora"] is True and kw["lora_target_modules"] == adapted == expected


def test_block_size_reaches_vllm_and_0_leaves_vllms_default():
    """rollout.block_size (default 64: vLLM's scheduler works per block on the CPU every decode
    step) is vllm.LLM's block_size; 0 passes none; engine_kwargs.block_size is refused naming the key."""
    cfg = Config()
    assert engine_kwargs(cfg, "/m", 0)["block_size"] == 64
    cfg.rollout.block_size = 128
    assert engine_kwargs(cfg, "/m", 0)["block_size"] == 128
    cfg.rollout.block_size = 0
    assert "block_size" not in engine_kwargs(cfg, "/m", 0)
    assert refusal({"block_size": 32}).startswith("rollout.engine_kwargs.block_size duplicates rollout.block_size")


def test_vllm_compile_off_gives_decode_cuda_graphs_without_inductor():
    """rollout.vllm_compile = false (the default): compilation_config mode 0 (no torch.compile) and
    FULL_DECODE_ONLY CUDA graphs; true: vLLM's default (no compilation_config); enforce_eager: none.
    A compilation_config entry that would undo the switch is refused naming the key."""
    cfg = Config()
    assert engine_kwargs(cfg, "/m", 0)["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    cfg.rollout.vllm_compile = True
    assert "compilation_config" not in engine_kwargs(cfg, "/m", 0)
    cfg.rollout.vllm_compile, cfg.rollout.enforce_eager = False, True
    assert "compilation_config" not in engine_kwargs(cfg, "/m", 0)
    for entry in ("mode", "cudagraph_mode"):
        assert refusal({"compilation_config": {entry: 3}}).startswith(
            f"rollout.engine_kwargs.compilation_config.{entry} duplicates rollout.vllm_compile")


def test_engine_kwargs_may_change_at_resume(tmp_path, caplog):
    old = load_config(None, [f"trainer.run_dir={tmp_path}", "rollout.engine_kwargs={async_scheduling=true, "
                             "compilation_config={mode=3}}"])
    (tmp_path / "config.toml").write_text(to_toml(old))
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    new = load_config(None, [f"trainer.run_dir={tmp_path}", "rollout.engine_kwargs={compilation_config={mode=2}, "
                             "kv_cache_dtype=\"fp8\"}"])
    expected = {"rollout.engine_kwargs.async_scheduling": (True, None),
                "rollout.engine_kwargs.compilation_config.mode": (3, 2),
                "rollout.engine_kwargs.kv_cache_dtype": (None, "fp8")}
    with caplog.at_level(logging.WARNING, logger="spmd_rl"):
        assert check_resume_config(new) == expected
    assert "rollout.engine_kwargs.compilation_config.mode: 3 -> 2" in caplog.text
    assert config_changes(to_dict(Config()), to_dict(Config())) == {}
    saved_before_the_key = tomllib.loads(to_toml(Config()))  # a config.toml written before engine_kwargs existed
    del saved_before_the_key["rollout"]["engine_kwargs"]
    assert config_changes(saved_before_the_key, to_dict(Config())) == {}


def test_the_names_come_from_the_installed_vllm():
    pytest.importorskip("vllm")
    names = vllm_kwargs.vllm_llm_arg_names()
    assert {"async_scheduling", "compilation_config", "chat_template", "model", "seed"} <= names
    assert not {n.split(".")[0] for n in [*FIXED, *ROLLOUT_KEYS]} - names
    assert vllm_kwargs.vllm_import_problem() is None


# --------------------------------------------------------------------------- CUDA-graph sizes


@pytest.mark.parametrize("changes, world, cap", [
    ({}, 1, 32),  # 8 prompts x n=4 on one replica; no validation data
    ({"rollout.n": 8, "data.train_batch_size": 64, "rollout.max_num_seqs": 512}, 1, 512),
    ({"rollout.n": 8, "data.train_batch_size": 64, "rollout.max_num_seqs": 512}, 8, 64),
    ({"rollout.n": 8, "data.train_batch_size": 64, "rollout.max_num_seqs": 512, "rollout.tensor_parallel_size": 2}, 8,
     128),  # a replica generates for its 2 ranks
    ({"rollout.n": 8, "data.train_batch_size": 64}, 1, 256),  # rollout.max_num_seqs caps it
    ({"rollout.partial_rollouts": True}, 1, 96),  # the partial rollouts' pool: three batches of 8 prompts x 4
    ({"rollout.partial_rollouts": True, "rollout.partial_pool_batches": 2}, 1, 64),
    ({"data.val_files": ["v.parquet"], "data.val_batch_size": 100, "rollout.val_n": 3}, 4, 75),  # ceil(100/4) x 3
])
def test_step_capture_sizes_cover_every_batch_a_call_can_have(changes, world, cap):
    cfg = Config()
    for key, value in changes.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    sizes = step_capture_sizes(cfg, world)
    assert sizes[0] == 1 and sizes[-1] == cap and sizes == sorted(set(sizes))
    # every batch b <= cap runs padded to a captured size of at most 1.5 b (2 b for b = 1, 2)
    for b in range(1, cap + 1):
        assert min(s for s in sizes if s >= b) <= max(1.5 * b, 2), b
    assert len(sizes) <= 2 * cap.bit_length()


def test_step_sizes_reach_vllm_only_when_asked_and_not_over_explicit_sizes():
    cfg = Config()
    assert "cudagraph_capture_sizes" not in engine_kwargs(cfg, "/m", 0, world_size=2)  # vLLM's default
    cfg.rollout.cudagraph_step_sizes = True
    assert engine_kwargs(cfg, "/m", 0, world_size=2)["cudagraph_capture_sizes"] == [1, 2, 3, 4, 6, 8, 12, 16]
    cfg.rollout.cudagraph_capture_sizes = [5, 7]
    assert engine_kwargs(cfg, "/m", 0, world_size=2)["cudagraph_capture_sizes"] == [5, 7]
    cfg.rollout.cudagraph_capture_sizes, cfg.rollout.enforce_eager = [], True
    assert "cudagraph_capture_sizes" not in engine_kwargs(cfg, "/m", 0, world_size=2)


def test_the_adapter_sync_builds_vllms_lora_layers_for_the_rank(tmp_path):
    """model.lora_sync = "adapter": enable_lora with the smallest max_lora_rank vLLM takes that holds the
    rank, one adapter, CUDA graphs with LoRA only; merged sync or no LoRA: no LoRA layers (they cost
    generation time); users' engine_kwargs cannot set them."""
    from spmd_rl.model.loading import preset_config

    preset_config("tiny").save_pretrained(tmp_path)
    cfg = Config()
    assert "enable_lora" not in engine_kwargs(cfg, str(tmp_path), 0)
    for rank, vllm_rank in ((1, 1), (8, 8), (20, 32), (32, 32), (300, 320), (512, 512)):
        cfg.model.lora_rank = rank
        kw = engine_kwargs(cfg, str(tmp_path), 0)
        assert (kw["enable_lora"], kw["max_lora_rank"], kw["max_loras"]) == (True, vllm_rank, 1), rank
    # every request carries the adapter: only vLLM's graphs with LoRA are captured, in either compile mode
    assert kw["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_specialize_lora": False}
    cfg.rollout.vllm_compile = True
    assert engine_kwargs(cfg, str(tmp_path), 0)["compilation_config"] == {"cudagraph_specialize_lora": False}
    cfg.model.lora_sync = "merged"
    assert "enable_lora" not in engine_kwargs(cfg, str(tmp_path), 0)
    assert "compilation_config" not in engine_kwargs(cfg, str(tmp_path), 0)
    assert refusal({"lora_target_modules": ["q_proj"]}).startswith(
        "rollout.engine_kwargs.lora_target_modules cannot be set: set from model.lora_target_modules")
    for name in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras"):
        assert "set from model.lora_rank and model.lora_sync" in refusal({name: 1})


def test_partial_rollouts_stream_new_tokens_every_few():
    """With rollout.partial_rollouts, vLLM sends a streamed run's tokens every STREAM_INTERVAL (streamed.py);
    without, vLLM's default."""
    from spmd_rl.rollout.vllm.engine import STREAM_INTERVAL

    cfg = Config()
    assert "stream_interval" not in engine_kwargs(cfg, "/m", 0)
    cfg.rollout.partial_rollouts = True
    assert engine_kwargs(cfg, "/m", 0)["stream_interval"] == STREAM_INTERVAL > 1


# --------------------------------------------------------------------------- rollout.kv_cache_tokens

QWEN2_7B_TOKEN_BYTES = 28 * 2 * 4 * 128 * 2
"""One token's KV cache of Qwen2.5-7B in bf16: 28 layers, a key and a value, 4 KV heads of 128, 2 bytes."""
BENCH_7B = ['model.init="random"', 'model.arch="qwen2-7b"', 'model.path=""', "data.max_prompt_length=128",
            "data.max_response_length=512", "data.train_batch_size=64", "rollout.n=8", "data.val_files=[]",
            'rollout.engine="vllm"']


@pytest.mark.parametrize("value, tokens", [
    ('"auto"', (512 * 640 // 64 + 1) * 64),  # 512 sequences of a call x 10 blocks of 64, and the null block
    ("400000", 400000),
], ids=["auto", "set"])
def test_the_kv_cache_gets_the_tokens_asked_at_the_models_bytes(value, tokens):
    cfg = load_config(None, [*BENCH_7B, f"rollout.kv_cache_tokens={value}"])
    assert cfg.engine_kv_cache_tokens(1) == tokens
    kw = engine_kwargs(cfg, "/m", 0, world_size=1, device_total=141e9)
    assert kw["kv_cache_memory_bytes"] == tokens * QWEN2_7B_TOKEN_BYTES


def test_auto_counts_a_calls_sequences_per_replica_and_whole_blocks():
    cfg = load_config(None, [*BENCH_7B, 'rollout.kv_cache_tokens="auto"', "data.max_response_length=500",
                             "rollout.block_size=16"])
    assert cfg.engine_kv_cache_tokens(2) == (256 * 40 + 1) * 16  # 256 sequences a rank, 628 tokens in 40 blocks


def test_without_the_key_or_above_the_engines_share_vllm_sizes_it(caplog):
    assert "kv_cache_memory_bytes" not in engine_kwargs(load_config(None, BENCH_7B), "/m", 0, device_total=141e9)
    cfg = load_config(None, [*BENCH_7B, 'rollout.kv_cache_tokens="auto"', "rollout.gpu_memory_utilization=0.2"])
    # 0.2 x 80 GB less the 15 GB of bf16 weights leaves less than the 18.8 GB asked: vLLM's own sizing
    assert "kv_cache_memory_bytes" not in engine_kwargs(cfg, "/m", 0, device_total=80e9)
    assert "kv_cache_memory_bytes" in engine_kwargs(cfg, "/m", 0, device_total=200e9)  # 0.2 of it leaves room


def test_a_set_size_is_kept_and_one_below_the_context_refused_in_one_line(tmp_path):
    cfg = load_config(None, [*BENCH_7B, "rollout.kv_cache_tokens=1000000", "rollout.gpu_memory_utilization=0.2"])
    assert engine_kwargs(cfg, "/m", 0, device_total=80e9)["kv_cache_memory_bytes"] == 1000000 * QWEN2_7B_TOKEN_BYTES
    with pytest.raises(ConfigError, match=r"rollout.kv_cache_tokens = 600 .*>= the engine's context length"):
        preflight.validate(valid_cfg(tmp_path, *BENCH_7B, "rollout.kv_cache_tokens=600"))


def test_the_engines_start_up_line_says_the_size_and_why():
    from spmd_rl.rollout.vllm.engine import kv_cache_words

    cfg = load_config(None, [*BENCH_7B, 'rollout.kv_cache_tokens="auto"'])
    assert kv_cache_words(cfg, 1, 327744 * QWEN2_7B_TOKEN_BYTES) == (
        '327744 tokens, 17.5 GiB (rollout.kv_cache_tokens "auto": 512 sequences x 640 tokens)')
    assert kv_cache_words(cfg, 1, 0).endswith("vLLM sizes it from gpu_memory_utilization")
