"""Write an offline synthetic task as train/val Parquet files (schema: docs/data.md).

    python scripts/make_synthetic.py --task successor --out-dir data/successor --train-size 2048 --val-size 512
"""

from __future__ import annotations

import argparse
import os
import sys

# Run from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spmd_rl.data.synthetic import TASKS, write_synthetic  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--out-dir", required=True, help="directory for train.parquet and val.parquet")
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--val-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace train.parquet / val.parquet if they exist")
    args = parser.parse_args(argv)
    try:
        train, val = write_synthetic(args.task, args.out_dir, args.train_size, args.val_size, args.seed,
                                     replace=args.force)
    except FileExistsError as e:
        sys.exit(f"error: {e}: choose another --out-dir, or pass --force to replace it")
    print(f"wrote {args.train_size} rows to {train} and {args.val_size} rows to {val}")


if __name__ == "__main__":
    main()
