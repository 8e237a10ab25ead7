import dataclasses
import os
import re

import pytest

from spmd_rl import preflight
from spmd_rl.config.reference import field_docs, markdown_reference
from spmd_rl.config.run_config import Config, load_config
from spmd_rl.errors import ConfigError
from spmd_rl.model.files import ModelFilesError
from tests.helpers import ROOT


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return str(p)


def valid_cfg(tmp_path, extra=()):
    data = tmp_path / "train.parquet"
    data.write_bytes(b"")
    return load_config(None, [f'data.train_files=["{data}"]', 'model.init="random"', 'model.arch="tiny"',
                              'model.tokenizer="char"', *extra])


def test_every_key_is_documented():
    for f in dataclasses.fields(Config):
        section = f.default_factory()
        docs = field_docs(type(section))
        missing = [sf.name for sf in dataclasses.fields(section) if not docs.get(sf.name)]
        assert not missing, f"[{f.name}] keys without a docstring: {missing}"
    assert set(field_docs(Config)) == {f.name for f in dataclasses.fields(Config)}


def test_docs_config_md_is_current():
    with open(os.path.join(ROOT, "docs", "config.md")) as f:
        assert f.read().strip() == markdown_reference().strip(), "regenerate: python -m spmd_rl.config.reference --markdown > docs/config.md"


def test_toml_and_overrides_with_types(tmp_path):
    path = write(tmp_path, '[actor]\nlr = 1e-5\n[rollout]\nn = 4\nstop_token_ids = [3]\n')
    cfg = load_config(path, ["actor.lr=2e-6", "rollout.n=8", "trainer.val_before_train=true",
                             "rollout.cudagraph_capture_sizes=[1,2,4]", "trainer.experiment_name=abc",
                             "actor.clip_ratio_high=1"])
    assert cfg.actor.lr == 2e-6 and cfg.rollout.n == 8 and cfg.trainer.val_before_train is True
    assert cfg.rollout.stop_token_ids == [3] and cfg.rollout.cudagraph_capture_sizes == [1, 2, 4]
    assert cfg.trainer.experiment_name == "abc" and cfg.actor.clip_ratio_high == 1.0
    assert isinstance(cfg.actor.clip_ratio_high, float)


@pytest.mark.parametrize("text, overrides, needle", [
    ("[actor]\nlrr = 1\n", [], "unknown config key 'actor.lrr'"),
    ("[actr]\nlr = 1\n", [], "unknown config section [actr]"),
    ("", ["rollout.n=four"], "rollout.n must be an integer"),
    ("", ["actor.lr=true"], "actor.lr must be a number"),
    ("", ["trainer.tensorboard=1"], "trainer.tensorboard must be true or false"),
    ("", ["actor.lr"], "must look like section.key=value"),
    ("", ["lr=1"], "must be section.key"),
    ("[actor\n", [], "not valid TOML"),
])
def test_parse_errors_name_the_key(tmp_path, text, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("key, suggestion", [
    ("actor.lrr", "actor.lr"),  # a close spelling
    ("rollout.temprature", "rollout.temperature"),
    ("trainer.lr", "actor.lr"),  # the key of another section
    ("total_steps", "trainer.total_steps"),  # no section
    ("actr.lr", "actor"),  # a section
])
def test_a_typo_gets_did_you_mean_on_the_command_line_as_in_toml(tmp_path, key, suggestion):
    section, _, name = key.rpartition(".")
    texts = [("", [f"{key}=1"])] + ([(f"[{section}]\n{name} = 1\n", [])] if section else [])
    for text, overrides in texts:
        with pytest.raises(ConfigError) as e:
            load_config(write(tmp_path, text), overrides)
        assert re.search(rf"\(did you mean ([\w.]+, )*{re.escape(suggestion)}[,?]", str(e.value)), str(e.value)


def test_a_single_value_is_a_list_of_one_and_anything_list_like_shows_the_syntax(tmp_path):
    """The rule of docs/config.md's header: a list is TOML's `[...]`; one value alone is a list of
    one, in a TOML file and on the command line; a value that looks like a list but is not TOML's
    is refused with the syntax."""
    cfg = load_config(write(tmp_path, '[data]\nval_files = "v.parquet"\n'),
                      ["data.train_files=t.parquet", "rollout.stop_token_ids=5", "model.lora_target_modules="])
    assert (cfg.data.train_files, cfg.data.val_files, cfg.rollout.stop_token_ids) == (["t.parquet"], ["v.parquet"], [5])
    assert cfg.model.lora_target_modules == []
    cfg = load_config(None, ['data.train_files=["a.parquet", "b.parquet"]', "rollout.stop_token_ids=[5,6]"])
    assert cfg.data.train_files == ["a.parquet", "b.parquet"] and cfg.rollout.stop_token_ids == [5, 6]
    for override in ["data.train_files=[a.parquet]", "data.train_files=a.parquet,b.parquet"]:
        with pytest.raises(ConfigError, match=re.escape(
                "is not a list: write a TOML list, quoted for the shell: data.train_files='[\"a.parquet\", "
                "\"b.parquet\"]'")):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=re.escape("rollout.stop_token_ids='[1, 2]'")):
        load_config(None, ["rollout.stop_token_ids=5,6"])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/x.toml")


