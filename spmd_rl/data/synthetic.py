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


def write_synthetic(task: str, out_dir: str, train_size: int, val_size: int, seed: int) -> tuple[str, str]:
    """Write <out_dir>/train.parquet and <out_dir>/val.parquet; returns their paths."""
    if train_size < 1 or val_size < 1:
        raise ValueError(f"synthetic data needs at least one row per split, got train_size={train_size}, "
                         f"val_size={val_size}")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, size in (("train", train_size), ("val", val_size)):
        path = os.path.join(out_dir, f"{split}.parquet")
        _write_parquet(synthetic_rows(task, size, seed, split), path)
        paths.append(path)
    return paths[0], paths[1]
