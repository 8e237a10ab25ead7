"""Model and tokenizer directories a user names (model.path, critic.path, model.tokenizer): every
way they can be broken is one ModelFilesError naming the key, the directory, what is wrong and the
fix -- found by config validation where small files tell, by the load itself otherwise."""

import json
import os
import re
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from spmd_rl import preflight
from spmd_rl.build import check_tokenizer_vocab
from spmd_rl.config.run_config import load_config
from spmd_rl.model.files import ModelFilesError, check_vocab, loading, safetensors_problem
from spmd_rl.model.loading import ARCH_PRESETS, load_causal_lm, load_value_model
from spmd_rl.model.tokenizer import build_char_tokenizer, load_tokenizer
from tests.helpers import ROOT

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")


@pytest.fixture(scope="module")
def good_model(tmp_path_factory):
    """A complete Hugging Face directory: the tiny Qwen2 (vocab_size 64), the character tokenizer."""
    path = tmp_path_factory.mktemp("model") / "good"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Qwen2Config(**ARCH_PRESETS["tiny"])).save_pretrained(path)
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture
def model(good_model, tmp_path):
    """A copy of the good model to break."""
    return shutil.copytree(good_model, tmp_path / "model")


def validate(*overrides):
    cfg = load_config(TINY, list(overrides))
    preflight.validate(cfg, world_size=2, gpus_per_node=2)


def pretrained(path, *extra):
    validate(f"model.path={path}", 'model.init="pretrained"', 'model.tokenizer=""', *extra)


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_a_complete_model_directory_passes(good_model):
    pretrained(good_model)
    pretrained(good_model, 'algorithm.adv_estimator="gae"', f"critic.path={good_model}")


