"""Tokenizers: the built-in character tokenizer and loading of Hugging Face ones.

The character tokenizer exists so the synthetic tasks run offline on a tiny random model
(`model.arch = "tiny"`, vocab_size 64): one token per character, no files, and a chat template
so chat-message prompts work exactly as with a real model.
"""

from __future__ import annotations

import importlib.resources
import os
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from spmd_rl.errors import ConfigError
from spmd_rl.model.files import ModelFilesError, check_tokenizer_dir, loading

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"

# 64 ids in all (the tiny preset's vocab_size). Digits + both full alphabets + specials already
# exceed 64, so only the capitals that start the synthetic word problems' sentences and names are
# kept; every other character (including the remaining capitals) becomes <unk>.
SPECIAL_TOKENS = (PAD, EOS, UNK)
DIGITS = "0123456789"
LOWERCASE = "abcdefghijklmnopqrstuvwxyz"
UPPERCASE = "AHSTW"
PUNCTUATION = " \n.,?!:;=+-*/#()'\"$%"
CHARACTERS = DIGITS + LOWERCASE + UPPERCASE + PUNCTUATION
MAX_VOCAB = 64

# "=" marks where the assistant speaks: a successor prompt "384=" is the chat
# [{"role": "user", "content": "384"}] rendered with add_generation_prompt. A tool message (multi-turn
# rollouts) is its content, and the model goes on right after it, without "=": the tool's last
# character is then the current token of the model's next prediction, which a tiny model can use
# without learning attention first ("ab=?\n7" -> "7": the hidden-digit task, spmd_rl/envs/hidden_digit.py).
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ '=' + message['content'] + '\n' }}"
    "{%- elif message['role'] == 'system' -%}{{ message['content'] + '\n' }}"
    "{%- else -%}{{ message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt and messages[-1]['role'] != 'tool' -%}{{ '=' }}{%- endif -%}"
)


def char_vocab() -> dict[str, int]:
    """Token -> id of the character tokenizer: <pad>=0, <eos>=1, <unk>=2, then the characters."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    assert len(tokens) == len(set(tokens)) <= MAX_VOCAB, "character vocabulary must fit the tiny model"
    return {tok: i for i, tok in enumerate(tokens)}


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The character-level tokenizer (one id per character), built in memory."""
    backend = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token=UNK))
    # Every character, whitespace included, is its own pre-token, so WordLevel sees single chars.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Without a decoder tokenizers joins tokens with spaces; Fuse concatenates them as written.
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        chat_template=CHAR_CHAT_TEMPLATE,
        # The default clean-up would turn "a ." into "a." and break the round trip.
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )


def chat_template_file(value: str) -> str:
    """The Jinja file `rollout.chat_template` names: a template shipped in
    spmd_rl/rollout/multiturn/templates/ by its name ("qwen3_keep_thinking"), or a path."""
    if value and "/" not in value and os.sep not in value and not value.endswith(".jinja"):
        return str(importlib.resources.files("spmd_rl.rollout.multiturn") / "templates" / f"{value}.jinja")
    return value


def read_chat_template(value: str) -> str:
    """The text of the chat template `rollout.chat_template` names; one-line ConfigError if it cannot be read."""
    path = chat_template_file(value)
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"rollout.chat_template = {value!r}: cannot read {path!r} ({e.strerror}); give a Jinja "
                          "file's path, a shipped template's name (qwen3_keep_thinking), or \"\" for the "
                          "tokenizer's own") from None


def load_tokenizer(spec: str, model_path: str, chat_template: str = ""):
    """The tokenizer named by `model.tokenizer` ("char", "" = `model_path`, or a directory), with
    the chat template `chat_template` names (rollout.chat_template; "" = its own).

    A tokenizer without a pad token gets its EOS token as pad (decoder-only models rarely define
    one, and batching needs it).
    """
    tokenizer = _load_tokenizer(spec, model_path)
    if chat_template:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def _load_tokenizer(spec: str, model_path: str):
    if spec == "char":
        return build_char_tokenizer()
    source = spec or model_path
    key = "model.tokenizer" if spec else "model.path"
    check_tokenizer_dir(source, key)
    with loading(source, key, "the tokenizer", tokenizer=True):
        tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelFilesError(f"the tokenizer in {source!r} has neither a pad nor an EOS token: "
                                  "add one to its tokenizer_config.json")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def decode_response(tokenizer, ids: Iterable[int]) -> str:
    """Text of generated ids, without special tokens and ids the tokenizer does not know.

    A model's embedding table is often larger than the tokenizer (padded vocab, or a random model),
    so sampled ids >= len(tokenizer) are possible; they carry no text and are dropped.
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    size = len(tokenizer)
    known = [int(i) for i in ids if 0 <= int(i) < size]
    return tokenizer.decode(known, skip_special_tokens=True)


def stop_token_ids(tokenizer, texts: Iterable[str]) -> list[int]:
    """The id of each text that is one token of `tokenizer` (for rollout.stop_token_ids); a text
    that is not one token is refused with what it is."""
    ids = []
    for text in texts:
        got = tokenizer.encode(text, add_special_tokens=False)
        if len(got) != 1:
            raise ConfigError(f"{text!r} is {len(got)} tokens {got} of this tokenizer, not one: a stop token is "
                              "one token (or stop on each of its tokens)")
        ids.append(got[0])
    return ids


def main(argv: list[str] | None = None) -> int:
    """`python -m spmd_rl.model.tokenizer TOKENIZER TEXT...`: the rollout.stop_token_ids override that
    stops at each TEXT (TOKENIZER: "char" or a tokenizer directory)."""
    import sys

    from spmd_rl.errors import UserError, report

    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print("usage: python -m spmd_rl.model.tokenizer TOKENIZER TEXT... (TOKENIZER: char or a directory)",
              file=sys.stderr)
        return 2
    try:
        ids = stop_token_ids(_load_tokenizer(args[0], ""), args[1:])
    except UserError as e:
        return report(e)
    print(f"rollout.stop_token_ids=[{','.join(map(str, ids))}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
