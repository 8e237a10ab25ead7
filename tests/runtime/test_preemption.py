"""StopFlag: signals only set a flag; requested() is collective, so all ranks stop after the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from spmd_rl.exit_codes import EXIT_PREEMPTED
from spmd_rl.runtime.distributed import free_port
from spmd_rl.runtime.preemption import REQUEUE_SIGNALS, StopFlag
from tests.helpers import ROOT as REPO


@pytest.fixture
def stop():
    """A freshly installed flag; the previous handlers come back afterwards."""
    StopFlag._uninstall()
    flag = StopFlag.install()
    yield flag
    StopFlag._uninstall()


def _deliver(sig: signal.Signals) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary of the main thread


def test_user_signal_sets_the_flag_and_asks_for_a_requeue(stop):
    assert not stop.local() and not stop.requested()
    _deliver(signal.SIGUSR2)
    _deliver(signal.SIGUSR2)  # a second one is harmless
    assert stop.local() and stop.requested()
    assert stop.signals == {signal.SIGUSR2}
    assert stop.requeue_requested
    assert StopFlag.install() is stop, "install() must be idempotent: the trainer calls it again"


def test_sigterm_stops_but_is_no_requeue_request(stop):
    _deliver(signal.SIGTERM)
    assert stop.requested() and stop.signals == {signal.SIGTERM}
    assert not stop.requeue_requested
    assert signal.SIGTERM not in REQUEUE_SIGNALS


def test_ctrl_c_stops_like_sigterm_and_a_second_one_interrupts_at_once(stop):
    """The first SIGINT only sets the flag (the step ends, the checkpoint is written); a second
    SIGINT, or the SIGTERM torchrun sends on a second Ctrl-C, raises KeyboardInterrupt."""
    _deliver(signal.SIGINT)
    assert stop.requested() and stop.signals == {signal.SIGINT} and not stop.requeue_requested
    for second in (signal.SIGINT, signal.SIGTERM):
        with pytest.raises(KeyboardInterrupt):
            _deliver(second)


def test_a_second_ctrl_c_lost_in_a_weakref_callback_is_raised_at_the_next_check(stop):
    """Python drops an exception raised while a weakref callback runs (as a signal handler can):
    requested(), which the trainer calls after every step, raises it again."""
    _deliver(signal.SIGINT)
    try:
        stop._handle(signal.SIGINT, None)
    except KeyboardInterrupt:
        pass  # as if swallowed by the callback it interrupted
    with pytest.raises(KeyboardInterrupt):
        stop.requested()


def test_a_sigterm_alone_never_interrupts(stop):
    _deliver(signal.SIGTERM)
    _deliver(signal.SIGTERM)
    assert stop.requested()


def test_exit_status_and_closing_lines_are_recorded_per_rank(tmp_path, monkeypatch):
    from spmd_rl.runtime.preemption import (
        EXIT_STATUS_DIR_ENV,
        record_exit_status,
        recorded_exit_statuses,
        recorded_messages,
    )

    monkeypatch.setenv(EXIT_STATUS_DIR_ENV, str(tmp_path))
    for rank, code, message in ((0, 2, "error: actor.lr = -1.0 must be > 0\n"), (1, 2, None)):
        monkeypatch.setenv("RANK", str(rank))
        record_exit_status(code, message)
    assert recorded_exit_statuses(str(tmp_path)) == {0: 2, 1: 2}
    assert recorded_messages(str(tmp_path)) == {0: "error: actor.lr = -1.0 must be > 0\n"}


def test_install_keeps_the_handlers_it_replaced():
    StopFlag._uninstall()
    seen = []
    before = signal.signal(signal.SIGUSR2, lambda s, f: seen.append(s))
    try:
        flag = StopFlag.install()
        flag.previous_handler(signal.SIGUSR2)(signal.SIGUSR2, None)  # what the launcher does for submitit
        assert seen == [signal.SIGUSR2]
        _deliver(signal.SIGUSR2)
        assert seen == [signal.SIGUSR2], "the replaced handler must not run on the signal itself"
    finally:
        StopFlag._uninstall()
        signal.signal(signal.SIGUSR2, before)
    assert EXIT_PREEMPTED not in (0, 1, 2)  # distinct from success, errors and config errors


WORKER = textwrap.dedent("""
    import json, os, random, sys, time
    import torch.distributed as dist

    from spmd_rl.runtime.preemption import StopFlag

    stop = StopFlag.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.barrier()
    print("ready", flush=True)
    step = 0
    while step < 400:                      # ~20 s at most
        step += 1
        time.sleep(random.uniform(0.02, 0.08))  # ranks drift apart, as real steps do
        if stop.requested():
            break
    print(json.dumps({"rank": rank, "step": step, "local": stop.local(),
                      "signals": sorted(s.name for s in stop.signals)}), flush=True)
    dist.destroy_process_group()
""")


def test_signal_to_one_rank_stops_all_ranks_after_the_same_step():
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO)
        procs.append(subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        deadline = time.monotonic() + 90
        for p in procs:  # both ranks in the loop, handlers installed
            line = p.stdout.readline()
            assert line.strip() == "ready", f"worker did not start: {line!r} {p.stderr.read() if p.poll() is not None else ''}"
            assert time.monotonic() < deadline
        time.sleep(0.5)
        procs[1].send_signal(signal.SIGTERM)  # only rank 1 hears it
        results = []
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    r0, r1 = sorted(results, key=lambda r: r["rank"])
    assert r0["step"] == r1["step"] < 400, results
    assert r1["local"] and not r0["local"], results
    assert r0["signals"] == r1["signals"] == ["SIGTERM"], "rank 0 must learn which signal rank 1 got"
