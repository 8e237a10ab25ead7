"""The model directories a user names (`model.path`, `critic.path`, `model.tokenizer`,
`reward_model.path`): checked
before any model loads, and their load failures reported as one line.

`from_pretrained` on a broken directory fails late (after the process group, on every rank, with
a long traceback), or not at all: a directory without tokenizer files loads as an empty tokenizer
that turns every prompt into nothing. `check_model_dir` and `check_tokenizer_dir` (called by config validation) read
only small files -- config.json, the weight index, each safetensors header -- so a missing
directory, an unreadable config, an unknown `model_type`, missing or truncated weight files and
missing tokenizer files are named in a second. What only a full load can find goes through
`loading`, which turns errors about the files (never programming errors) into a `ModelFilesError`
naming the directory and the fix. `check_vocab` refuses a tokenizer with more tokens than the
model's embedding has rows, which would otherwise end in a device-side assert mid-run.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Iterator

from safetensors import SafetensorError

from spmd_rl.errors import UserError

WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
"""What `from_pretrained` looks for in a local directory, in its order."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library refuses larger headers as corrupt

# Exceptions that, raised by from_pretrained on a user's directory, are about its files: missing
# or unreadable (OSError), invalid JSON or config values (ValueError, JSONDecodeError included;
# huggingface_hub's strict config validation), a JSON file missing a key (KeyError), a corrupt
# safetensors file.
FILE_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, KeyError, SafetensorError)
try:
    from huggingface_hub.errors import StrictDataclassError

    FILE_ERRORS += (StrictDataclassError,)
except ImportError:  # huggingface_hub < 0.35 validates no config fields
    pass
SHAPE_MISMATCH = ("mismatched_sizes", "size mismatch")
"""In a RuntimeError of from_pretrained (transformers 5 / torch's load_state_dict): config.json
describes other shapes than the weights hold."""


class ModelFilesError(UserError, ValueError):
    """A model or tokenizer directory named in the config is missing, incomplete or unreadable."""


def _where(key: str, path: str) -> str:
    return f"{key} = {path!r}" if key else f"the model directory {path!r}"


# --------------------------------------------------------------------------- before loading


def check_model_dir(path: str, key: str, weights: bool = True) -> None:
    """`path` is a directory with a readable config.json of a model type transformers knows and,
    with `weights`, complete weight files."""
    _check_is_dir(path, key, "a local Hugging Face model directory (config.json, weights, tokenizer)")
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ModelFilesError(f"{_where(key, path)} has no config.json: point it at a Hugging Face model directory")
    config = _read_json(config_file, key, path)
    _check_model_type(config, key, path)
    if weights:
        for name in _weight_files(path, key):
            if name.endswith(".safetensors"):
                problem = safetensors_problem(os.path.join(path, name))
                if problem:
                    raise ModelFilesError(f"{_where(key, path)}: {name} {problem}: copy the model's files again "
                                          "(an interrupted download or copy leaves a file short)")


def check_reward_model_dir(path: str, key: str) -> None:
    """`path` is a complete model directory (check_model_dir) of a Bradley-Terry reward model: a
    sequence classifier (config.json's `architectures`) with one label (`num_labels`, else as many as
    `id2label` has, else transformers' default of 2)."""
    check_model_dir(path, key, weights=True)
    config = _read_json(os.path.join(path, "config.json"), key, path)
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ModelFilesError(f"{_where(key, path)} is not a reward model: config.json's architectures are "
                              f"{architectures or 'not given'}, not a *ForSequenceClassification (a model with a "
                              "score head); point it at a sequence-classification model saved with its head")
    labels = config.get("num_labels", len(config.get("id2label") or {}) or 2)
    if labels != 1:
        raise ModelFilesError(f"{_where(key, path)} has num_labels = {labels}: a reward model gives one score per "
                              "sequence (num_labels = 1, a Bradley-Terry model)")


def check_tokenizer_dir(path: str, key: str, tokenizer_key: str = "model.tokenizer") -> None:
    """`path` is a directory with tokenizer files. `tokenizer_key`: the key that can name another."""
    _check_is_dir(path, key, "a tokenizer or model directory" +
                  (' (or set model.tokenizer = "char")' if tokenizer_key == "model.tokenizer" else ""))
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ModelFilesError(f"{_where(key, path)} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
                              f"copy them from the model it was trained from, or set {tokenizer_key} to a "
                              "directory that has them")


def _check_is_dir(path: str, key: str, expected: str) -> None:
    if not os.path.exists(path):
        raise ModelFilesError(f"{_where(key, path)} does not exist: point it at {expected}")
    if not os.path.isdir(path):
        raise ModelFilesError(f"{_where(key, path)} is a file, not a directory: point it at {expected}")


def _read_json(file: str, key: str, path: str) -> dict:
    name = os.path.relpath(file, path)
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelFilesError(f"{_where(key, path)}: {name} is not readable JSON ({e}): restore it from the "
                              "original model") from None
    if not isinstance(data, dict):
        raise ModelFilesError(f"{_where(key, path)}: {name} holds a {type(data).__name__}, not a JSON object: "
                              "restore it from the original model")
    return data


def _check_model_type(config: dict, key: str, path: str) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = config.get("model_type")
    if not model_type:
        raise ModelFilesError(f"{_where(key, path)}: config.json has no model_type: restore it from the original "
                              "model (e.g. \"qwen2\")")
    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelFilesError(f"{_where(key, path)}: config.json has model_type {model_type!r}, which transformers "
                              f"{transformers.__version__} does not know: fix model_type, or install a transformers "
                              "version that supports this model")


