"""Run a 2-rank body of the CPU test suite N times through tests/dist_utils.run_distributed (the
spawn harness) and count the runs that failed, aborts (SIGABRT at exit) among them.

    python scripts/probes/stress_dist_harness.py 200

The body is tests/train/test_update.py's distributed update (padded, full logits): the test that once
died with "terminate called without an active exception" when the harness ended its ranks with a
plain destroy_process_group()."""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]

from dist_utils import run_distributed  # noqa: E402
from test_update import _update_body  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    layout = "padded-full-logits"
    failures, aborts = 0, 0
    t0 = time.time()
    for i in range(1, n + 1):
        try:
            run_distributed(_update_body, 2, layout)
        except Exception as e:  # ProcessExitedException carries the signal of a rank killed by one
            failures += 1
            aborted = "SIGABRT" in str(e) or "terminate called" in str(e) or getattr(e, "signal_name", "") == "SIGABRT"
            aborts += aborted
            print(f"run {i}: FAILED{' (abort)' if aborted else ''}: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                  flush=True)
        if i % 10 == 0:
            print(f"{i}/{n} runs, {failures} failed, {aborts} aborts, {time.time() - t0:.0f}s", flush=True)
    print(f"stress_dist_harness: runs={n} failures={failures} aborts={aborts}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
