"""Offline synthetic tasks, written as Parquet files in the schema of docs/data.md.

"successor": prompt = 1-3 random digits ("384"), answer = (last digit + 1) mod 10.
    One digit of context decides the answer, so a tiny random model learns it by RL alone.
"hidden": a random digit that only an environment reveals (multi-turn rollouts).
"arithmetic": short word problems with exact small-integer answers ("Tom has 3 apples and buys
    4 more. How many apples does Tom have?" -> "7"), written only with characters of the built-in
    character tokenizer so no prompt contains <unk>.

Both are deterministic in the seed; train and validation rows come from separate random streams
(they may still share prompts, as the successor task has only 1110 distinct ones).
"""

from __future__ import annotations

import json
import os
import random
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

TASKS = ("successor", "arithmetic", "hidden")

# Capitals limited to those of the character tokenizer (spmd_rl/model/tokenizer.py UPPERCASE).
NAMES = ("Tom", "Tim", "Sam", "Sue", "Ann", "Amy", "Hal", "Hana", "Will", "Wes")
ITEMS = ("apples", "pens", "books", "cards", "coins", "eggs", "cups", "hats", "stamps", "shells")


def successor_example(rng: random.Random) -> tuple[str, str]:
    """("384", "5"): the answer is the last digit plus one, mod 10.

    The prompt ends on the digit that decides the answer, so the first response token depends on
    the current token alone: a 2-layer random model can learn the mapping from reward alone in a
    few dozen steps (with a "=" after the digits it first has to discover attention to the
    previous token, and from a sparse reward it collapses onto one digit instead)."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 3)))
    return digits, str((int(digits[-1]) + 1) % 10)


def _buy(rng: random.Random, name: str, other: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    return f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have?", a + b


def _give(rng: random.Random, name: str, other: str, item: str) -> tuple[str, int]:
    a = rng.randint(2, 20)
    b = rng.randint(1, a)
    return f"{name} has {a} {item} and gives {b} to {other}. How many {item} does {name} have now?", a - b


def _bags(rng: random.Random, name: str, other: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?", a * b


def _box(rng: random.Random, name: str, other: str, item: str) -> tuple[str, int]:
    a = rng.randint(5, 20)
    b, c = rng.randint(1, a), rng.randint(1, 10)
    return (f"There are {a} {item} in a box. {name} takes {b} of them and {other} adds {c}. "
            f"How many {item} are in the box now?", a - b + c)


def _share(rng: random.Random, name: str, other: str, item: str) -> tuple[str, int]:
    a, b = rng.randint(2, 6), rng.randint(2, 9)
    return (f"{name} and {other} each have {a} boxes of {b} {item}. How many {item} do they have "
            "together?", 2 * a * b)


ARITHMETIC_TEMPLATES: tuple[Callable[[random.Random, str, str, str], tuple[str, int]], ...] = (
    _buy, _give, _bags, _box, _share)


def arithmetic_example(rng: random.Random) -> tuple[str, str]:
    """A word problem and its integer answer as text."""
    template = rng.choice(ARITHMETIC_TEMPLATES)
    name, other = rng.sample(NAMES, 2)
    prompt, answer = template(rng, name, other, rng.choice(ITEMS))
    return prompt, str(answer)


def hidden_example(rng: random.Random) -> tuple[str, str]:
    """("kqd", "7"): the answer is a random digit the prompt (1-3 random letters) says nothing about.
    Only an environment knows it: the multi-turn learning task of spmd_rl/envs/hidden_digit.py (the
    model asks, the environment answers the digit, the model repeats it). Without it, a guess:
    0.1. The prompt has no digit, so "ask" (after a letter) and "repeat" (after the digit) depend on
    the current token alone."""
    letters = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 3)))
    return letters, rng.choice("0123456789")


EXAMPLES = {"successor": successor_example, "arithmetic": arithmetic_example, "hidden": hidden_example}


def synthetic_rows(task: str, size: int, seed: int, split: str) -> dict[str, list]:
    """Columns of `size` rows of `task`, in the Parquet schema of docs/data.md."""
    if task not in EXAMPLES:
        raise ValueError(f"unknown synthetic task {task!r}: use one of {', '.join(TASKS)} "
                         "(data.synthetic_task / --task)")
    # A string seed is hashed deterministically (sha512), independent of PYTHONHASHSEED.
    rng = random.Random(f"{task}:{split}:{seed}")
    examples = [EXAMPLES[task](rng) for _ in range(size)]
    return {
        "prompt": [p for p, _ in examples],
        "data_source": [f"synthetic/{task}"] * size,
        "ground_truth": [a for _, a in examples],
        "extra_info": [{"split": split, "index": i, "task": task} for i in range(size)],
    }


def _write_parquet(columns: dict[str, list], path: str) -> None:
    # Write-then-rename so other ranks waiting for the file never read half of it.
    tmp = f"{path}.tmp{os.getpid()}"
    pq.write_table(pa.table(columns), tmp)
    os.replace(tmp, path)


def write_synthetic(task: str, out_dir: str, train_size: int, val_size: int, seed: int,
                    replace: bool = False) -> tuple[str, str]:
    """Write <out_dir>/train.parquet and <out_dir>/val.parquet; returns their paths. An existing file
    is never replaced unless `replace` (FileExistsError names it)."""
    if train_size < 1 or val_size < 1:
        raise ValueError(f"synthetic data needs at least one row per split, got train_size={train_size}, "
                         f"val_size={val_size}")
    paths = tuple(os.path.join(out_dir, f"{split}.parquet") for split in ("train", "val"))
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not replace:
        raise FileExistsError(f"{existing[0]} exists; synthetic data never replaces a file")
    os.makedirs(out_dir, exist_ok=True)
    for split, size, path in (("train", train_size, paths[0]), ("val", val_size, paths[1])):
        _write_parquet(synthetic_rows(task, size, seed, split), path)
    return paths[0], paths[1]


# ----------------------------------------------------------------- a run's own synthetic data
# With data.synthetic_task a run writes its data under its own directory and nowhere else: the
# files of RUN_DATA_FILES in <run_dir>/data, and RECIPE_FILE saying what they hold, so a restart
# reuses them and a restart with another task, size or seed is refused instead of training on
# data the config does not describe.

RUN_DATA_DIR = "data"
RUN_DATA_FILES = ("train.parquet", "val.parquet")
RECIPE_FILE = "synthetic.json"


def run_data_files(run_dir: str) -> tuple[str, str]:
    """The run's own synthetic (train, val) files: <run_dir>/data/train.parquet and val.parquet."""
    return tuple(os.path.join(run_dir, RUN_DATA_DIR, name) for name in RUN_DATA_FILES)  # type: ignore[return-value]


def recipe(task: str, train_size: int, val_size: int, seed: int) -> dict:
    """What a run's synthetic files hold, as RECIPE_FILE records it."""
    return {"task": task, "train_size": train_size, "val_size": val_size, "seed": seed}


def recorded_recipe(run_dir: str) -> dict | None:
    """The recipe the run's synthetic files were written with; None where none was recorded (no files
    yet, or files from a version that did not record it)."""
    path = os.path.join(run_dir, RUN_DATA_DIR, RECIPE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_run_data(run_dir: str, want: dict) -> list[str]:
    """Write the run's own synthetic files that are missing, and the recipe; returns the files written.
    Files already there are the run's own from an earlier start (the config check compared their
    recipe with `want`) and are kept."""
    train, val = run_data_files(run_dir)
    written = []
    for split, size, path in (("train", want["train_size"], train), ("val", want["val_size"], val)):
        if not os.path.isfile(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            _write_parquet(synthetic_rows(want["task"], size, want["seed"], split), path)
            written.append(path)
    recipe_path = os.path.join(run_dir, RUN_DATA_DIR, RECIPE_FILE)
    if written:
        tmp = f"{recipe_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(want, f)
        os.replace(tmp, recipe_path)
    return written
