"""Hugging Face export of a trained actor: a DCP checkpoint -> a `from_pretrained` directory.

    python -m spmd_rl.export --checkpoint runs/X/checkpoints/step_N --out DIR [--dtype bfloat16]

DIR gets safetensors shards (+ model.safetensors.index.json when there is more than one),
config.json, generation_config.json and the tokenizer, so transformers and vLLM load it as they
load any model. The actor's weights are read from the DCP files in groups of at most
`--shard-size-gb` on the CPU of one process (no process group, no GPU), each group written as one
shard before the next is read: memory stays near one shard whatever the model size. Tied
embeddings (`tie_word_embeddings`) keep only the embedding, and a mixture's experts are written one
tensor each (spmd_rl.model.expert_layout), as `save_pretrained` does.

The run's config.toml (in the run directory the checkpoint's manifest.json names, else next to
`checkpoints/`) says which model directory the run started from
(`model.path`, or `<run_dir>/init_model` for random init); its config.json, generation config and
tokenizer are the ones exported.

A LoRA run's checkpoint holds the adapter only (model.lora_rank > 0): DIR gets the merged model,
W + (alpha / r) * B @ A computed by PEFT (`merge_and_unload`) in float32 on the base read from the
model directory, then cast; `--adapter-out ADIR` also writes PEFT's adapter directory
(`PeftModel.from_pretrained(base, ADIR)`). This path holds the whole model in float32 in memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from spmd_rl.checkpoint.checkpointer import CheckpointError, run_dir_of
from spmd_rl.errors import UserError
from spmd_rl.model import lora
from spmd_rl.model.expert_layout import per_expert

log = logging.getLogger(__name__)

ACTOR_PREFIX = "actor.model."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(UserError):
    """A checkpoint or output directory that cannot be exported, with the fix."""


def run_model_config(checkpoint: str):
    """The [model] section of the config of the run that wrote `checkpoint`."""
    from spmd_rl.config.run_config import load_config

    config_file = os.path.join(run_dir_of(checkpoint), "config.toml")
    if not os.path.isfile(config_file):
        raise ExportError(f"{config_file} does not exist: --checkpoint must be a step_N directory of a "
                          "spmd_rl run, or pass --model-dir (the model directory the run started from)")
    return load_config(config_file).model


def source_model_dir(checkpoint: str) -> str:
    """The model directory the run started from (config.json, tokenizer, generation config)."""
    m = run_model_config(checkpoint)
    path = os.path.join(run_dir_of(checkpoint), "init_model") if m.init == "random" else m.path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ExportError(f"the run's model directory {path!r} has no config.json; pass --model-dir")
    return path


def actor_tensors(checkpoint: str) -> dict[str, TensorStorageMetadata]:
    """Hugging Face name -> shape/dtype of every actor weight in the checkpoint."""
    if not os.path.isfile(os.path.join(checkpoint, ".metadata")):
        raise ExportError(f"{checkpoint!r} is not a complete DCP checkpoint (no .metadata): pass a "
                          "RUN/checkpoints/step_N directory")
    meta = FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    out = {k[len(ACTOR_PREFIX):]: v for k, v in meta.items()
           if k.startswith(ACTOR_PREFIX) and isinstance(v, TensorStorageMetadata)}
    if not out:
        raise ExportError(f"checkpoint {checkpoint!r} holds no actor weights ({ACTOR_PREFIX}*)")
    return out


def plan_shards(tensors: dict[str, TensorStorageMetadata], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Names grouped in checkpoint order into shards of at most `max_bytes` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors.items():
        nbytes = meta.size.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def read_tensors(checkpoint: str, tensors: dict[str, TensorStorageMetadata], names: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of `names`, read from the DCP files without a process group."""
    state = {ACTOR_PREFIX + n: torch.empty(tensors[n].size, dtype=tensors[n].properties.dtype) for n in names}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=FileSystemReader(checkpoint), no_dist=True)
    return {n: state[ACTOR_PREFIX + n] for n in names}


