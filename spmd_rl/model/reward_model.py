"""Scores of a Bradley-Terry reward model ([reward_model]) for a rank's responses.

    rm = RewardModel(model, tokenizer, device, micro_batch_size, max_tokens)
    scores = rm.score([conversation(prompt, response_text, messages), ...])   # collective

Each response is scored as a conversation: the prompt's chat messages as the data file has them (a
text prompt is one user message), then the response as one assistant message, or a multi-turn
trajectory's messages (the model's turns and the tool / environment messages between them). It is
rendered by the reward model's own tokenizer and chat template, which may differ from the
policy's; a tokenizer without a chat template gets the messages' contents joined by newlines.

The forward is transformers' own sequence classification: right-padded rows (padded with the
model's `pad_token_id`), the score read at each row's last non-pad token. Rows are sorted by length
and cut into forwards of `micro_batch_size` rows or, with a token budget, of at most `max_tokens`
padded tokens (batch.plan_micro_batches does not fit: it counts the real tokens of packed rows, and
its agreement between ranks assumes every rank holds rows). The model is FSDP-sharded, so every
rank must run as many forwards as the others: `score` is collective (also for a rank with nothing
to score, as in validation), and a rank that needs fewer forwards runs one-token ones.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from spmd_rl.errors import UserError
from spmd_rl.model.loading import reshard
from spmd_rl.runtime.distributed import all_reduce_max_int
from spmd_rl.runtime.transfer import to_device


class RewardModelError(UserError, ValueError):
    """The reward model cannot score a conversation (its chat template refuses it)."""


def conversation(prompt: str | list[dict] | None, response: str, messages: list[dict] | None = None) -> list[dict]:
    """The chat a response is scored as: the prompt's messages, then `messages` (a multi-turn
    trajectory's) or else the response as one assistant message."""
    head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt or [])
    return head + (list(messages) if messages else [{"role": "assistant", "content": response}])


def render(tokenizer, chat: list[dict]) -> list[int]:
    """Token ids of `chat` for the reward model: through its chat template, or (none) its contents
    joined by newlines, tokenized as a plain `tokenizer(text)` call does."""
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer("\n".join(str(m.get("content", "")) for m in chat))["input_ids"])
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template may refuse a role ("tool") or an order of roles
        raise RewardModelError(f"the reward model's chat template cannot render the conversation "
                               f"({type(e).__name__}: {' '.join(str(e).split())[:200]}; roles "
                               f"{[m.get('role') for m in chat]}): set reward_model.tokenizer to a tokenizer whose "
                               "template takes these roles") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def plan_forwards(lengths: list[int], rows: int, max_tokens: int = 0) -> list[list[int]]:
    """Row indices of each forward, longest rows first: `rows` rows each, or (max_tokens > 0) as
    many as keep rows x the longest row within `max_tokens` (at least one row)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens <= 0:
        return [order[i:i + rows] for i in range(0, len(order), rows)]
    plans: list[list[int]] = []
    for i in order:
        if plans and (len(plans[-1]) + 1) * lengths[plans[-1][0]] <= max_tokens:
            plans[-1].append(i)
        else:
            plans.append([i])
    return plans


def pad_right(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `sequences`, right-padded with `pad_id`."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def first_error(error: RewardModelError | None) -> RewardModelError | None:
    """The first rank's error, on every rank (collective); None where no rank has one."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return error
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, None if error is None else str(error))
    first = next((m for m in gathered if m is not None), None)
    return None if first is None else RewardModelError(first)


class RewardModel:
    """A loaded reward model (model.loading.load_reward_model, sharded) with its tokenizer."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device, micro_batch_size: int,
                 max_tokens: int = 0):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.micro_batch_size, self.max_tokens = micro_batch_size, max_tokens
        self.pad_id = int(model.config.get_text_config().pad_token_id)  # set by load_reward_model

    @torch.no_grad()
    def score(self, chats: list[list[dict]]) -> torch.Tensor:
        """[len(chats)] float32 scores on the CPU. Collective: every rank calls it, with its own chats."""
        sequences, error = self._render_all(chats)
        error = first_error(error)  # every rank stops with the message, not only the one whose chat failed
        if error is not None:
            raise error
        plans = plan_forwards([len(s) for s in sequences], self.micro_batch_size, self.max_tokens)
        forwards = all_reduce_max_int(len(plans))  # FSDP: every rank runs as many forwards
        done = []  # (rows, their scores on the device): read once at the end, not after every forward
        for k in range(forwards):
            rows = plans[k] if k < len(plans) else []
            ids, mask = pad_right([sequences[i] for i in rows] or [[self.pad_id]], self.pad_id)
            logits = self.model(input_ids=to_device(ids, self.device), attention_mask=to_device(mask, self.device),
                                use_cache=False).logits
            if rows:
                done.append((rows, logits[:, 0].float()))
        reshard(self.model)  # a no-grad forward leaves the root's parameters gathered
        out = torch.zeros(len(chats), dtype=torch.float32)
        for rows, values in done:
            out[rows] = values.cpu()
        return out

    def _render_all(self, chats: list[list[dict]]) -> tuple[list[list[int]], RewardModelError | None]:
        try:
            return [render(self.tokenizer, c) for c in chats], None
        except RewardModelError as e:
            return [], e