@pytest.mark.parametrize("overrides, world, needle", [
    (["data.train_batch_size=6"], 4, "data.train_batch_size = 6 does not divide by the 4 ranks"),
    (["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"], 1, "actor.ppo_mini_batch_size = 3 must divide"),
    (["data.train_batch_size=8", "actor.ppo_mini_batch_size=2", "rollout.n=1", "algorithm.adv_estimator=\"gae\""],
     4, "do not divide by the 4 ranks"),
    (["actor.micro_batch_size_per_gpu=3"], 1, "actor.micro_batch_size_per_gpu = 3 must divide"),
    (["rollout.n=1"], 1, "set rollout.n >= 2"),
    (["algorithm.adv_estimator=\"ppo\""], 1, "algorithm.adv_estimator = 'ppo' is not one of"),
    (["rollout.tensor_parallel_size=2"], 2, 'needs rollout.engine = "vllm"'),
    (["rollout.temperature=0"], 1, "rollout.temperature must be > 0"),
    (["trainer.resume=\"/nope\""], 1, "is not a checkpoint directory"),
    (["model.arch=\"gpt5\""], 1, "not a preset"),
])
def test_validation_errors(tmp_path, overrides, world, needle):
    cfg = valid_cfg(tmp_path, overrides)
    with pytest.raises(ConfigError) as e:
        preflight.validate(cfg, world_size=world)
    assert needle in str(e.value)


def test_config_imports_nothing_of_the_package_below_it():
    """spmd_rl/config/ is the root: its modules import only each other and spmd_rl.errors, also
    inside functions (the checks that need more are spmd_rl/preflight/'s)."""
    import ast

    found = {}
    folder = os.path.join(ROOT, "spmd_rl", "config")
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name)) as f:
                tree = ast.parse(f.read())
            modules = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
            modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            below = [m for m in modules if m.startswith("spmd_rl") and m != "spmd_rl.errors"
                     and not m.startswith("spmd_rl.config")]
            if below:
                found[name] = below
    assert found == {}


def test_tp_group_may_not_span_nodes(tmp_path, monkeypatch):
    from spmd_rl.rollout.vllm import kwargs as vllm_kwargs

    monkeypatch.setattr(vllm_kwargs, "vllm_import_problem", lambda: None)  # engine = "vllm" without vLLM here
    cfg = valid_cfg(tmp_path, ['rollout.engine="vllm"', "rollout.tensor_parallel_size=4",
                               "data.train_batch_size=24", "actor.ppo_mini_batch_size=24"])
    preflight.validate(cfg, world_size=8, gpus_per_node=8)
    preflight.validate(cfg, world_size=12, gpus_per_node=4)
    with pytest.raises(ConfigError, match="would span two nodes"):
        preflight.validate(cfg, world_size=12, gpus_per_node=6)


def test_fsdp_size_must_divide_the_world(tmp_path):
    cfg = valid_cfg(tmp_path, ["trainer.fsdp_size=4", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"])
    preflight.validate(cfg, world_size=8, gpus_per_node=4)
    assert "world=8 (HSDP: 2 replicas x shard groups of 4)" in cfg.describe_layout(8)
    assert "HSDP" not in valid_cfg(tmp_path, ["trainer.fsdp_size=4"]).describe_layout(4)  # one group = plain FSDP
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, ["trainer.fsdp_size=8"]), world_size=12, gpus_per_node=6)
    assert str(e.value) == ("trainer.fsdp_size = 8 does not divide the world size 12 (it is the ranks per shard "
                            "group; the model is replicated across the groups): use a divisor of 12, e.g. the 6 GPUs "
                            "per node on several nodes, or 0 to shard over all ranks")
    with pytest.raises(ConfigError, match=r"trainer.fsdp_size = -1 must be >= 0 \(0 = shard over all ranks\)"):
        preflight.validate(valid_cfg(tmp_path, ["trainer.fsdp_size=-1"]), world_size=1)


