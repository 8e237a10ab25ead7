"""scripts/gpu_check.py's result handling (gpu_check_runner.py, gpu_check_results.py), on CPU, with a
fake pytest in place of the real one (gpu_check_runner.PYTEST): a PASS row means a test ran and
passed. A check whose pytest exits non-zero, runs no test (a wrong test id: exit 4; nothing
collected: exit 5, an empty report) or skips every test is a FAIL row with its reason; a check cut
at its time limit (exit 124) is a FAIL row that says how far it got, and its partial logs, with its
runs' trainer.log and metrics.jsonl, end up in the logs tarball."""

from __future__ import annotations

import os
import sys
import tarfile
import textwrap

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))

import gpu_check_machine  # noqa: E402
import gpu_check_plan  # noqa: E402
import gpu_check_results  # noqa: E402
import gpu_check_runner  # noqa: E402

FAKE_PYTEST = textwrap.dedent('''
    """A stand-in for `python -m pytest`: behaves as FAKE_PYTEST (in its environment) says."""
    import os, sys, time
    from pathlib import Path

    args = dict(a.split("=", 1) for a in sys.argv[1:] if a.startswith("--") and "=" in a)
    xml, base = Path(args["--junitxml"]), Path(args["--basetemp"])
    case = os.environ["FAKE_PYTEST"]
    CASE = '<testcase classname="tests.gpu.test_x" file="tests/gpu/test_x.py" name="test_x" time="1.5">{}</testcase>'


    def report(*cases):
        xml.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="{}">'
                       '{}</testsuite></testsuites>'.format(len(cases), "".join(cases)))


    if case == "pass":
        report(CASE.format(""))
        sys.exit(0)
    if case == "wrong-id":  # pytest's answer to a node id that matches nothing
        print("ERROR: not found: tests/gpu/test_x.py::test_typo")
        report()
        sys.exit(4)
    if case == "none-collected":
        report()
        sys.exit(5)
    if case == "crash-after-pass":  # the tests passed, then pytest died (a teardown, a plugin)
        report(CASE.format(""))
        print("INTERNALERROR> RuntimeError: CUDA error in teardown")
        sys.exit(3)
    if case == "all-skipped":
        report(CASE.format('<skipped type="pytest.skip" message="needs vllm (pip install -e .[vllm])"/>'))
        sys.exit(0)
    if case == "other-machine":  # a 2-GPU layout on one GPU: n/a, not a failure
        report(CASE.format('<skipped type="pytest.skip" message="needs 2 GPUs, 1 visible"/>'))
        sys.exit(0)
    if case == "cut":  # a training run under way when the time limit comes
        run = base / "test_x0" / "qwen-run"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text('{"step": 1, "time/step": 9.0}\\n{"step": 2, "time/step": 3.0}\\n')
        (run / "trainer.log").write_text("[r0] INFO spmd_rl: step 1/5 | reward 0.0\\n"
                                         "[r0] INFO spmd_rl: step 2/5 | reward 0.1\\n\\n")
        (run / "model.safetensors").write_bytes(b"weights: not a log")
        print("tests/gpu/test_x.py ", flush=True)
        time.sleep(60)
    sys.exit(99)
''')


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Runs one check through gpu_check's real runner with the fake pytest; returns its rows."""
    script = tmp_path / "fake_pytest.py"
    script.write_text(FAKE_PYTEST)
    monkeypatch.setattr(gpu_check_runner, "PYTEST", (sys.executable, str(script)))
    monkeypatch.setattr(gpu_check_machine, "WORK", tmp_path / "work")
    monkeypatch.setattr(gpu_check_machine, "MEMORY_RUNS", tmp_path / "shm")
    (tmp_path / "work").mkdir()
    out = tmp_path / "out"
    out.mkdir()

    def run(case: str, timeout: float = 60) -> list[gpu_check_plan.Row]:
        check = gpu_check_plan.Check(f"check-{case}", ("tests/scripts/test_gpu_check_results.py",), env=(("FAKE_PYTEST", case),))
        return gpu_check_runner.pytest_runner(out)(check, (0,), timeout, False)

    run.out = out
    run.work = tmp_path / "work"
    return run


