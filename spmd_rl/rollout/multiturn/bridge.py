"""The bridge: tokens between two model turns (tool or environment messages, then the next
generation prompt), tokenized with the model's chat template.

Token in, token out: the model's sampled tokens are never decoded and re-encoded (that shifts
rollout log-probs away from the actor's). Only the bridge is tokenized, by rendering a fixed base
conversation (a user message, an assistant message) with and without the new messages and taking
the text that the new messages add after the assistant's content. The template's end-of-turn text
(Qwen's `<|im_end|>`) is the model's sampled stop token when they are the same text: that token is
trained, and only the glue after it (`\\n<|im_start|>tool...<|im_start|>assistant\\n`) is bridge.

A template that rewrites earlier turns when messages are added (Qwen3 drops `<think>` blocks from
earlier assistant turns) breaks this: the rendering with the new messages no longer starts with
the rendering without them. It is refused with a clear error naming rollout.chat_template and the
template shipped for Qwen3 that keeps history (templates/qwen3_keep_thinking.jinja; TRL ships such
"training" templates too).

Tool and environment text is text: a special or added token's text inside a message's content
(`<|im_end|>`, `</tool_response>` in a tool's answer) is tokenized as plain characters, never as
that token, so a message cannot fake the turn structure. Only the template's own text gives
control tokens: each such occurrence is swapped for a marker before rendering, and the marker's
place in the rendered text gets the occurrence's plain-text tokens.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from spmd_rl.errors import ConfigError

SENTINEL = "SPMDRL_ASSISTANT_TURN"
SHIPPED_QWEN3 = "spmd_rl/rollout/multiturn/templates/qwen3_keep_thinking.jinja"
BASE = [{"role": "user", "content": "SPMDRL_USER_TURN"}, {"role": "assistant", "content": SENTINEL}]


class TemplateError(ConfigError):
    """The chat template cannot append messages without rewriting what came before."""


class Bridge:
    def __init__(self, tokenizer, tools: list[dict] | None, max_message_tokens: int):
        """`tools`: the tools' JSON schemas for the template (None: no tools); `max_message_tokens`:
        each message's content is cut to this many tokens (0 = no limit)."""
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("multi-turn rollouts (rollout.tools / rollout.environment) need a tokenizer with a "
                              "chat template to render tool and environment messages")
        self.tokenizer, self.tools, self.max_message_tokens = tokenizer, tools, max_message_tokens
        base = self._render(BASE, add_generation_prompt=False)
        end = base.rfind(SENTINEL)
        if end < 0:
            raise TemplateError("the chat template does not render an assistant message's content")
        self.head = base[:end + len(SENTINEL)]
        # the end-of-turn text of each token that can end a turn, to leave to the model's own token
        self._stop_text: dict[int, str] = {}
        self._added = _added_token_pattern(tokenizer)
        self._marker_prefix = f"SPMDRL{uuid.uuid4().hex[:12]}T"  # no message can guess it
        self._marker = re.compile(self._marker_prefix + r"(\d+)E")

    def special_text(self, messages: list[dict[str, Any]]) -> list[str]:
        """The special and added tokens' texts in the messages' contents (tokenized as plain text)."""
        if self._added is None:
            return []
        return [m.group(0) for msg in messages if isinstance(msg.get("content"), str)
                for m in self._added.finditer(msg["content"])]

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def truncate(self, message: dict[str, Any]) -> dict[str, Any]:
        """The message with its content cut to max_message_tokens tokens."""
        content = message.get("content")
        if not self.max_message_tokens or not isinstance(content, str):
            return message
        ids = self._text_ids(content)
        if len(ids) <= self.max_message_tokens:
            return message
        return {**message, "content": self.tokenizer.decode(ids[:self.max_message_tokens])}

    def tokens(self, messages: list[dict[str, Any]], last_token: int | None) -> list[int]:
        """Token ids that follow a model turn ending in `last_token` (its sampled stop token, or None):
        `messages` rendered, then the generation prompt of the next assistant turn."""
        texts: list[str] = []
        full = self._render(BASE + [self._hide_added(self.truncate(m), texts) for m in messages],
                            add_generation_prompt=True)
        if not full.startswith(self.head):
            raise TemplateError(
                "the chat template rewrites the conversation when messages are added after an assistant turn "
                f"(rendered without them: ...{self.head[-80:]!r}; with them: ...{full[:len(self.head)][-80:]!r}), so "
                "the sampled tokens would not be the trained ones: set rollout.chat_template to a template that keeps "
                "earlier turns unchanged; for Qwen3 rollout.chat_template = \"qwen3_keep_thinking\" "
                f"({SHIPPED_QWEN3}, which keeps <think> blocks)")
        tail = full[len(self.head):]
        stop = self._text(last_token)
        if stop and tail.startswith(stop):  # the template's end-of-turn is the model's sampled token
            tail = tail[len(stop):]
        return self._encode_with_markers(tail, texts)

    def _hide_added(self, message: dict[str, Any], texts: list[str]) -> dict[str, Any]:
        """The message with each added token's text in its content swapped for a marker (appended to `texts`)."""
        content = message.get("content")
        if self._added is None or not isinstance(content, str):
            return message

        def marker(m: re.Match) -> str:
            texts.append(m.group(0))
            return f"{self._marker_prefix}{len(texts) - 1}E"

        return {**message, "content": self._added.sub(marker, content)}

    def _encode_with_markers(self, text: str, texts: list[str]) -> list[int]:
        """Token ids of rendered `text`: the template's text as the tokenizer reads it, each marker as
        the plain-text tokens of the text it stands for."""
        ids: list[int] = []
        for i, part in enumerate(self._marker.split(text)):  # odd parts: a marker's number
            ids += self._text_ids(texts[int(part)]) if i % 2 else self._encode(part)
        return ids

    def _text_ids(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: an added token's text in it is split after its first
        character, so the tokenizer cannot match the token whole."""
        if self._added is None:
            return self._encode(text)
        ids: list[int] = []
        for i, part in enumerate(self._added.split(text)):  # odd parts: an added token's text
            ids += self._encode(part[:1]) + self._text_ids(part[1:]) if i % 2 else self._encode(part)
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _text(self, token: int | None) -> str:
        if token is None:
            return ""
        if token not in self._stop_text:
            self._stop_text[token] = self.tokenizer.decode([token]) if 0 <= token < len(self.tokenizer) else ""
        return self._stop_text[token]


def _added_token_pattern(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of any special or added token (longest first), None if none."""
    texts = set(getattr(tokenizer, "all_special_tokens", [])) | set(tokenizer.get_added_vocab()
                                                                     if hasattr(tokenizer, "get_added_vocab") else ())
    texts = sorted((t for t in texts if t), key=len, reverse=True)
    return re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None