def _weight_files(path: str, key: str) -> list[str]:
    """The weight files `from_pretrained` will read (an index's shards, or the single file)."""
    found = next((f for f in WEIGHT_FILES if os.path.isfile(os.path.join(path, f))), None)
    if found is None:
        raise ModelFilesError(f"{_where(key, path)} has no weights (none of {', '.join(WEIGHT_FILES)}): copy the "
                              "model's weight files into it" + (', or set model.init = "random" to start from random '
                                                                "weights" if key == "model.path" else ""))
    if not found.endswith(".index.json"):
        return [found]
    weight_map = _read_json(os.path.join(path, found), key, path).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFilesError(f"{_where(key, path)}: {found} has no weight_map: restore it from the original model")
    shards = sorted(set(map(str, weight_map.values())))
    for shard in shards:
        if not os.path.isfile(os.path.join(path, shard)):
            raise ModelFilesError(f"{_where(key, path)}: {found} lists {shard}, which is missing: copy the model's "
                                  "files again")
    return shards


def safetensors_problem(file: str) -> str | None:
    """None if the safetensors `file` is as long as its header says, else what is wrong (a phrase).

    The format is an 8-byte little-endian header length, a JSON header giving each tensor's byte
    range, then the data: reading the header tells whether the file is complete without reading
    any weights."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes)"
        n = int.from_bytes(head, "little")
        if n > min(size - 8, SAFETENSORS_MAX_HEADER):
            return f"is truncated or corrupt (its header claims {n} bytes, the file has {size})"
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for name, t in header.items() if name != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "has a corrupt header"
    if 8 + n + end > size:
        return f"is truncated ({size} of {8 + n + end} bytes)"
    return None


# --------------------------------------------------------------------------- loading


def _is_file_error(e: Exception, tokenizer: bool) -> bool:
    if isinstance(e, FILE_ERRORS) or _is_shape_mismatch(e):
        return True
    # The tokenizers library reports a malformed tokenizer.json as TypeError or as a bare Exception.
    return tokenizer and (isinstance(e, TypeError) or type(e) is Exception)


@contextlib.contextmanager
def loading(path: str, key: str = "", what: str = "the model", tokenizer: bool = False) -> Iterator[None]:
    """Around a `from_pretrained` of `path`: an error about its files becomes one ModelFilesError
    naming `key` (the config key that named the directory; "" = one the run wrote itself).
    Anything else (a programming error, out of memory) propagates as it is."""
    try:
        yield
    except Exception as e:
        if not _is_file_error(e, tokenizer):
            raise
        raise _load_error(e, path, key, what) from None


def _is_shape_mismatch(e: Exception) -> bool:
    return isinstance(e, RuntimeError) and any(s in str(e) for s in SHAPE_MISMATCH)


def _load_error(e: Exception, path: str, key: str, what: str) -> ModelFilesError:
    if _is_shape_mismatch(e):
        return ModelFilesError(f"{_where(key, path)}: loading {what} failed: its config.json describes other tensor "
                               "shapes than its weights hold (transformers logged which ones above); use the "
                               "config.json that came with the weights")
    detail = " ".join(str(e).split())
    if len(detail) > 300:
        detail = detail[:300] + "..."
    return ModelFilesError(f"{_where(key, path)}: loading {what} failed ({type(e).__name__}: {detail}); make it a "
                           "complete Hugging Face model directory (copy or download it again)")


def check_no_missing_weights(info: dict, path: str, key: str = "", what: str = "the model",
                             new: tuple[str, ...] = ()) -> None:
    """After `from_pretrained(..., output_loading_info=True)`: every tensor came from the files.
    transformers initialises the ones it does not find randomly and only logs it, so weights of
    another architecture (other tensor names) would train a random model. `new`: prefixes of the
    tensors that are new by design (the critic's value head)."""
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(new))
    if missing:
        raise ModelFilesError(f"{_where(key, path)}: its weights lack {len(missing)} of {what}'s tensors (e.g. "
                              f"{missing[0]!r}), which would start random: the weights belong to another "
                              "architecture than its config.json describes; use the config.json that came with them")


def model_vocab_size(path: str, key: str) -> int:
    """The vocab_size in the config.json of the model directory `path` (its text model's, for a
    multimodal config)."""
    from transformers import AutoConfig

    with loading(path, key, "its config.json"):
        config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def model_text_config(path: str, key: str) -> dict:
    """The entries of the config.json in the model directory `path` (its text model's, for a
    multimodal config), with transformers' defaults filled in (e.g. tie_word_embeddings)."""
    from transformers import AutoConfig

    with loading(path, key, "its config.json"):
        config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"model_type": getattr(config, "model_type", ""), **text.to_dict()}


def model_attention_heads(path: str, key: str) -> tuple[int, int]:
    """(attention heads, KV heads) in the config.json of the model directory `path` (its text
    model's, for a multimodal config)."""
    from transformers import AutoConfig

    with loading(path, key, "its config.json"):
        config = AutoConfig.from_pretrained(path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    return heads, int(getattr(text, "num_key_value_heads", None) or heads)


def check_vocab(tokenizer_size: int, tokenizer_source: str, vocab_size: int, model_source: str) -> None:
    """Refuse a tokenizer whose ids reach past the model's embedding. A smaller tokenizer is
    normal: models pad their vocabulary (Qwen2.5: 151,665 tokens, vocab_size 151,936)."""
    if tokenizer_size > vocab_size:
        raise ModelFilesError(
            f"the tokenizer ({tokenizer_source}) has {tokenizer_size} tokens but the model ({model_source}) has "
            f"vocab_size {vocab_size}: token ids {vocab_size}..{tokenizer_size - 1} would index past its embedding; "
            "use the tokenizer that belongs to the model (model.tokenizer = \"\" takes model.path's), or a model "
            f"with a vocab_size of at least {tokenizer_size}")
