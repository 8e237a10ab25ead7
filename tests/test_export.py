"""Hugging Face export: the exported directory is the trained actor, for transformers."""

import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

from spmd_rl.export import ExportError, export_checkpoint
from spmd_rl.model.loading import ARCH_PRESETS, preset_config


def logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=ids).logits.double()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def actor_from_dcp(model_dir, checkpoint):
    """Independent route: the run's starting model with the checkpoint's actor state loaded by DCP."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dcp.load({"actor": {"model": model.state_dict()}}, checkpoint_id=str(checkpoint), no_dist=True)
    return model


def test_export_at_end_matches_the_trained_actor(tiny_run, tmp_path):
    run_dir, _, export_dir = tiny_run
    checkpoint = run_dir / "checkpoints" / "step_2"
    assert sorted(os.listdir(export_dir)) == sorted(
        ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja"])
    exported = AutoModelForCausalLM.from_pretrained(export_dir)
    assert exported.config.tie_word_embeddings and "lm_head.weight" not in load_file(export_dir / "model.safetensors")
    reference = actor_from_dcp(run_dir / "init_model", checkpoint)
    initial = AutoModelForCausalLM.from_pretrained(run_dir / "init_model", dtype=torch.float32)
    ids = torch.randint(3, 64, (4, 12), generator=torch.Generator().manual_seed(0))
    lp_export, lp_ref, lp_init = logprobs(exported, ids), logprobs(reference, ids), logprobs(initial, ids)
    torch.testing.assert_close(lp_export, lp_ref, rtol=0, atol=1e-6)
    assert (lp_export - lp_init).abs().max() > 1e-4  # training moved the weights: not the initial model
    tok = AutoTokenizer.from_pretrained(export_dir)
    assert tok("384")["input_ids"] == AutoTokenizer.from_pretrained(run_dir / "init_model")("384")["input_ids"]

    # the CLI on the same checkpoint: several shards + index, bfloat16 = the fp32 export cast
    from spmd_rl.export import main

    out = tmp_path / "bf16"
    assert main(["--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "bfloat16",
                 "--shard-size-gb", str(20000 / 2**30)]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == shards
    bf16 = AutoModelForCausalLM.from_pretrained(out)
    assert bf16.dtype == torch.bfloat16 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    full = exported.state_dict()
    for name, t in bf16.state_dict().items():
        assert torch.equal(t, full[name].to(torch.bfloat16)), name
    assert main(["--checkpoint", str(checkpoint), "--out", str(out)]) == 2  # exists: refused, not overwritten


def test_export_untied_model(tmp_path):
    """lm_head is exported when the embeddings are not tied (a DCP checkpoint written in-process)."""
    config = Qwen2Config(**{**ARCH_PRESETS["tiny"], "tie_word_embeddings": False})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path / "model")
    from spmd_rl.model.tokenizer import build_char_tokenizer

    build_char_tokenizer().save_pretrained(tmp_path / "model")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # "trained": differs from the saved starting model
    ckpt = tmp_path / "ckpt"
    dcp.save({"actor": {"model": model.state_dict()}}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(str(ckpt), str(tmp_path / "hf"), model_dir=str(tmp_path / "model"))
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not torch.equal(loaded["lm_head.weight"], loaded["model.embed_tokens.weight"])
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t), name
    with pytest.raises(ExportError, match="not a complete DCP checkpoint"):
        export_checkpoint(str(tmp_path / "model"), str(tmp_path / "hf2"), model_dir=str(tmp_path / "model"))


def test_export_of_a_mixture_writes_each_expert_as_save_pretrained_does(tmp_path):
    """GLM-4.7-Flash's family: the exported files hold the per-expert names and values save_pretrained
    writes for the same weights (what vLLM's glm4_moe_lite loader reads), and load back into transformers."""
    from spmd_rl.model.tokenizer import build_char_tokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("glm4-moe-lite-tiny"), dtype=torch.float32)
    model.save_pretrained(tmp_path / "model")
    build_char_tokenizer().save_pretrained(tmp_path / "model")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = tmp_path / "ckpt"
    dcp.save({"actor": {"model": model.state_dict()}}, checkpoint_id=str(ckpt), no_dist=True)
    out = export_checkpoint(str(ckpt), str(tmp_path / "hf"), model_dir=str(tmp_path / "model"))
    model.save_pretrained(tmp_path / "reference")
    exported, reference = load_file(f"{out}/model.safetensors"), load_file(tmp_path / "reference" / "model.safetensors")
    assert sorted(exported) == sorted(reference) and "model.layers.1.mlp.experts.7.up_proj.weight" in exported
    for name, t in reference.items():
        assert torch.equal(exported[name], t), name
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t), name