def export_checkpoint(checkpoint: str, out: str, dtype: str = "auto", model_dir: str | None = None,
                      shard_size_gb: float = 5.0, adapter_out: str | None = None) -> str:
    """Write the actor of `checkpoint` to `out` as a Hugging Face model directory; returns `out`.
    A LoRA checkpoint: the merged model, and with `adapter_out` PEFT's adapter directory too."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    model_dir = model_dir or source_model_dir(checkpoint)
    tensors = actor_tensors(checkpoint)
    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "tie_word_embeddings", False) or getattr(config.get_text_config(), "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the same tensor as the embedding; from_pretrained re-ties it
    if dtype == "auto":  # the source model's dtype, else the checkpoint's
        src = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = str(src).replace("torch.", "") if src else str(next(iter(tensors.values())).properties.dtype).replace("torch.", "")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    is_lora = any(lora.is_adapter(n) for n in tensors)
    if adapter_out and not is_lora:
        raise ExportError(f"--adapter-out: checkpoint {checkpoint!r} holds no LoRA adapter (a full fine-tuning run)")
    for d in (out, adapter_out):
        if d and os.path.exists(d) and os.listdir(d):
            raise ExportError(f"{d!r} exists and is not empty: choose a new directory")
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if is_lora:
        export_lora(checkpoint, tensors, model_dir, torch_dtype, tmp, adapter_out, shard_size_gb)
        return _finish(tmp, out)

    shards = plan_shards(tensors, torch_dtype, int(shard_size_gb * 2**30))
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    weight_map, total = {}, 0
    for names, fname in zip(shards, files):
        weights = {n: t.to(torch_dtype).contiguous() for name, full in read_tensors(checkpoint, tensors, names).items()
                   for n, t in per_expert(name, full)}
        save_file(weights, os.path.join(tmp, fname), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in weights.values())
        weight_map.update(dict.fromkeys(weights, fname))
        log.info("wrote %s (%d tensors)", fname, len(names))
        del weights
    if len(files) > 1:
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    config.dtype = torch_dtype
    config.save_pretrained(tmp)
    save_generation_config_and_tokenizer(model_dir, config, tmp)
    return _finish(tmp, out)


def save_generation_config_and_tokenizer(model_dir: str, config, out: str) -> None:
    from transformers import AutoTokenizer, GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:  # no generation_config.json in the source: derive it as save_pretrained would
        gen = GenerationConfig.from_model_config(config)
    gen.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def _finish(tmp: str, out: str) -> str:
    if os.path.isdir(out):
        os.rmdir(out)
    os.replace(tmp, out)  # a crash mid-export leaves only OUT.tmp, never a half-written OUT
    return out


def export_lora(checkpoint: str, tensors: dict[str, TensorStorageMetadata], model_dir: str, dtype: torch.dtype,
                out: str, adapter_out: str | None, shard_size_gb: float) -> None:
    """The merged model of a LoRA checkpoint into `out` (and PEFT's adapter directory into `adapter_out`):
    the base from `model_dir` in float32, the run's adapter on it, merged by PEFT, cast to `dtype`."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    m = run_model_config(checkpoint)
    settings = lora.LoraSettings.of(m, torch.float32)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, lora.lora_config(settings, base))
    adapter = {f"base_model.model.{n}": t for n, t in read_tensors(checkpoint, tensors, list(tensors)).items()}
    result = model.load_state_dict(adapter, strict=False)
    missing = [k for k in result.missing_keys if lora.is_adapter(k)]
    if result.unexpected_keys or missing:
        raise ExportError(f"checkpoint {checkpoint!r} does not fit the run's LoRA settings (rank {m.lora_rank}, targets "
                          f"{list(m.lora_target_modules) or 'all-linear'}): {len(missing)} adapter tensors missing, "
                          f"unexpected {result.unexpected_keys[:3]}")
    if adapter_out:
        model.save_pretrained(adapter_out)
        log.info("wrote the PEFT adapter to %s", adapter_out)
    merged = model.merge_and_unload().to(dtype)
    merged.save_pretrained(out, max_shard_size=f"{int(shard_size_gb * 1024)}MB")
    save_generation_config_and_tokenizer(model_dir, merged.config, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spmd_rl.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="RUN/checkpoints/step_N")
    ap.add_argument("--out", required=True, help="new output directory")
    ap.add_argument("--dtype", default="auto", help="auto (the source model's), float32, bfloat16 or float16")
    ap.add_argument("--model-dir", default=None, help="source model directory (default: from the run's config.toml)")
    ap.add_argument("--shard-size-gb", type=float, default=5.0, help="largest safetensors shard")
    ap.add_argument("--adapter-out", default=None, help="a LoRA run's checkpoint: also write PEFT's adapter directory here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype, args.model_dir, args.shard_size_gb,
                                args.adapter_out)
    except (UserError, CheckpointError) as e:  # CheckpointError: one of a later version's format
        print(f"error: {e}", file=sys.stderr)
        return 2
    log.info("exported %s to %s", args.checkpoint, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
