"""Samples (spmd_rl/telemetry/samples.py): which rows are shown, and that what is shown is the batch's
own token ids decoded: in samples.jsonl, TensorBoard text and the console."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch

from spmd_rl.batching.batch import build_rollout_batch
from spmd_rl.model.tokenizer import build_char_tokenizer
from spmd_rl.rollout.base import Completion
from spmd_rl.telemetry.metrics import MetricsLogger
from spmd_rl.telemetry.samples import SampleLog


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def scored_batch(tok, prompts, responses, indices, messages=None):
    """A batch as the trainer's score() leaves it: one group per prompt, its responses' ids as given."""
    ids = [tok.encode(p) for p in prompts]
    comps = [[Completion(r, None, "stop", None, None, None if messages is None else messages[g][j])
              for j, r in enumerate(group)] for g, group in enumerate(responses)]
    meta = {"data_source": ["synthetic/successor"] * len(prompts), "ground_truth": [str(i % 10) for i in indices],
            "extra_info": [{}] * len(prompts), "index": list(indices)}
    batch = build_rollout_batch(ids, comps, tok.pad_token_id, meta)
    rows = len(batch)
    batch["scores"] = torch.arange(rows, dtype=torch.float32) / 10
    batch["acc"] = (torch.arange(rows) % 2).float()
    msgs = batch.meta.pop("messages", [None] * rows)
    texts = [tok.decode(batch["input_ids"][i, int(batch["prompt_lens"][i]):].tolist(), skip_special_tokens=True)
             for i in range(rows)]
    return batch, texts, msgs


def read(path):
    return [json.loads(line) for line in open(path)]


def test_validation_shows_the_first_prompts_first_response_decoded_from_the_batch(tmp_path, tok, caplog):
    metrics = MetricsLogger(str(tmp_path), True, tensorboard=True)
    log = SampleLog(str(tmp_path), True, 2, 0, tok, metrics)
    val_data = [SimpleNamespace(index=i) for i in (5, 7, 9, 11)]  # rows 5 and 7 are the first two
    eos = tok.eos_token_id
    rng = torch.Generator().manual_seed(0)
    resp = lambda: torch.randint(3, 40, (3,), generator=rng).tolist() + [eos]  # noqa: E731
    # two eval batches; the second holds row 5, shown after row 7 was seen
    b1, t1, m1 = scored_batch(tok, ["a1", "b22", "c3"], [[resp(), resp()]] * 3, [9, 7, 11])
    b2, t2, m2 = scored_batch(tok, ["x384"], [[resp(), resp()]], [5])
    log.begin_validation(40, val_data)
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        log.offer(b1, t1, [None] * len(b1), m1)
        log.offer(b2, t2, [None] * len(b2), m2)
        log.flush()
    metrics.close()
    recs = read(tmp_path / "samples.jsonl")
    assert [(r["step"], r["split"], r["index"]) for r in recs] == [(40, "val", 5), (40, "val", 7)]
    for r, (batch, row) in zip(recs, [(b2, 0), (b1, 2)]):  # the first of each prompt's two responses
        p = int(batch["prompt_lens"][row])
        ids = batch["input_ids"][row]
        assert r["prompt"] == tok.decode(ids[:p].tolist())
        assert r["response"] == tok.decode(ids[p:p + int(batch["response_lens"][row])].tolist(), skip_special_tokens=True)
        assert r["reward"] == pytest.approx(float(batch["scores"][row])) and r["acc"] == float(batch["acc"][row])
        assert r["ground_truth"] == batch.meta["ground_truth"][row] and "messages" not in r
    assert recs[0]["prompt"] == "x384" and recs[1]["prompt"] == "b22"
    console = caplog.text
    assert "samples at step 40 (val" in console and f"'x384' -> {recs[0]['response']!r}" in console
    # TensorBoard text samples/val at step 40, holding both responses
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = acc.Tensors("samples/val/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 40 and all("    " + r["response"] in text for r in recs if r["response"])
    # the next validation shows the same prompts again
    log.begin_validation(80, val_data)
    log.offer(b2, t2, [None] * len(b2), m2)
    log.offer(b1, t1, [None] * len(b1), m1)
    log.flush()
    assert [(r["step"], r["index"]) for r in read(tmp_path / "samples.jsonl")[2:]] == [(80, 5), (80, 7)]


def test_training_samples_every_n_steps_and_multi_turn_conversations(tmp_path, tok):
    log = SampleLog(str(tmp_path), True, 2, 3, tok)
    turns = [[{"role": "assistant", "content": "?"}, {"role": "user", "content": "7"},
              {"role": "assistant", "content": "7"}]] * 2
    batch, texts, msgs = scored_batch(tok, ["q1", "q2", "q3"], [[[40, 10], [40, 10]]] * 3, [0, 1, 2], [turns] * 3)
    prompts = [[{"role": "system", "content": "find it"}, {"role": "user", "content": f"q{i}"}] for i in range(len(batch))]
    for step in (1, 2, 3):
        log.begin_step(step)
        log.offer(batch, texts, prompts, msgs)
        log.flush()
    recs = read(tmp_path / "samples.jsonl")
    assert [(r["step"], r["split"], r["index"]) for r in recs] == [(3, "train", 0), (3, "train", 1)]
    assert recs[1]["messages"] == prompts[2] + turns[0] and recs[1]["prompt_messages"] == 2
    assert recs[1]["response"] == texts[2]
    off = SampleLog(str(tmp_path / "off"), True, 0, 1, tok)  # log_samples = 0: none, validations included
    off.begin_step(1)
    off.begin_validation(1, [SimpleNamespace(index=0)])
    assert off.split is None