def test_missing_model_and_data(tmp_path):
    cfg = load_config(None, ["model.path=/no/model", f'data.train_files=["{tmp_path}/x.parquet"]'])
    with pytest.raises(ModelFilesError, match="model.path = '/no/model' does not exist"):
        preflight.validate(cfg)
    cfg = load_config(None, ['model.init="random"', 'model.arch="tiny"', 'model.tokenizer="char"',
                             f'data.train_files=["{tmp_path}/x.parquet"]'])
    with pytest.raises(ConfigError, match="does not exist"):
        preflight.validate(cfg)


def test_shipped_configs_parse():
    for name in os.listdir(os.path.join(ROOT, "configs")):
        if name.endswith(".toml"):
            load_config(os.path.join(ROOT, "configs", name))


@pytest.mark.parametrize("overrides, needle", [
    (['actor.policy_loss="grpo"'], "actor.policy_loss = 'grpo' is not one of"),
    (['algorithm.rollout_is="tok"'], "algorithm.rollout_is = 'tok' is not one of"),
    (["algorithm.rollout_is_threshold=0"], "algorithm.rollout_is_threshold must be > 0"),
    (["algorithm.rollout_mask_low=1.5"], "algorithm.rollout_mask_low = 1.5 must be in (0, 1]"),
    (["algorithm.dynamic_sampling=true", 'algorithm.adv_estimator="gae"'], "use algorithm.adv_estimator = grpo or rloo"),
    (["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=0"], "must be >= 1"),
    (["reward.overlong_buffer=100000"], "reward.overlong_buffer must be in"),
    (["rollout.val_n=4"], "rollout.val_n > 1 needs rollout.val_temperature > 0"),
    (["rollout.block_size=24"], "rollout.block_size = 24 must be 0 (vLLM's default) or a multiple of 16"),
    (["rollout.block_size=-16"], "rollout.block_size = -16 must be 0"),
    (["model.gradient_checkpointing_layers=0.5"], "needs model.gradient_checkpointing = true"),
    (["model.gradient_checkpointing=true", "model.gradient_checkpointing_layers=0"],
     "model.gradient_checkpointing_layers = 0.0 must be in (0, 1]"),
    (["model.gradient_checkpointing=true", "model.gradient_checkpointing_layers=1.5"], "must be in (0, 1]"),
])
def test_recipe_switch_validation_errors(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, overrides), world_size=1)
    assert needle in str(e.value)


def test_the_critic_takes_the_actors_micro_batching_unless_set(tmp_path):
    packed = ["model.remove_padding=true", "actor.max_token_len_per_gpu=4096", "actor.micro_batch_size_per_gpu=8",
              'algorithm.adv_estimator="gae"']
    cfg = valid_cfg(tmp_path, packed)
    preflight.validate(cfg)
    assert cfg.micro_batching("critic") == cfg.micro_batching("actor") == (8, 4096, 8192)
    cfg = valid_cfg(tmp_path, [*packed, "actor.logprob_max_token_len_per_gpu=6000"])
    assert cfg.micro_batching("actor").forward_tokens == 6000 and cfg.micro_batching("critic").forward_tokens == 8192
    cfg = valid_cfg(tmp_path, [*packed, "critic.max_token_len_per_gpu=2048", "critic.forward_max_token_len_per_gpu=3000"])
    assert cfg.micro_batching("critic") == (8, 2048, 3000)
    cfg = valid_cfg(tmp_path, [*packed, "critic.max_token_len_per_gpu=0", "critic.micro_batch_size_per_gpu=2"])
    preflight.validate(cfg)
    assert cfg.micro_batching("critic") == (2, 0, 0)  # 0: micro-batches of sequences, as the user asked
    layout = cfg.describe_layout(1)
    assert "actor: 1 optimizer steps x 1 epochs, 32 sequences per rank per mini-batch packed into micro-batches of " \
           "<= 4096 tokens (<= 8192 without gradients)" in layout, layout
    assert "critic: 1 optimizer steps x 1 epochs, 32 sequences per rank per mini-batch = 16 micro-batches of 2 " \
           "sequences" in layout, layout
    with pytest.raises(ConfigError, match=r"critic.max_token_len_per_gpu must be >= 0 \(0 = off\), or -1 = the actor's"):
        preflight.validate(valid_cfg(tmp_path, [*packed, "critic.max_token_len_per_gpu=-2"]))
    with pytest.raises(ConfigError, match=r"critic.micro_batch_size_per_gpu = 16 \(actor.micro_batch_size_per_gpu, "
                                          r"taken as critic.micro_batch_size_per_gpu = 0\) must divide the 8 sequences"):
        preflight.validate(valid_cfg(tmp_path, ['algorithm.adv_estimator="gae"', "actor.micro_batch_size_per_gpu=16",
                                     "actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=2"]))


