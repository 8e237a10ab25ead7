"""Prompt datasets (Parquet, verl-compatible schema) and how ranks walk through them.

Schema (docs/data.md has the full description):
  prompt        required  string, or list of {role, content} chat messages
  data_source   required  string; selects the reward scorer (spmd_rl/data/rewards.py)
  ground_truth  string (or integer) column, or verl's struct column `reward_model.ground_truth`
  extra_info    optional  struct or JSON string; becomes a dict

`PromptDataset` validates and tokenizes everything once, at start, so bad data fails before any
model is loaded and prompts that are too long are dropped (and counted) instead of crashing a
later step. `ShardedSampler` and `iter_eval_batches` decide which rows each rank takes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from spmd_rl.errors import UserError


class DataError(UserError, ValueError):
    """A problem with the data files or the batch layout, naming the file/column and the fix."""


@dataclass
class PromptRecord:
    index: int
    """Row index in the concatenation of all files (before long prompts were dropped)."""
    prompt_ids: list[int]
    data_source: str
    ground_truth: str
    extra_info: dict = field(default_factory=dict)
    prompt: str | list[dict] | None = None
    """The prompt as the data file has it: text, or chat messages (without the null fields Arrow
    adds); what a multi-turn environment's `reset` gets."""


# --------------------------------------------------------------------------- reading


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_text_or_int(t: pa.DataType) -> bool:
    return _is_text(t) or pa.types.is_integer(t)


def _is_chat(t: pa.DataType) -> bool:
    """list<struct<role: string, content: string, ...>>, as verl writes chat prompts."""
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)):
        return False
    item = t.value_type
    if not pa.types.is_struct(item):
        return False
    names = {item.field(i).name: item.field(i).type for i in range(item.num_fields)}
    return all(k in names and _is_text(names[k]) for k in ("role", "content"))


def _read_table(path: str) -> pa.Table:
    if not os.path.isfile(path):
        raise DataError(f"data file {path!r} does not exist: fix data.train_files / data.val_files")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"data file {path!r} is not a readable Parquet file ({e}); "
                        "convert it with scripts/prepare_gsm8k.py or see docs/data.md") from None
    if table.num_rows == 0:
        raise DataError(f"data file {path!r} has no rows: remove it from the file list or regenerate it")
    return table


def _require(path: str, table: pa.Table, column: str, ok, expected: str) -> None:
    """Raise unless `column` exists and its type passes `ok`."""
    if column not in table.column_names:
        raise DataError(f"data file {path!r} has no column {column!r} (it has {table.column_names}); "
                        f"expected {expected} (schema: docs/data.md)")
    if not ok(table.schema.field(column).type):
        raise DataError(f"data file {path!r}: column {column!r} has type {table.schema.field(column).type}, "
                        f"expected {expected} (schema: docs/data.md)")


def _ground_truth_column(path: str, table: pa.Table) -> list[Any]:
    """`ground_truth`, else verl's `reward_model.ground_truth`; the top-level column wins."""
    if "ground_truth" in table.column_names:
        _require(path, table, "ground_truth", _is_text_or_int, "a string column")
        return table.column("ground_truth").to_pylist()
    if "reward_model" in table.column_names:
        t = table.schema.field("reward_model").type
        if not (pa.types.is_struct(t) and t.get_field_index("ground_truth") >= 0
                and _is_text_or_int(t.field("ground_truth").type)):
            raise DataError(f"data file {path!r}: column 'reward_model' has type {t}, expected a struct "
                            "with a string field 'ground_truth' (verl's layout), or add a top-level "
                            "string column 'ground_truth'")
        return [None if r is None else r.get("ground_truth") for r in table.column("reward_model").to_pylist()]
    raise DataError(f"data file {path!r} has no ground truth: add a string column 'ground_truth' or "
                    "verl's struct column 'reward_model' with field 'ground_truth' (schema: docs/data.md)")


