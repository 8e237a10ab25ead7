"""Convert GSM8K from its public format to our Parquet schema (docs/data.md), verl-compatible.

Input rows (jsonl or parquet, e.g. the openai/gsm8k files) have "question" and "answer", the
answer ending in "#### N". Output rows:
    prompt        [{"role": "user", "content": question + " " + instruction}]
    data_source   "openai/gsm8k"
    ground_truth  N with commas removed (also as reward_model.ground_truth, so verl reads it too)
    extra_info    {split, index, answer, question}

    python scripts/prepare_gsm8k.py --input gsm8k/train.jsonl --out data/gsm8k_train.parquet
    python scripts/prepare_gsm8k.py --tools ...   # the calculator preset's rows (configs/qwen0.5b-gsm8k-tool.toml)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import pyarrow as pa
import pyarrow.parquet as pq

DEFAULT_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_INSTRUCTION = ('Use the calculate tool for arithmetic, then output the final answer after "####".')
DATA_SOURCE = "openai/gsm8k"
_ANSWER_RE = re.compile(r"####\s*(.+?)\s*$")


class GSM8KFormatError(ValueError):
    """An input row that is not in the public GSM8K format."""


def read_rows(path: str) -> list[dict]:
    """Rows of a .jsonl or .parquet file as dicts."""
    if not os.path.isfile(path):
        raise GSM8KFormatError(f"input {path!r} does not exist")
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    if path.endswith((".jsonl", ".json")):
        rows = []
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise GSM8KFormatError(f"{path}:{line_no} is not valid JSON ({e})") from None
        return rows
    raise GSM8KFormatError(f"input {path!r}: expected a .jsonl or .parquet file")


def final_answer(answer: str) -> str | None:
    """"... #### 1,234" -> "1234"."""
    m = _ANSWER_RE.search(answer.strip())
    return m.group(1).replace(",", "") if m else None


def split_name(path: str) -> str:
    """"train"/"test" when the file name says so, else the file's stem."""
    base = os.path.basename(path).lower()
    for split in ("train", "test"):
        if split in base:
            return split
    return base.split(".")[0]


def convert_row(row: dict, index: int, split: str, instruction: str, where: str) -> dict:
    for key in ("question", "answer"):
        if not isinstance(row.get(key), str):
            raise GSM8KFormatError(f"{where}: row {index} has no string field {key!r} "
                                   f"(fields: {sorted(row)}); GSM8K rows need 'question' and 'answer'")
    truth = final_answer(row["answer"])
    if truth is None:
        raise GSM8KFormatError(f"{where}: row {index}'s answer does not end in '#### N': {row['answer'][-80:]!r}")
    content = f"{row['question']} {instruction}" if instruction else row["question"]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "ground_truth": truth,
        "extra_info": {"split": split, "index": index, "answer": row["answer"], "question": row["question"]},
    }


def convert(inputs: list[str], out: str, instruction: str = DEFAULT_INSTRUCTION) -> int:
    """Convert all `inputs` into one Parquet file `out`; returns the number of rows."""
    rows = []
    for path in inputs:
        split = split_name(path)
        rows += [convert_row(r, i, split, instruction, path) for i, r in enumerate(read_rows(path))]
    if not rows:
        raise GSM8KFormatError(f"inputs {inputs} hold no rows")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), out)
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", action="extend", nargs="+", required=True,
                        help="GSM8K .jsonl or .parquet files (repeatable)")
    parser.add_argument("--out", required=True, help="output .parquet file")
    parser.add_argument("--instruction", default=None,
                        help="text appended to every question (empty = none; default: think step by step, or "
                             "with --tools: use the calculator)")
    parser.add_argument("--tools", action="store_true",
                        help="rows for configs/qwen0.5b-gsm8k-tool.toml: the instruction mentions the calculate tool")
    args = parser.parse_args(argv)
    instruction = args.instruction if args.instruction is not None else (
        TOOL_INSTRUCTION if args.tools else DEFAULT_INSTRUCTION)
    try:
        n = convert(args.input, args.out, instruction)
    except GSM8KFormatError as e:
        sys.exit(f"prepare_gsm8k: {e}")  # the message says what is wrong; a traceback would bury it
    print(f"wrote {n} rows to {args.out}")


if __name__ == "__main__":
    main()
