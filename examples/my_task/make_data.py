"""Write this task's data: train.parquet and val.parquet in the directory given (default: data/).

The task: the prompt is a number of three digits, the answer its first digit ("384" -> "3").
One row per prompt, in the columns docs/data.md describes: `prompt` (text, or a list of chat
messages), `data_source` (names the task; picks its scorer), `ground_truth` (handed to the reward).

    python examples/my_task/make_data.py examples/my_task/data
"""

import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    numbers = [str(rng.randrange(100, 1000)) for _ in range(n)]
    return [{"prompt": x, "data_source": "my_task/first_digit", "ground_truth": x[0]} for x in numbers]


def main(out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    for split, n, seed in (("train", 512, 0), ("val", 128, 1)):
        pq.write_table(pa.Table.from_pylist(rows(n, seed)), os.path.join(out_dir, f"{split}.parquet"))
    print(f"wrote {out_dir}/train.parquet (512 rows) and {out_dir}/val.parquet (128 rows)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "data")