def _extra_info_column(path: str, table: pa.Table) -> list[dict]:
    """`extra_info` rows as dicts ({} where the column or the value is missing)."""
    if "extra_info" not in table.column_names:
        return [{} for _ in range(table.num_rows)]
    t = table.schema.field("extra_info").type
    values = table.column("extra_info").to_pylist()
    if pa.types.is_struct(t):
        return [v or {} for v in values]
    if pa.types.is_map(t):
        return [dict(v) if v else {} for v in values]
    if not _is_text(t):
        raise DataError(f"data file {path!r}: column 'extra_info' has type {t}, expected a struct or a "
                        "JSON object string")
    out = []
    for row, v in enumerate(values):
        try:
            parsed = json.loads(v) if v else {}
        except json.JSONDecodeError as e:
            raise DataError(f"data file {path!r}: extra_info of row {row} is not valid JSON ({e})") from None
        if not isinstance(parsed, dict):
            raise DataError(f"data file {path!r}: extra_info of row {row} must be a JSON object, got {v!r}")
        out.append(parsed)
    return out


def _no_nulls(path: str, column: str, values: list[Any]) -> None:
    for row, v in enumerate(values):
        if v is None:
            raise DataError(f"data file {path!r}: column {column!r} is empty (null) in row {row}; "
                            "every row needs a value")


def read_rows(path: str) -> list[dict[str, Any]]:
    """Validated rows of one file: prompt (str or list of messages), data_source, ground_truth, extra_info."""
    table = _read_table(path)
    _require(path, table, "prompt", lambda t: _is_text(t) or _is_chat(t),
             "a string or a list of {role: string, content: string} chat messages")
    _require(path, table, "data_source", _is_text, "a string (e.g. 'openai/gsm8k')")
    prompts = table.column("prompt").to_pylist()
    sources = table.column("data_source").to_pylist()
    truths = _ground_truth_column(path, table)
    for column, values in (("prompt", prompts), ("data_source", sources), ("ground_truth", truths)):
        _no_nulls(path, column, values)
    infos = _extra_info_column(path, table)
    return [dict(prompt=p, data_source=s, ground_truth=str(g), extra_info=e)
            for p, s, g, e in zip(prompts, sources, truths, infos)]


# --------------------------------------------------------------------------- tokenizing


