"""Each GPU's memory predicted at start-up (spmd_rl/runtime/memory_plan.py, spmd_rl/config/memory_check.py).

The parameter count against real transformers models built on the meta device; the training
state against a per-role sum written out here; the refusal for configs/qwen7b.toml on 2 ranks of
80 GB GPUs (issue 42: it died in vLLM's wake_up after 95 s) and its absence on 4; the measured
update peaks of docs/performance.md within 10%; an out-of-memory error as one line naming its phase.
"""

import json
import logging
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaConfig, Qwen2Config

from conftest import ROOT
from spmd_rl.model.loading import ARCH_PRESETS
from spmd_rl.runtime import memory_plan as mp

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
    **{f"preset-{name}": (lambda a=arch: Qwen2Config(**a)) for name, arch in ARCH_PRESETS.items()},
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_the_model_transformers_builds(name):
    """The formula's count (from config.json's entries) is the real model's, causal LM and critic."""
    config = CONFIGS[name]()
    shape = mp.shape_from_config(config.to_dict())
    assert shape.parameters() == meta_count(AutoModelForCausalLM, config)
    config.num_labels = 1
    assert shape.value_model_parameters() == meta_count(AutoModelForTokenClassification, config)


def test_qwen25_7b_has_its_published_parameter_count():
    assert mp.shape_from_config(QWEN25_7B_CONFIG).parameters() == 7_615_616_512


def test_training_state_bytes_per_role():
    """fp32 masters 4 + 4 + 8 bytes a parameter, a bf16 reference 2 bytes, each over the shard."""
    n = 7_615_616_512
    roles = [mp.Role("actor", n, 4, True), mp.Role("reference", n, 2, False)]
    assert mp.training_state_bytes(roles, 2) == {"params": n * 4 / 2 + n * 2 / 2, "grads": n * 4 / 2,
                                                 "optimizer": n * 8 / 2}


MEASURED_UPDATE_PEAKS = [  # docs/performance.md: memory/update_actor_peak_gb (PyTorch's tensors), 1xH100,
    # bench_step.sh's work (micro-batches filled to ~95% of the budget), the preset's other settings
    ("qwen2-0.5b", 16384, 0.0, 23.7),  # session 15
    ("qwen2-0.5b", 32768, 0.0, 37.1),  # session 15
    ("qwen2-1.5b", 16384, 0.0, 55.9),  # session 14
    ("qwen2-1.5b", 16384, 1.0, 28.9),  # session 13 (head chunks 4x smaller then)
    ("qwen2-1.5b", 16384, 0.5, 41.2),  # session 13
]


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


