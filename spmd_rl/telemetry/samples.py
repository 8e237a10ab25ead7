"""What the model says: a few prompts with the responses the engine sampled for them, their rewards,
ground truths and, for a multi-turn trajectory, the whole conversation with roles.

Which samples (trainer.log_samples = k, trainer.log_samples_every): at a validation, the first k
prompts of the validation data (the same every time, so a reader sees the same prompts improve),
the first of each one's responses; at a training step, the step's first k prompts (rank 0's first
k: the sampler gives rank 0 the head of the global batch), the first of each one's responses.

Every rank runs the same calls (`begin_*`, `offer` from the scoring of each batch, `flush`, which
gathers the picked rows once: a few strings per rank); rank 0 writes them to
<run_dir>/samples.jsonl (one JSON object per sample), as TensorBoard text `samples/<split>` and to
the console, shortened. The texts are the decoded token ids of the batch: the prompt as the engine
got it (special tokens kept), the response as it was scored.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from spmd_rl.batching.batch import Batch
from spmd_rl.data.reward_model import conversation

log = logging.getLogger("spmd_rl")

CONSOLE_CHARS = 60
"""The console shows at most this many characters of a prompt (its end) and of each message."""


def sample_record(tokenizer, batch: Batch, row: int, text: str, prompt: Any, messages: list[dict] | None) -> dict:
    """One row of a scored batch: its prompt tokens decoded, the scored response text, its score and
    accuracy, and for a multi-turn trajectory the conversation (the data's prompt messages, then
    the trajectory's) with roles."""
    start = int(batch["prompt_lens"][row])
    record = {
        "index": batch.meta["index"][row],
        "data_source": batch.meta["data_source"][row],
        "prompt": tokenizer.decode(batch["input_ids"][row, :start].tolist(), skip_special_tokens=False),
        "response": text,
        "reward": float(batch["scores"][row]),
        "acc": float(batch["acc"][row]),
        "ground_truth": batch.meta["ground_truth"][row],
    }
    if messages is not None:
        record["messages"] = conversation(prompt, text, messages)
        record["prompt_messages"] = len(record["messages"]) - len(messages)  # the data's prompt, before the trajectory
    return record


class SampleLog:
    def __init__(self, run_dir: str, enabled: bool, count: int, every: int, tokenizer, metrics=None):
        self.path = os.path.join(run_dir, "samples.jsonl")
        self.enabled = enabled  # rank 0 writes
        self.count, self.every = count, every  # trainer.log_samples, trainer.log_samples_every
        self.tokenizer = tokenizer
        self.metrics = metrics  # telemetry.metrics.MetricsLogger: TensorBoard text
        self.split: str | None = None  # "val" / "train" while samples are being picked
        self.step = 0
        self.wanted: list | None = None  # validation: the data rows to pick, in order
        self.picked: list[dict] = []
        self.groups_seen = 0

    def begin_validation(self, step: int, val_data) -> None:
        """Pick the first `count` prompts of `val_data` (PromptRecords) from the batches scored until `flush`."""
        if self.count:
            self._begin("val", step, [val_data[i].index for i in range(min(self.count, len(val_data)))])

    def begin_step(self, step: int) -> None:
        """Pick the first `count` prompts of training step `step` on rank 0, if it is one that shows samples."""
        if self.count and self.every and step % self.every == 0:
            self._begin("train", step, None)

    def _begin(self, split: str, step: int, wanted: list | None) -> None:
        self.split, self.step, self.wanted, self.picked, self.groups_seen = split, step, wanted, [], 0

    def offer(self, batch: Batch, texts: list[str], prompts: list, messages: list) -> None:
        """The scored `batch` (its decoded responses `texts`, the data's prompts and the multi-turn
        messages per row): keep the rows that are picked (the rule: module docstring)."""
        if self.split is None:
            return
        for row in self._rows(batch):
            self.picked.append(sample_record(self.tokenizer, batch, row, texts[row], prompts[row], messages[row]))

    def _rows(self, batch: Batch) -> list[int]:
        firsts = [i for i in range(len(batch)) if i == 0 or batch["group_ids"][i] != batch["group_ids"][i - 1]]
        if self.wanted is not None:
            taken = {r["index"] for r in self.picked}
            return [i for i in firsts if batch.meta["index"][i] in self.wanted and batch.meta["index"][i] not in taken]
        if _rank() != 0:
            return []
        rows = firsts[:max(self.count - self.groups_seen, 0)]
        self.groups_seen += len(rows)
        return rows

    def flush(self) -> None:
        """Collective (every rank calls it): gather the picked samples and, on rank 0, write them."""
        if self.split is None:
            return
        picked = _gather(self.picked)
        if self.wanted is not None:
            picked.sort(key=lambda r: self.wanted.index(r["index"]))
        split, step = self.split, self.step
        self.split, self.picked = None, []
        if self.enabled and picked:
            self._write(split, step, picked)

    def _write(self, split: str, step: int, picked: list[dict]) -> None:
        with open(self.path, "a") as f:
            for r in picked:
                f.write(json.dumps({"step": step, "split": split, **r}, default=str) + "\n")
        if self.metrics is not None:
            self.metrics.log_markdown(f"samples/{split}", "\n\n".join(markdown(r) for r in picked), step)
        log.info("samples at step %d (%s; in full: %s):\n%s", step, split, self.path,
                 "\n".join(console_line(r) for r in picked))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _gather(items: list) -> list:
    """Every rank's `items`, concatenated in rank order."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return list(items)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]


def _short(text: str, keep_end: bool = False) -> str:
    if len(text) > CONSOLE_CHARS:
        text = "..." + text[-CONSOLE_CHARS:] if keep_end else text[:CONSOLE_CHARS] + "..."
    return repr(text)


def console_line(r: dict) -> str:
    """A sample in one line: the prompt's end, the response (multi-turn: each message after the
    prompt's, with its role), the reward and the ground truth."""
    if "messages" in r:
        after = r["messages"][r["prompt_messages"]:]
        said = " | ".join(f"{m['role']}: {_short(str(m.get('content', '')))}" for m in after)
    else:
        said = _short(r["response"])
    return (f"  [{r['index']}] {_short(r['prompt'], keep_end=True)} -> {said}  reward {r['reward']:.3f} "
            f"acc {r['acc']:g} (ground truth {_short(str(r['ground_truth']))})")


def markdown(r: dict) -> str:
    """A sample as TensorBoard's markdown: a heading line, then the prompt and the response (or
    each message) as indented code blocks."""
    head = (f"**{r['data_source']} row {r['index']}**: reward {r['reward']:.4g}, acc {r['acc']:g}, ground truth "
            f"`{r['ground_truth']}`")
    parts = [head, "prompt:", _code(r["prompt"])]
    if "messages" in r:
        for m in r["messages"]:
            parts += [f"{m.get('role')}:", _code(str(m.get("content", "")))]
    else:
        parts += ["response:", _code(r["response"])]
    return "\n\n".join(parts)


def _code(text: str) -> str:
    return "\n".join("    " + line for line in (text.splitlines() or [""]))