def test_a_passing_test_is_a_pass_row(fake):
    rows = fake("pass")
    assert [(r.item, r.result, r.check) for r in rows] == [("test_x::test_x", "PASS", "check-pass")]


@pytest.mark.parametrize("case, code", [("wrong-id", 4), ("none-collected", 5)])
def test_a_check_that_ran_no_test_fails(fake, case, code):
    rows = fake(case)
    assert [(r.item, r.result) for r in rows] == [(f"check-{case}", "FAIL")], rows
    assert "ran no test" in rows[0].note and f"exit {code}" in rows[0].note, rows[0].note
    assert gpu_check_results.table(rows, 1.0).splitlines()[-1].split("|")[2].strip() == "FAIL"


def test_a_non_zero_exit_fails_although_its_tests_passed(fake):
    rows = fake("crash-after-pass")
    assert [r.result for r in rows] == ["PASS", "FAIL"], rows
    assert rows[1].item == "check-crash-after-pass" and "exit 3" in rows[1].note, rows[1]


def test_a_check_whose_tests_all_skip_fails_with_the_reason(fake):
    rows = fake("all-skipped")
    assert [(r.item, r.result) for r in rows] == [("check-all-skipped", "FAIL")], rows
    assert rows[0].note.startswith("all skipped: needs vllm"), rows[0].note


def test_a_layout_of_more_gpus_is_na_but_a_table_of_nothing_passed_fails(fake):
    rows = fake("other-machine")
    assert [r.result for r in rows] == ["n/a"], rows
    assert "FAIL" in gpu_check_results.table(rows, 1.0).splitlines()[-1], "a table in which nothing passed must fail"


def test_a_cut_check_fails_says_how_far_it_got_and_keeps_its_logs(fake):
    rows = fake("cut", timeout=3)
    assert [(r.item, r.result) for r in rows] == [("check-cut", "FAIL")], rows
    note = rows[0].note
    assert "time limit" in note and "step 2" in note and "step 2/5 | reward 0.1" in note, note
    kept = fake.work / "gpu_logs" / "check-cut"
    assert (kept / "pytest.log").read_text().startswith("tests/gpu/test_x.py")
    gpu_check_runner.logs_tarball(fake.out)
    with tarfile.open(fake.out / "gpu_logs.tgz") as tar:
        names = tar.getnames()
    for want in ("pytest.log", "metrics.jsonl", "trainer.log"):
        assert any(n.startswith("gpu_logs/check-cut/") and n.endswith(want) for n in names), (want, names)
    assert not any(n.endswith("model.safetensors") for n in names), names


def test_the_tarball_keeps_the_inductor_kernels_whose_asserts_a_log_prints(tmp_path, monkeypatch):
    """A device-side assert names an Inductor kernel in the machine's cache: the tarball takes that file
    (the name of its fused ops says which op indexed out of bounds), not the cache's others."""
    monkeypatch.setattr(gpu_check_machine, "WORK", tmp_path / "work")
    cache = tmp_path / "torchinductor_root" / "6n"
    cache.mkdir(parents=True)
    (cache / "c6nq.py").write_text("def triton_poi_fused_index_sort(): pass\n")
    (cache / "cother.py").write_text("")
    run = tmp_path / "work" / "gpu_logs" / "check-x" / "run"
    run.mkdir(parents=True)
    (run / "stdout-5.log").write_text(
        "step 4\n" + f"{cache}/c6nq.py:70: unknown: block: [2576,0,0], thread: [32,0,0] Assertion "
        "`index out of bounds: 0 <= tmp26 < ks2` failed.\n" * 3)
    gpu_check_runner.logs_tarball(tmp_path)
    with tarfile.open(tmp_path / "gpu_logs.tgz") as tar:
        names = tar.getnames()
        assert b"fused_index_sort" in tar.extractfile("inductor_kernels/c6nq.py").read()
    assert [n for n in names if n.startswith("inductor_kernels/")] == ["inductor_kernels/c6nq.py"], names
