"""Job state from SLURM, without accounting: `scontrol show job` and bounded waits.

submitit reads states through `sacct`, which needs slurmdbd; many small clusters (and the test
cluster) have none. slurmctld keeps finished jobs for MinJobAge seconds (default 300), long
enough to see how a job ended.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable

FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
})

_FIELD = re.compile(r"(\w+)=(\S*)")


class JobWaitTimeout(TimeoutError):
    """A job did not reach the awaited state in time."""


def job_info(job_id: str | int) -> dict[str, str]:
    """`scontrol show job -o ID` as a dict (JobState, Restarts, ExitCode, Reason, NodeList, ...);
    empty when slurmctld does not know the job (any more)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        return {}
    return dict(_FIELD.findall(out.stdout.splitlines()[0])) if out.stdout.strip() else {}


def wait_for(job_id: str | int, until: Callable[[dict[str, str]], bool], timeout_s: float,
             what: str = "the awaited state", poll_s: float = 1.0) -> dict[str, str]:
    """Poll job_info until `until(info)` holds. Raises JobWaitTimeout after timeout_s, or as soon
    as the job has ended without getting there."""
    deadline = time.monotonic() + timeout_s
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info and until(info):
            return info
        if info.get("JobState") in FINAL_STATES:
            raise JobWaitTimeout(f"job {job_id} ended before reaching {what}: {_summary(info)}")
        time.sleep(poll_s)
    raise JobWaitTimeout(f"job {job_id} did not reach {what} within {timeout_s:.0f}s: {_summary(info)}")


def wait_finished(job_id: str | int, timeout_s: float, poll_s: float = 1.0) -> dict[str, str]:
    """Wait until the job is in a final state (COMPLETED, FAILED, ...) and return its info."""
    return wait_for(job_id, lambda i: i.get("JobState") in FINAL_STATES, timeout_s, "a final state", poll_s)


def _summary(info: dict[str, str]) -> str:
    keys = ("JobState", "Reason", "ExitCode", "Restarts")
    return " ".join(f"{k}={info.get(k, '?')}" for k in keys) if info else "unknown to slurmctld"
