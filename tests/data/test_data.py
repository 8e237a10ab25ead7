"""Parquet prompt datasets, the sharded sampler, eval batches and the data-making scripts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from spmd_rl.config.reward import RewardConfig
from spmd_rl.data.prompts import DataError, PromptDataset, ShardedSampler, iter_eval_batches
from spmd_rl.data.rewards import RewardFunction
from spmd_rl.data.synthetic import write_synthetic
from spmd_rl.model.tokenizer import build_char_tokenizer
from tests.helpers import ROOT

REPO = Path(ROOT)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def write(path, columns: dict) -> str:
    pq.write_table(pa.table(columns), path)
    return str(path)


def plain_table(prompts, truths=None, source="synthetic/successor"):
    return {"prompt": prompts, "data_source": [source] * len(prompts),
            "ground_truth": truths or ["0"] * len(prompts)}


# --------------------------------------------------------------------------- dataset


def test_plain_prompts_are_tokenized_per_character(tok, tmp_path):
    f = write(tmp_path / "a.parquet", plain_table(["12=", "7="], ["3", "8"]))
    ds = PromptDataset([f], tok, max_prompt_length=16, apply_chat_template=True)
    assert len(ds) == 2 and ds.num_dropped == 0
    rec = ds[0]
    assert rec.prompt_ids == tok.encode("12=")
    assert (rec.index, rec.data_source, rec.ground_truth, rec.extra_info) == (0, "synthetic/successor", "3", {})


def test_chat_prompts_with_and_without_template(tok, tmp_path):
    messages = [[{"role": "system", "content": "add"}, {"role": "user", "content": "1+2"}]]
    f = write(tmp_path / "chat.parquet", {"prompt": messages, "data_source": ["synthetic/a"],
                                          "ground_truth": ["3"]})
    with_template = PromptDataset([f], tok, 64, apply_chat_template=True)
    assert with_template[0].prompt_ids == tok.encode("add\n1+2=")
    without = PromptDataset([f], tok, 64, apply_chat_template=False)
    assert without[0].prompt_ids == tok.encode("add\n1+2")


def test_verl_reward_model_struct_and_extra_info_struct(tok, tmp_path):
    # The layout of verl's examples/data_preprocess/gsm8k.py output.
    f = write(tmp_path / "verl.parquet", {
        "data_source": ["openai/gsm8k"],
        "prompt": [[{"role": "user", "content": "What is 2+2?"}]],
        "ability": ["math"],
        "reward_model": [{"style": "rule", "ground_truth": "4"}],
        "extra_info": [{"split": "train", "index": 0}],
    })
    rec = PromptDataset([f], tok, 64, apply_chat_template=True)[0]
    assert rec.ground_truth == "4"
    assert rec.extra_info == {"split": "train", "index": 0}
    assert rec.prompt_ids == tok.encode("What is 2+2?=")


def test_extra_info_json_string_and_integer_ground_truth(tok, tmp_path):
    f = write(tmp_path / "j.parquet", {"prompt": ["1=", "2="], "data_source": ["synthetic/s"] * 2,
                                       "ground_truth": [2, 3], "extra_info": ['{"k": 1}', None]})
    ds = PromptDataset([f], tok, 8, True)
    assert [r.ground_truth for r in ds] == ["2", "3"]
    assert [r.extra_info for r in ds] == [{"k": 1}, {}]


@pytest.mark.parametrize("columns,message", [
    ({"data_source": ["s"], "ground_truth": ["1"]}, r"no column 'prompt'"),
    ({"prompt": [1], "data_source": ["s"], "ground_truth": ["1"]}, r"column 'prompt' has type int64"),
    ({"prompt": ["1="], "ground_truth": ["1"]}, r"no column 'data_source'"),
    ({"prompt": ["1="], "data_source": ["s"]}, r"no ground truth.*reward_model"),
    ({"prompt": ["1="], "data_source": ["s"], "ground_truth": [1.5]}, r"column 'ground_truth' has type double"),
    ({"prompt": ["1="], "data_source": ["s"], "reward_model": [{"style": "rule"}]}, r"'reward_model'.*struct"),
    ({"prompt": ["1=", None], "data_source": ["s", "s"], "ground_truth": ["1", "2"]},
     r"'prompt' is empty \(null\) in row 1"),
    ({"prompt": ["1="], "data_source": ["s"], "ground_truth": ["1"], "extra_info": ["{bad"]},
     r"extra_info of row 0 is not valid JSON"),
])
def test_schema_errors_name_file_and_column(tok, tmp_path, columns, message):
    f = write(tmp_path / "bad.parquet", columns)
    with pytest.raises(DataError, match=message) as err:
        PromptDataset([f], tok, 8, True)
    assert "bad.parquet" in str(err.value)


def test_empty_missing_and_non_parquet_files(tok, tmp_path):
    empty = write(tmp_path / "empty.parquet", {"prompt": pa.array([], pa.string()),
                                               "data_source": pa.array([], pa.string()),
                                               "ground_truth": pa.array([], pa.string())})
    with pytest.raises(DataError, match="empty.parquet' has no rows"):
        PromptDataset([empty], tok, 8, True)
    with pytest.raises(DataError, match="does not exist"):
        PromptDataset([str(tmp_path / "nope.parquet")], tok, 8, True)
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable Parquet"):
        PromptDataset([str(tmp_path / "text.parquet")], tok, 8, True)


def test_long_prompts_dropped_and_counted_with_original_indices(tok, tmp_path):
    f1 = write(tmp_path / "1.parquet", plain_table(["1=", "123456789=", "22="]))
    f2 = write(tmp_path / "2.parquet", plain_table(["99999=", "3="]))
    ds = PromptDataset([f1, f2], tok, max_prompt_length=4, apply_chat_template=True)
    assert ds.num_dropped == 2
    assert [r.index for r in ds] == [0, 2, 4]
    assert [tok.decode(r.prompt_ids) for r in ds] == ["1=", "22=", "3="]


def test_all_prompts_too_long_says_raise_max_prompt_length(tok, tmp_path):
    f = write(tmp_path / "long.parquet", plain_table(["123456789="]))
    with pytest.raises(DataError, match=r"raise data.max_prompt_length \(the longest prompt has 10 tokens\)"):
        PromptDataset([f], tok, 4, True)


# --------------------------------------------------------------------------- sampler


def test_ranks_slices_make_up_the_global_batch():
    samplers = [ShardedSampler(10, 4, rank, 2, seed=3, shuffle=True) for rank in range(2)]
    reference = ShardedSampler(10, 4, 0, 1, seed=3, shuffle=True)
    for _ in range(5):
        parts = [s.next_batch() for s in samplers]
        assert all(len(p) == 2 for p in parts)
        assert parts[0] + parts[1] == reference.next_batch()


def test_no_shuffle_walks_in_order_and_drops_incomplete_batch():
    s = ShardedSampler(7, 3, rank=0, world_size=1, seed=0, shuffle=False)
    assert s.steps_per_epoch == 2
    assert [s.next_batch() for _ in range(3)] == [[0, 1, 2], [3, 4, 5], [0, 1, 2]]


def test_epochs_are_permutations_that_differ_and_are_deterministic():
    def two_epochs(seed):
        s = ShardedSampler(12, 4, 0, 1, seed=seed, shuffle=True)
        return [s.next_batch() for _ in range(6)]

    run = two_epochs(seed=5)
    epoch0, epoch1 = sum(run[:3], []), sum(run[3:], [])
    assert sorted(epoch0) == sorted(epoch1) == list(range(12))
    assert epoch0 != epoch1
    assert two_epochs(seed=5) == run
    assert two_epochs(seed=6) != run


def test_epoch_and_position_roll_over():
    s = ShardedSampler(8, 4, 0, 1, seed=0)
    assert (s.epoch, s.position) == (0, 0)
    s.next_batch()
    assert (s.epoch, s.position) == (0, 1)
    s.next_batch()
    assert (s.epoch, s.position) == (1, 0)


def test_state_dict_resume_gives_identical_indices():
    original = ShardedSampler(10, 4, 1, 2, seed=7)
    for _ in range(3):
        original.next_batch()
    state = original.state_dict()
    expected = [original.next_batch() for _ in range(5)]
    resumed = ShardedSampler(10, 4, 1, 2, seed=7)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(5)] == expected
    with pytest.raises(DataError, match="seed"):
        ShardedSampler(10, 4, 1, 2, seed=8).load_state_dict(state)


def test_a_state_saved_on_one_world_size_resumes_the_same_global_batches_on_another():
    """A checkpoint resumed on another number of ranks (every rank loads rank 0's sampler state):
    each step is still made of the same prompts, across the epoch boundary too."""
    saved = [ShardedSampler(10, 4, rank, 2, seed=7) for rank in range(2)]
    for _ in range(3):
        for s in saved:
            s.next_batch()
    state = saved[0].state_dict()
    expected = [sum((s.next_batch() for s in saved), []) for _ in range(4)]
    for world in (1, 4):
        resumed = [ShardedSampler(10, 4, rank, world, seed=7) for rank in range(world)]
        for s in resumed:
            s.load_state_dict(state)
        assert [sum((s.next_batch() for s in resumed), []) for _ in range(4)] == expected


def test_dataset_smaller_than_one_batch_is_refused():
    with pytest.raises(DataError, match="fewer than one batch"):
        ShardedSampler(3, 4, 0, 1, seed=0)


@pytest.mark.parametrize("num_items,batch,world", [(10, 4, 2), (7, 8, 3), (9, 3, 3), (2, 4, 4), (0, 4, 2)])
def test_eval_batches_cover_every_item_once(num_items, batch, world):
    per_rank = [list(iter_eval_batches(num_items, batch, rank, world)) for rank in range(world)]
    assert len({len(batches) for batches in per_rank}) == 1  # same number of calls on every rank
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    assert seen == list(range(num_items))


def test_eval_batches_uneven_last_batch():
    assert list(iter_eval_batches(5, 4, 0, 2)) == [[0, 1], [4]]
    assert list(iter_eval_batches(5, 4, 1, 2)) == [[2, 3], []]


# --------------------------------------------------------------------------- data-making scripts


@pytest.mark.parametrize("task", ["successor", "arithmetic"])
def test_synthetic_data_loads_and_is_scorable(tok, tmp_path, task):
    train, val = write_synthetic(task, str(tmp_path), train_size=40, val_size=10, seed=1)
    ds = PromptDataset([train], tok, 512, True)
    assert len(ds) == 40 and ds.num_dropped == 0
    assert len(PromptDataset([val], tok, 512, True)) == 10
    assert all(tok.unk_token_id not in r.prompt_ids for r in ds)
    assert {r.data_source for r in ds} == {f"synthetic/{task}"}
    scores = RewardFunction(RewardConfig())([r.data_source for r in ds], [r.ground_truth for r in ds],
                                            [r.ground_truth for r in ds], [r.extra_info for r in ds])
    assert all(s["acc"] == 1.0 for s in scores)
    again, _ = write_synthetic(task, str(tmp_path / "again"), 40, 10, seed=1)
    assert pq.read_table(again).equals(pq.read_table(train))


def test_synthetic_data_never_replaces_a_file(tmp_path):
    """write_synthetic refuses an existing file unless told to replace it; a run's own data is written
    once, kept on a restart (the same bytes), and its recipe recorded beside it."""
    from spmd_rl.data.synthetic import recipe, recorded_recipe, run_data_files, write_run_data

    (tmp_path / "val.parquet").write_text("mine")
    with pytest.raises(FileExistsError, match="val.parquet exists"):
        write_synthetic("successor", str(tmp_path), 40, 10, seed=1)
    assert (tmp_path / "val.parquet").read_text() == "mine" and not (tmp_path / "train.parquet").exists()
    write_synthetic("successor", str(tmp_path), 40, 10, seed=1, replace=True)
    assert pq.read_table(tmp_path / "val.parquet").num_rows == 10

    run, want = tmp_path / "run", recipe("successor", 40, 10, 1)
    assert write_run_data(str(run), want) == list(run_data_files(str(run)))
    assert recorded_recipe(str(run)) == want
    train, val = run_data_files(str(run))
    assert pq.read_table(train).equals(pq.read_table(tmp_path / "train.parquet"))
    first = open(val, "rb").read()
    assert write_run_data(str(run), want) == [] and open(val, "rb").read() == first


def test_make_synthetic_refuses_to_replace_a_file(tmp_path):
    (tmp_path / "train.parquet").write_text("mine")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_synthetic.py"), "--task", "successor",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip() == (f"error: {tmp_path}/train.parquet exists; synthetic data never "
                                                      "replaces a file: choose another --out-dir, or pass --force to "
                                                      "replace it"), p.stderr
    assert (tmp_path / "train.parquet").read_text() == "mine"


def test_successor_answers(tmp_path):
    train, _ = write_synthetic("successor", str(tmp_path), 50, 5, seed=0)
    for row in pq.read_table(train).to_pylist():
        digits = row["prompt"]
        assert 1 <= len(digits) <= 3 and digits.isdigit()
        assert row["ground_truth"] == str((int(digits[-1]) + 1) % 10)


def test_arithmetic_answers_follow_the_story(tmp_path):
    train, _ = write_synthetic("arithmetic", str(tmp_path), 200, 5, seed=0)
    for row in pq.read_table(train).to_pylist():
        p, answer = row["prompt"], int(row["ground_truth"])
        n = [int(x) for x in p.replace(".", " ").replace("?", " ").split() if x.isdigit()]
        if "buys" in p and "more" in p:
            assert answer == n[0] + n[1]
        elif "gives" in p:
            assert answer == n[0] - n[1]
        elif "bags" in p:
            assert answer == n[0] * n[1]
        elif "box." in p:
            assert answer == n[0] - n[1] + n[2]
        else:
            assert answer == 2 * n[0] * n[1]


def test_make_synthetic_cli(tmp_path):
    out = subprocess.run([sys.executable, str(REPO / "scripts/make_synthetic.py"), "--task", "successor",
                          "--out-dir", str(tmp_path), "--train-size", "8", "--val-size", "4", "--seed", "2"],
                         capture_output=True, text=True, check=True)
    assert "train.parquet" in out.stdout
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 8
    assert pq.read_table(tmp_path / "val.parquet").num_rows == 4


def test_prepare_gsm8k(tok, tmp_path):
    rows = [{"question": "Ann has 2 pens and buys 3. How many?", "answer": "2+3=5\n#### 5"},
            {"question": "Big?", "answer": "a lot\n#### 1,200"}]
    src = tmp_path / "gsm8k_test.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.parquet"
    subprocess.run([sys.executable, str(REPO / "scripts/prepare_gsm8k.py"), "--input", str(src),
                    "--out", str(out), "--instruction", "Say ####."], check=True, capture_output=True)
    table = pq.read_table(out).to_pylist()
    assert table[1]["ground_truth"] == "1200"
    assert table[0]["prompt"] == [{"role": "user", "content": rows[0]["question"] + " Say ####."}]
    assert table[0]["extra_info"] == {"split": "test", "index": 0, "answer": rows[0]["answer"],
                                      "question": rows[0]["question"]}
    ds = PromptDataset([str(out)], tok, 512, True)
    assert [r.ground_truth for r in ds] == ["5", "1200"]
    assert {r.data_source for r in ds} == {"openai/gsm8k"}


def test_prepare_gsm8k_rejects_rows_without_fields(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"question": "q"}) + "\n")
    result = subprocess.run([sys.executable, str(REPO / "scripts/prepare_gsm8k.py"), "--input", str(src),
                             "--out", str(tmp_path / "o.parquet")], capture_output=True, text=True)
    assert result.returncode != 0
    assert "row 0 has no string field 'answer'" in result.stderr
