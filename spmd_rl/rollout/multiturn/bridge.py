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
the rendering without them. It is refused with a clear error; use a template that keeps history
(TRL ships such "training" templates for Qwen3).
"""

from __future__ import annotations

from typing import Any

from spmd_rl.errors import ConfigError

SENTINEL = "SPMDRL_ASSISTANT_TURN"
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

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def truncate(self, message: dict[str, Any]) -> dict[str, Any]:
        """The message with its content cut to max_message_tokens tokens."""
        content = message.get("content")
        if not self.max_message_tokens or not isinstance(content, str):
            return message
        ids = self.tokenizer.encode(content, add_special_tokens=False)
        if len(ids) <= self.max_message_tokens:
            return message
        return {**message, "content": self.tokenizer.decode(ids[:self.max_message_tokens])}

    def tokens(self, messages: list[dict[str, Any]], last_token: int | None) -> list[int]:
        """Token ids that follow a model turn ending in `last_token` (its sampled stop token, or None):
        `messages` rendered, then the generation prompt of the next assistant turn."""
        full = self._render(BASE + [self.truncate(m) for m in messages], add_generation_prompt=True)
        if not full.startswith(self.head):
            raise TemplateError(
                "the chat template rewrites the conversation when messages are added after an assistant turn "
                f"(rendered without them: ...{self.head[-80:]!r}; with them: ...{full[:len(self.head)][-80:]!r}), so "
                "the sampled tokens would not be the trained ones: use a chat template that keeps earlier turns "
                "unchanged (e.g. a *_training.jinja template)")
        tail = full[len(self.head):]
        stop = self._text(last_token)
        if stop and tail.startswith(stop):  # the template's end-of-turn is the model's sampled token
            tail = tail[len(stop):]
        return list(self.tokenizer.encode(tail, add_special_tokens=False))

    def _text(self, token: int | None) -> str:
        if token is None:
            return ""
        if token not in self._stop_text:
            self._stop_text[token] = self.tokenizer.decode([token]) if 0 <= token < len(self.tokenizer) else ""
        return self._stop_text[token]