LORA = ["model.lora_rank=8"]


@pytest.mark.parametrize("overrides, needle", [
    (["model.lora_rank=-1"], "model.lora_rank = -1 must be >= 1 for LoRA, or 0 for full fine-tuning"),
    ([*LORA, "model.lora_alpha=0"], "model.lora_alpha = 0.0 must be > 0"),
    ([*LORA, "model.lora_dropout=0.1"], "model.lora_dropout = 0.1 must be 0: it is not supported, every dropout is off"),
    ([*LORA, 'model.lora_target_modules=["q_proj", "qkv"]'],
     "model.lora_target_modules names 'qkv', not a linear layer of the decoder of model.arch = 'tiny': it has "
     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (or [] for all of them)"),
    ([*LORA, 'model.arch="qwen3-moe-tiny"', 'model.lora_target_modules=["q_proj", "gate_up_proj"]'],
     "model.lora_target_modules names 'gate_up_proj', not a linear layer of the decoder of model.arch = "
     "'qwen3-moe-tiny' (gate_up_proj: the mixture of experts' fused expert weights, which LoRA does not adapt here: "
     "docs/moe.md): it has k_proj, o_proj, q_proj, v_proj (or [] for all of them)"),
    ([*LORA, 'model.arch="glm4-moe-lite-tiny"', 'model.lora_target_modules=["q_a_proj", "gate_proj", "mlp.down_proj"]'],
     "model.lora_target_modules names 'gate_proj', 'mlp.down_proj': on a mixture of experts PEFT maps an MLP name to "
     "the fused experts, which LoRA does not adapt here; name the attention's layers (or [] for all of them: "
     "docs/moe.md)"),
    ([*LORA, 'model.arch="glm4-moe-lite-tiny"', "rollout.engine=vllm"], "model.lora_target_modules adapts kv_b_proj "
     "([]: every attention layer), which vLLM's latent attention folds into matrices computed after loading: its LoRA "
     "layers do not adapt them, so the engine would sample without that part of the adapter. Adapt the others "
     "(model.lora_target_modules = ['kv_a_proj_with_mqa', 'o_proj', 'q_a_proj', 'q_b_proj']), or set "
     'model.lora_sync = "merged" (docs/moe.md)'),
    ([*LORA, 'model.arch="glm4-moe-lite-tiny"', "rollout.engine=vllm", 'model.lora_target_modules=["q_b_proj", '
      '"self_attn.kv_b_proj"]'], "model.lora_target_modules adapts kv_b_proj, which vLLM's latent attention folds"),
    ([*LORA, 'model.lora_target_modules=["lm_head"]'], "model.lora_target_modules names lm_head: the embeddings and "
     "the LM head are not adapted"),
    (["model.lora_rank=600"], "model.lora_rank = 600 is above the largest rank vLLM's LoRA layers take (512) for "
     'model.lora_sync = "adapter": use a rank <= 512, or model.lora_sync = "merged"'),
    ([*LORA, "model.lora_sync=fused"], "model.lora_sync = 'fused'"),
    ([*LORA, "rollout.engine=vllm", "rollout.sleep_level=2"], 'model.lora_sync = "adapter" sends the base weights to '
     "vLLM once and keeps them, but rollout.sleep_level = 2 drops them at every sleep (the base would be sent every "
     'step): set rollout.sleep_level = 0 (picks 1) or 1, or model.lora_sync = "merged"'),
    *[(overrides + ["rollout.weights_stay_on_gpu=true"], "rollout.weights_stay_on_gpu = true keeps the vLLM engine's "
       "base weights on the GPU while it sleeps, which only LoRA's adapter sync can use (its base never changes): set it "
       'to false or "auto", or use rollout.engine = "vllm" with model.lora_rank > 0 and model.lora_sync = "adapter"')
      for overrides in ([*LORA], [*LORA, "rollout.engine=vllm", "model.lora_sync=merged"], ["rollout.engine=vllm"])],
])
def test_lora_refusals(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, overrides), world_size=1)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_lora_targets_accepted(tmp_path):
    for targets in ('[]', '["all-linear"]', '["q_proj", "self_attn.v_proj", "down_proj"]'):
        preflight.validate(valid_cfg(tmp_path, [*LORA, f"model.lora_target_modules={targets}"]), world_size=1)
    from spmd_rl.preflight.models import check_lora_in_latent_attention  # (validate would import vLLM after it)

    glm = [*LORA, 'model.arch="glm4-moe-lite-tiny"']
    for served in (["rollout.engine=vllm", 'model.lora_target_modules=["q_a_proj", "q_b_proj", "o_proj"]'],
                   ["rollout.engine=vllm", 'model.lora_sync="merged"'], ["rollout.engine=hf"]):
        check_lora_in_latent_attention(valid_cfg(tmp_path, [*glm, *served]))