def _clean_messages(messages: list[dict]) -> list[dict]:
    """Drop the null fields Arrow adds when files disagree on message keys."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def tokenize_prompt(tokenizer, prompt: str | list[dict], apply_chat_template: bool,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of one prompt: chat messages through the chat template (with the generation
    prompt, and the `tools` schemas of a multi-turn run) when `apply_chat_template`, else their
    contents joined by newlines; text as it is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    messages = _clean_messages(prompt)
    if not apply_chat_template:
        return list(tokenizer("\n".join(m.get("content", "") for m in messages))["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the data has chat-message prompts but the tokenizer has no chat template: set "
                        "data.apply_chat_template = false, or use a tokenizer with a chat template")
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    return list(ids)


class PromptDataset:
    """All prompts of `files`, tokenized once; prompts over `max_prompt_length` tokens are dropped.

    `num_dropped` counts the dropped prompts (the trainer logs it); `records[i].index` is still the
    row's position in the concatenated files.
    """

    def __init__(self, files: list[str], tokenizer, max_prompt_length: int, apply_chat_template: bool,
                 tools: list[dict] | None = None):
        if not files:
            raise DataError("no data files given: list at least one Parquet file in data.train_files")
        self.files = list(files)
        self.max_prompt_length = max_prompt_length
        self.records: list[PromptRecord] = []
        self.num_dropped = 0
        longest_dropped = 0
        index = 0
        for path in self.files:
            for row, r in enumerate(read_rows(path)):
                prompt = r["prompt"] if isinstance(r["prompt"], str) else _clean_messages(r["prompt"])
                ids = tokenize_prompt(tokenizer, prompt, apply_chat_template, tools)
                if not ids:
                    raise DataError(f"data file {path!r}: the prompt of row {row} is empty; remove that row")
                if len(ids) > max_prompt_length:
                    self.num_dropped += 1
                    longest_dropped = max(longest_dropped, len(ids))
                else:
                    self.records.append(PromptRecord(index, ids, r["data_source"], r["ground_truth"], r["extra_info"],
                                                     prompt))
                index += 1
        if not self.records:
            raise DataError(f"all {index} prompts in {self.files} are longer than data.max_prompt_length = "
                            f"{max_prompt_length} tokens and were dropped: raise data.max_prompt_length "
                            f"(the longest prompt has {longest_dropped} tokens)")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> PromptRecord:
        return self.records[i]


# --------------------------------------------------------------------------- sampling


class ShardedSampler:
    """Which dataset positions each rank trains on, step after step, across epochs.

    Every epoch is a permutation of the dataset (torch.Generator seeded with seed + epoch, or the
    identity with shuffle off) cut into global batches of `global_batch_size`; the incomplete last
    batch is dropped so every step has the same size. Rank r takes the r-th contiguous slice of
    each global batch. The sequence depends only on (num_items, global_batch_size, seed, shuffle),
    so a run resumed from `state_dict()` continues with exactly the same indices, even on another
    number of ranks.
    """

    def __init__(self, num_items: int, global_batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True):
        if global_batch_size <= 0 or global_batch_size % world_size:
            raise DataError(f"data.train_batch_size = {global_batch_size} must be a positive multiple of "
                            f"the {world_size} ranks")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside the world of {world_size} ranks")
        if num_items < global_batch_size:
            raise DataError(f"the training data has {num_items} prompts (after dropping long ones), fewer "
                            f"than one batch of data.train_batch_size = {global_batch_size}: lower "
                            "data.train_batch_size or add data")
        self.num_items = num_items
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order: list[int] | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Global batches in one epoch."""
        return self.num_items // self.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch comes from (0-based)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Global batches already consumed in the current epoch."""
        return self._position

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self._epoch)
                self._order = torch.randperm(self.num_items, generator=g).tolist()
            else:
                self._order = list(range(self.num_items))
        return self._order

    def next_batch(self) -> list[int]:
        """This rank's dataset positions for the next step; the epoch rolls over after its last batch."""
        per_rank = self.global_batch_size // self.world_size
        start = self._position * self.global_batch_size + self.rank * per_rank
        batch = self._epoch_order()[start:start + per_rank]
        self._position += 1
        if self._position == self.steps_per_epoch:
            self._epoch, self._position, self._order = self._epoch + 1, 0, None
        return batch

    def state_dict(self) -> dict[str, Any]:
        return dict(epoch=self._epoch, position=self._position, seed=self.seed, shuffle=self.shuffle,
                    num_items=self.num_items, global_batch_size=self.global_batch_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; refuses a state from a different data layout, whose
        indices would silently differ from the interrupted run."""
        for key in ("num_items", "global_batch_size", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise DataError(f"cannot resume the data order: the checkpoint has {key} = {state[key]!r} but "
                                f"this run has {getattr(self, key)!r}; use the same data files, "
                                "data.max_prompt_length, data.train_batch_size, trainer.seed and data.shuffle")
        if not 0 <= state["position"] < self.steps_per_epoch:
            raise DataError(f"corrupt sampler state: position {state['position']} is outside "
                            f"0..{self.steps_per_epoch - 1}")
        self._epoch, self._position, self._order = int(state["epoch"]), int(state["position"]), None


def iter_eval_batches(num_items: int, batch_size_global: int, rank: int, world_size: int) -> Iterator[list[int]]:
    """Validation positions for this rank: every item exactly once over all ranks, in order.

    Each global batch of `batch_size_global` consecutive items is split into `world_size`
    contiguous parts as evenly as possible, so in the last (short) batch, or when the batch is not
    a multiple of the ranks, ranks get different counts, possibly zero. Every rank still gets the
    same number of batches (ceil(num_items / batch_size_global)), which keeps collective calls in step.
    """
    if batch_size_global <= 0:
        raise DataError(f"data.val_batch_size = {batch_size_global} must be > 0")
    for start in range(0, num_items, batch_size_global):
        size = min(batch_size_global, num_items - start)
        base, extra = divmod(size, world_size)
        lo = start + rank * base + min(rank, extra)
        yield list(range(lo, lo + base + (1 if rank < extra else 0)))