def _shard(path):
    """Split the weights into two shards with an index, as large models come."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, path / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    os.remove(path / "model.safetensors")


def _truncate(file, keep):
    size = os.path.getsize(file)
    os.truncate(file, keep(size))
    return size


BROKEN = {  # damage -> the message (after "model.path = '<dir>'"); {size}: the file's size before the damage
    "missing": (lambda p: shutil.rmtree(p), " does not exist: point it at a local Hugging Face model directory"),
    "a file": (lambda p: (shutil.rmtree(p), p.write_text("")), " is a file, not a directory"),
    "no config": (lambda p: os.remove(p / "config.json"),
                  " has no config.json: point it at a Hugging Face model directory"),
    "config not JSON": (lambda p: (p / "config.json").write_text("{not json"),
                        ": config.json is not readable JSON (Expecting property name enclosed in double quotes: "
                        "line 1 column 2 (char 1)): restore it from the original model"),
    "config a list": (lambda p: (p / "config.json").write_text("[]"),
                      ": config.json holds a list, not a JSON object"),
    "no model_type": (lambda p: edit_config(p, model_type=""), ": config.json has no model_type"),
    "unknown model_type": (lambda p: edit_config(p, model_type="qwen99"),
                           ": config.json has model_type 'qwen99', which transformers"),
    "no weights": (lambda p: os.remove(p / "model.safetensors"),
                   " has no weights (none of model.safetensors.index.json, model.safetensors, "
                   "pytorch_model.bin.index.json, pytorch_model.bin): copy the model's weight files into it, or set "
                   'model.init = "random" to start from random weights'),
    "truncated weights": (lambda p: _truncate(p / "model.safetensors", lambda n: n - 100),
                          ": model.safetensors is truncated ({cut} of {size} bytes): copy the model's files again"),
    "weights cut in the header": (lambda p: _truncate(p / "model.safetensors", lambda n: 100),
                                  ": model.safetensors is truncated or corrupt (its header claims"),
    "corrupt header": (lambda p: (p / "model.safetensors").write_bytes(
        (12).to_bytes(8, "little") + b"{not a json}" + b"\0" * 64), ": model.safetensors has a corrupt header"),
    "missing shard": (lambda p: (_shard(p), os.remove(p / "model-00002-of-00002.safetensors")),
                      ": model.safetensors.index.json lists model-00002-of-00002.safetensors, which is missing"),
    "truncated shard": (lambda p: (_shard(p), _truncate(p / "model-00001-of-00002.safetensors", lambda n: n // 2)),
                        ": model-00001-of-00002.safetensors is truncated ("),
    "no tokenizer": (lambda p: [os.remove(p / f) for f in ("tokenizer.json", "tokenizer_config.json")],
                     " has no tokenizer files (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
                     "vocab.json, vocab.txt): copy them from the model it was trained from"),
}


@pytest.mark.parametrize("damage", sorted(BROKEN))
def test_a_broken_model_directory_is_named_before_anything_loads(model, damage):
    damage_fn, message = BROKEN[damage]
    weights = model / "model.safetensors"
    size = os.path.getsize(weights)
    damage_fn(model)
    cut = os.path.getsize(weights) if weights.is_file() else 0
    with pytest.raises(ModelFilesError) as e:
        pretrained(model)
    assert str(e.value).startswith(f"model.path = '{model}'" + message.format(size=size, cut=cut)), str(e.value)
    assert "\n" not in str(e.value)


def test_critic_and_tokenizer_directories_are_checked_under_their_own_keys(good_model, model, tmp_path):
    os.remove(model / "model.safetensors")
    with pytest.raises(ModelFilesError, match=re.escape(f"critic.path = '{model}' has no weights (none of ")):
        pretrained(good_model, 'algorithm.adv_estimator="gae"', f"critic.path={model}")
    validate(f"critic.path={model}")  # no critic (GRPO): not read
    with pytest.raises(ModelFilesError, match=re.escape(f"model.tokenizer = '{tmp_path}/none' does not exist: point "
                                                        'it at a tokenizer or model directory (or set model.tokenizer = '
                                                        '"char")')):
        validate(f"model.tokenizer={tmp_path}/none")
    os.remove(model / "tokenizer.json")
    os.remove(model / "tokenizer_config.json")
    with pytest.raises(ModelFilesError, match=re.escape(f"model.tokenizer = '{model}' has no tokenizer files")):
        validate(f"model.tokenizer={model}")
    validate(f"model.path={model}", f"model.tokenizer={good_model}")  # random init: a config.json is enough


def test_random_init_needs_only_a_config(model):
    os.remove(model / "model.safetensors")
    validate(f"model.path={model}", 'model.init="random"', 'model.tokenizer=""')
    edit_config(model, model_type="qwen99")
    with pytest.raises(ModelFilesError, match="model_type 'qwen99', which transformers .* does not know: fix "
                                              "model_type, or install a transformers version that supports"):
        validate(f"model.path={model}", 'model.init="random"')


# --------------------------------------------------------------------------- what only a load finds


def test_safetensors_whose_header_passes_but_data_is_corrupt_fails_at_load_as_one_line(model):
    data = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data.replace(b'"F32"', b'"Q32"'))  # same length: an unknown dtype
    assert safetensors_problem(str(model / "model.safetensors")) is None
    with pytest.raises(ModelFilesError) as e:
        load_causal_lm(str(model), torch.float32, key="model.path")
    assert str(e.value).startswith(f"model.path = '{model}': loading the model failed (SafetensorError: ")
    assert str(e.value).endswith("make it a complete Hugging Face model directory (copy or download it again)")


def test_a_config_that_does_not_match_the_weights_fails_at_load_as_one_line(model):
    edit_config(model, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ModelFilesError, match=re.escape(
            f"critic.path = '{model}': loading the critic failed: its config.json describes other tensor shapes than "
            "its weights hold (transformers logged which ones above); use the config.json that came with the weights")):
        load_value_model(str(model), torch.float32, key="critic.path")


def test_weights_of_another_architecture_are_refused_instead_of_starting_random(model):
    """transformers initialises tensors it does not find randomly, with a warning only."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(model / "model.safetensors")
    save_file({k.replace("model.", "transformer."): v for k, v in tensors.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ModelFilesError, match=re.escape(f"model.path = '{model}': its weights lack ") + r"2[67] of "
                       r"the model's tensors \(e\.g\. '(lm_head|model\.embed_tokens)\.weight'\), which would start "
                       "random: the weights belong to another architecture"):  # 27: transformers 5 counts tied lm_head
        load_causal_lm(str(model), torch.float32, key="model.path")


def test_the_critic_head_is_the_one_tensor_allowed_to_start_new(good_model):
    critic = load_value_model(str(good_model), torch.float32, key="critic.path")
    assert critic.score.weight.abs().sum() == 0


@pytest.mark.parametrize("content,error", [("{bad", "JSONDecodeError"), ('{"a": 1}', "KeyError"),
                                           ("tokenizers model", "TypeError")])
def test_a_broken_tokenizer_fails_at_load_as_one_line(model, content, error):
    if content == "tokenizers model":  # valid JSON the tokenizers library cannot build
        spec = json.loads((model / "tokenizer.json").read_text())
        content = json.dumps({**spec, "model": {"type": "BPE", "vocab": 5}})
    (model / "tokenizer.json").write_text(content)
    with pytest.raises(ModelFilesError, match=re.escape(f"model.path = '{model}': loading the tokenizer failed "
                                                        f"({error}: ")):
        load_tokenizer("", str(model))


def test_loading_leaves_programming_errors_alone(tmp_path):
    for error in (RuntimeError("CUDA error: out of memory"), TypeError("f() takes 2 arguments"), AttributeError("x")):
        with pytest.raises(type(error)):
            with loading(str(tmp_path), "model.path"):
                raise error
    with pytest.raises(ModelFilesError, match="loading the tokenizer failed"):
        with loading(str(tmp_path), "model.tokenizer", "the tokenizer", tokenizer=True):
            raise TypeError("failed to extract enum PyVocab")


# --------------------------------------------------------------------------- tokenizer vs vocabulary


def vocab_check(cfg_overrides, tokenizer):
    """The check start-up runs (build.build_data), without the rest of a trainer."""
    check_tokenizer_vocab(load_config(TINY, cfg_overrides), tokenizer)


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_naming_both_numbers(good_model, model, tmp_path):
    char = build_char_tokenizer()
    n = len(char)
    edit_config(model, vocab_size=40)
    with pytest.raises(ModelFilesError) as e:
        vocab_check([f"model.path={model}", 'model.init="pretrained"'], char)
    assert str(e.value) == (
        f"the tokenizer (model.tokenizer = 'char') has {n} tokens but the model (model.path = '{model}') has "
        f"vocab_size 40: token ids 40..{n - 1} would index past its embedding; use the tokenizer that belongs to "
        f'the model (model.tokenizer = "" takes model.path\'s), or a model with a vocab_size of at least {n}')
    bigger = build_char_tokenizer()
    bigger.add_tokens([f"<extra_{i}>" for i in range(70 - n)])
    with pytest.raises(ModelFilesError, match=re.escape("the tokenizer (model.tokenizer = 'char') has 70 tokens but "
                                                        "the model (model.arch = 'tiny') has vocab_size 64")):
        vocab_check([], bigger)
    with pytest.raises(ModelFilesError, match=re.escape(f"the model (critic.path = '{model}') has vocab_size 40")):
        vocab_check([f"model.path={good_model}", 'algorithm.adv_estimator="gae"', f"critic.path={model}"], char)
    edit_config(model, vocab_size=100)  # a padded vocabulary (Qwen's) is normal
    vocab_check([f"model.path={model}", 'model.init="pretrained"'], char)
    vocab_check([], char)
    check_vocab(64, "t", 64, "m")