@pytest.mark.parametrize("overrides, level", [
    ([], 2), (LORA, 1), ([*LORA, "model.lora_sync=merged"], 2), ([*LORA, "rollout.sleep_level=1"], 1),
    ([*LORA, "model.lora_sync=merged", "rollout.sleep_level=1"], 1), (["rollout.sleep_level=1"], 1),
    (["model.lora_rank=600", "model.lora_sync=merged"], 2),
])
def test_engine_sleep_level_follows_the_lora_sync(tmp_path, overrides, level):
    """rollout.sleep_level = 0 picks 1 for the adapter sync (the base is kept), 2 for full weights every step."""
    cfg = valid_cfg(tmp_path, overrides)
    preflight.validate(cfg, world_size=1)  # (the hf engine: validating rollout.engine = "vllm" imports vLLM)
    assert cfg.engine_sleep_level() == level


def test_lora_without_peft_is_one_user_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, LORA), world_size=1)
    assert str(e.value) == ("model.lora_rank = 8 needs PEFT: peft is not installed (No module named 'peft'); "
                            "pip install -e '.[lora]' (peft==0.21.*), or set model.lora_rank = 0")


@pytest.mark.parametrize("old, new, needle", [
    (["model.lora_rank=8"], ["model.lora_rank=16"], "cannot resume with model.lora_rank changed (8 -> 16): it changes the "
     "LoRA adapter's shape (0: none) of the checkpoint; set it back, or start a new trainer.run_dir"),
    (["model.lora_rank=8"], ["model.lora_rank=0"], "model.lora_rank changed (8 -> 0)"),
    (["model.lora_rank=8"], ["model.lora_rank=8", 'model.lora_target_modules=["q_proj"]'],
     "cannot resume with model.lora_target_modules changed ([] -> ['q_proj']): it changes the layers that hold the LoRA "
     "adapter"),
    (["model.lora_rank=8"], ["model.lora_rank=8", "model.lora_alpha=64"], "model.lora_alpha changed (32.0 -> 64.0)"),
])
def test_a_resume_with_another_lora_adapter_is_refused(tmp_path, old, new, needle):
    from spmd_rl.config.toml_io import to_toml
    from spmd_rl.preflight.resume import check_resume_config

    (tmp_path / "config.toml").write_text(to_toml(load_config(None, [f"trainer.run_dir={tmp_path}", *old])))
    (tmp_path / "checkpoints" / "step_2").mkdir(parents=True)
    with pytest.raises(ConfigError) as e:
        check_resume_config(load_config(None, [f"trainer.run_dir={tmp_path}", *new]))
    assert needle in str(e.value) and "\n" not in str(e.value)
    lr_only = load_config(None, [f"trainer.run_dir={tmp_path}", *old, "actor.lr=1e-4"])
    assert check_resume_config(lr_only) == {"actor.lr": (1e-6, 1e-4)}


@pytest.mark.parametrize("overrides, needle", [
    (["actor.router_aux_loss_coef=0.001"], "actor.router_aux_loss_coef = 0.001 balances a mixture of experts' "
     "routers, and model.arch = 'tiny' is a dense model: set it to 0"),
    (['model.arch="qwen3-moe-tiny"', "actor.router_aux_loss_coef=-1"], "actor.router_aux_loss_coef = -1.0 must be >= 0"),
    (['model.arch="glm4-moe-lite-tiny"', "actor.router_aux_loss_coef=0.001"], "actor.router_aux_loss_coef = 0.001 is "
     "the load-balancing loss of softmax routers, and model.arch = 'glm4-moe-lite-tiny' (glm4_moe_lite) scores its "
     "experts by sigmoid and balances them with its score correction bias: set it to 0"),
])
def test_router_aux_loss_refusals(tmp_path, overrides, needle):
    with pytest.raises(ConfigError) as e:
        preflight.validate(valid_cfg(tmp_path, overrides), world_size=1)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_router_aux_loss_on_a_mixture_is_accepted(tmp_path):
    preflight.validate(valid_cfg(tmp_path, ['model.arch="qwen3-moe-tiny"', "actor.router_aux_loss_coef=0.001"]),
                       world_size=1)
