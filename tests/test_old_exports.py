"""What a user keeps outside a run, written by an earlier version, still loads: the Hugging Face
directory `python -m spmd_rl.export` wrote at 9d108d1 and the PEFT adapter `--adapter-out` wrote at
730471c (tests/fixtures/old_runs/*/written_by.json: the commands), each holding the tensors of the
checkpoint it was exported from."""

import os

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.checkpoint.test_old_checkpoint import OLD_RUNS

HF_EXPORT = os.path.join(OLD_RUNS, "0.1.0-9d108d1", "hf_export")
LORA_RUN = os.path.join(OLD_RUNS, "0.1.0-730471c-lora")


def checkpoint_actor(run, tmp_path):
    """The actor's tensors of the run's step_2, read by DCP alone (not by spmd_rl's export)."""
    dcp_to_torch_save(os.path.join(run, "checkpoints", "step_2"), tmp_path / "actor.pt")
    return torch.load(tmp_path / "actor.pt", weights_only=False)["actor"]["model"]


def test_a_hugging_face_export_of_9d108d1_loads_with_its_checkpoint_s_weights(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(HF_EXPORT)
    tokenizer = AutoTokenizer.from_pretrained(HF_EXPORT)
    trained = checkpoint_actor(os.path.dirname(HF_EXPORT), tmp_path)
    loaded = model.state_dict()
    assert set(trained) <= set(loaded)
    for name, tensor in trained.items():  # exported with --dtype bfloat16
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name
    ids = tokenizer("384", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_peft_adapter_of_730471c_loads_with_its_checkpoint_s_adapter(tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(HF_EXPORT))  # the same tiny shape
    ids = torch.tensor([[5, 9, 12, 7]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
    adapted = PeftModel.from_pretrained(base, os.path.join(LORA_RUN, "adapter"))
    trained = checkpoint_actor(LORA_RUN, tmp_path)
    loaded = {k.removeprefix("base_model.model."): v for k, v in adapted.state_dict().items() if "lora_" in k}
    assert sorted(loaded) == sorted(trained) and len(trained) == 28  # 7 layers' A and B in each of 2 blocks
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
    with torch.no_grad():
        assert (adapted(input_ids=ids).logits - before).abs().max() > 1e-4
