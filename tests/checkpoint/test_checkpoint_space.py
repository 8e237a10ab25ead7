"""Checkpoints and disk space: what a full disk does to DCP, the bytes a save writes, the start-up
line, the save that does not fit, and the write that fails anyway (on a real full filesystem where
the machine lets us mount one, and by ENOSPC injected at the write everywhere)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import warnings
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from spmd_rl.checkpoint import space as space
from spmd_rl.checkpoint.checkpointer import WRITE_THREADS, Checkpointer, ModelAndOptimizer
from spmd_rl.checkpoint.writes import os_error
from tests.helpers import ROOT
from tests.helpers.dist_utils import run_distributed

MB = 2**20


def make_model(width: int = 512, seed: int = 0, step: bool = True):
    """4 x width x width fp32 weights (+ biases) and AdamW; `step`: its state exists."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save_into(root: str, threads: int, async_save: bool) -> BaseException | None:
    """DCP's save of 12 MiB of model + AdamW state into `root`, as the checkpointer calls it but with
    torch's own FileSystemWriter of `threads` threads; the failure of the first failed rank, or None."""
    model, opt = make_model()
    state = {"actor": ModelAndOptimizer(model, opt).state_dict()}
    writer = dcp.FileSystemWriter(root, thread_count=threads)
    try:
        if async_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                upload = dcp.async_save(state, checkpoint_id=root, storage_writer=writer)
            getattr(upload, "upload_completion", upload).result()
        else:
            dcp.save(state, checkpoint_id=root, storage_writer=writer)
    except dcp.CheckpointException as e:
        return next(iter(e.failures.values()))[0]
    return None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_makes_dcp_fail_with_the_zip_writers_unexpected_pos(small_filesystem, async_save):
    """`RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598` (a 1.5B
    save, 34 GB free) is a full disk: DCP's save of 12 MiB into a 4 MiB filesystem, synchronous
    and asynchronous, fails with torch's zip writer's error, and the OSError behind it
    is ENOSPC (one writer thread: that thread's first failed write is always inside torch.save).
    (What the checkpointer makes of it: the tests below.)"""
    error = save_into(small_filesystem.mount(4 * MB), 1, async_save)
    assert type(error) is RuntimeError and "inline_container.cc" in str(error) and "unexpected pos" in str(error), error
    assert os_error(error) is not None and os_error(error).errno == errno.ENOSPC, repr(error.__context__)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP's writer thread dies
def test_with_several_writer_threads_a_full_disk_is_an_error_or_a_metadata_without_data(small_filesystem):
    """With the checkpointer's writer threads (WRITE_THREADS, here at least 2), what DCP reports
    depends on which thread fills the disk: the zip writer's error, or a plain ENOSPC from a file's
    last flush, or -- when only an extra thread failed -- nothing at all: its thread dies, and the
    .metadata DCP writes lists items without data (verify() catches that)."""
    from spmd_rl.checkpoint.checkpointer import verify

    root = small_filesystem.mount(4 * MB)
    error = save_into(root, max(2, WRITE_THREADS), async_save=False)
    if error is None:
        assert "items without data" in (verify(root, 1) or ""), verify(root, 1)
    else:
        assert os_error(error) is not None and os_error(error).errno == errno.ENOSPC, repr(error)


# --------------------------------------------------------------------------- helpers

def train_step(model, opt):
    width = model[0].in_features
    model(torch.randn(2, width)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer_state(step: int) -> dict:
    return {"step": step, "torch_rng": torch.get_rng_state()}  # about the size of the trainer's


def files_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(path) for n in names)


def start_up_size(model, opt, group=None):
    """The start-up figure: what Trainer.__init__ measures (before any step on a fresh run)."""
    return space.measure({"actor": ModelAndOptimizer(model, opt).planned_state()}, trainer_state(0), group)


class VirtualDisk:
    """checkpoint_space.free_space as a filesystem of `capacity` bytes holding only `root`'s files."""

    def __init__(self, monkeypatch, root, capacity: int):
        self.root, self.capacity = str(root), capacity
        monkeypatch.setattr(space, "free_space", lambda path: (self.capacity - files_bytes(self.root), "/virtual"))


class FullAfter:
    """A stream whose writes fail with ENOSPC once the disk's budget is spent (the rest delegated);
    with `extra_threads_only`, only in DCP's extra writer threads."""

    def __init__(self, stream, disk):
        self._stream, self._disk = stream, disk

    def write(self, data):
        n = memoryview(data).nbytes
        extra = "_write_files_from_queue" in threading.current_thread().name
        if self._disk.budget < n and (extra or not self._disk.extra_threads_only):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._disk.budget -= n
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)


class InjectedFullDisk:
    """Every file DCP writes goes through FullAfter: `budget` bytes, then ENOSPC (torch.save's zip
    writer then fails as on a real full disk)."""

    def __init__(self, monkeypatch, budget: float = float("inf"), extra_threads_only: bool = False):
        from torch.distributed.checkpoint.filesystem import FileSystem

        self.budget, self.extra_threads_only = budget, extra_threads_only
        create = FileSystem.create_stream
        disk = self

        @contextlib.contextmanager
        def create_stream(fs, path, mode):
            with create(fs, path, mode) as stream:
                yield FullAfter(stream, disk) if "w" in mode else stream

        monkeypatch.setattr(FileSystem, "create_stream", create_stream)


def log_lines(caplog, level=logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= level]


# --------------------------------------------------------------------------- the bytes of a save

def test_the_start_up_estimate_is_within_5_percent_of_the_bytes_a_save_writes(tmp_path):
    """One rank: the start-up figure (a fresh AdamW without state: its moments stood in for) against
    the files of a real save after a step. Measuring must not create the optimizer's state (DCP's
    get_state_dict would, by stepping it: Adam's step count would be one ahead)."""
    model, opt = make_model(width=256, step=False)
    size = start_up_size(model, opt)
    assert not opt.state, "measuring created the optimizer's state"
    train_step(model, opt)
    ck = Checkpointer(str(tmp_path), keep_last=1)
    assert ck.save(1, {"actor": ModelAndOptimizer(model, opt)}, trainer_state(1)) is not None
    written = files_bytes(tmp_path / "step_1")
    assert size.total == pytest.approx(written, rel=0.05), (size, written)
    assert size.per_rank == size.total and size.ranks == 1
    # the save measures its real state dict: the same figure
    real = space.measure({"actor": ModelAndOptimizer(model, opt).state_dict()}, trainer_state(1))
    assert real.total == pytest.approx(size.total, rel=0.01), (real, size)


def _estimate_on_two_ranks(rank, world, root):
    for fsdp_size in (0, 1):  # sharded over both ranks; 2 replicas of 1 rank (HSDP)
        _estimate_sharded(rank, world, os.path.join(root, str(fsdp_size)), fsdp_size)


def _estimate_sharded(rank, world, root, fsdp_size):
    from torch.distributed.fsdp import fully_shard

    from spmd_rl.runtime.distributed import fsdp_mesh

    mesh = fsdp_mesh("cpu", world, fsdp_size)
    model, opt = make_model(width=256, step=False)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # over the sharded parameters
    ck = Checkpointer(root, keep_last=1)
    size = start_up_size(model, opt, ck._group)
    train_step(model, opt)
    assert ck.save(1, {"actor": ModelAndOptimizer(model, opt)}, trainer_state(1)) is not None
    ck.close()
    if rank == 0:
        step = os.path.join(root, "step_1")
        mine = [sum(os.path.getsize(os.path.join(step, n)) for n in os.listdir(step)
                    if n.startswith(f"__{r}_") or n == f"trainer_state_rank{r}.pt") for r in range(world)]
        assert size.total == pytest.approx(files_bytes(step), rel=0.05), (size, files_bytes(step))
        assert size.per_rank == pytest.approx(max(mine), rel=0.05), (size, mine)
        assert size.ranks == 2 and size.per_rank < 0.6 * size.total, (fsdp_size, size)  # each rank writes about half


def test_the_start_up_estimate_is_within_5_percent_on_two_ranks(tmp_path):
    """2 gloo ranks, sharded (FSDP: each rank writes its shards) and replicated (HSDP with 2 replicas
    of 1 rank: DCP writes each replicated tensor once, on either rank): total and per rank."""
    run_distributed(_estimate_on_two_ranks, 2, str(tmp_path))


# --------------------------------------------------------------------------- the start-up line

GB = 10**9


@pytest.mark.parametrize("free, keep_last, level, expect", [
    (100 * GB, 2, logging.INFO, "30.5 GB on disk at the peak of a save (2 kept + 1 being written with 5% headroom; "
                                "20.5 GB if the older ones it replaces are removed first); 100.0 GB free on /data "
                                "(/data/ckpt)"),
    (25 * GB, 2, logging.INFO, "fits, by removing the oldest checkpoint before a save"),
    (25 * GB, 3, logging.WARNING, "DOES NOT FIT, saves will be skipped"),
    (15 * GB, 2, logging.WARNING, "Fix: trainer.checkpoint_dir on a filesystem with 30.5 GB free, or "
                                  "trainer.save_every = -1 (no checkpoints)"),
    (9 * GB, 2, logging.WARNING, "DOES NOT FIT, not even one save fits"),
])
def test_the_start_up_line_says_whether_the_checkpoints_fit(free, keep_last, level, expect):
    size = space.CheckpointSize(total=10 * GB, per_rank=5 * GB, ranks=2)  # a save: 10.5 GB with headroom
    got_level, line = space.plan_line(size, keep_last, free, 0, "/data/ckpt", "/data")
    assert line.startswith(f"checkpoints: 10.0 GB a save (5.0 GB per rank x 2), keep_last {keep_last}: ")
    assert got_level == level and expect in line, line


def test_the_start_up_line_offers_the_keep_last_that_fits():
    size = space.CheckpointSize(total=10 * GB, per_rank=10 * GB, ranks=1)
    level, line = space.plan_line(size, 4, 26 * GB, 10 * GB, "/c", "/")  # 36 GB of room, 10 GB held already
    assert level == logging.WARNING and "26.0 GB free on / (/c), and 10.0 GB of checkpoints there:" in line, line
    assert line.endswith("Fix: trainer.checkpoint_dir on a filesystem with 50.5 GB free, or trainer.keep_last = 3, "
                         "or trainer.save_every = -1 (no checkpoints)"), line


def test_the_qwen_1_5b_preset_on_a_disk_with_34_gb_free():
    """configs/qwen1.5b-gsm8k.toml (fp32 masters + AdamW, keep_last 2) on the disk where that error
    was seen (34 GB free): what its
    start-up line says, from its shape (meta device: nothing allocated). DCP writes the tied
    lm_head.weight as well as the embedding: 19.5 GB a save, not the 18.5 GB of 12 bytes a parameter."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from spmd_rl.config.run_config import load_config
    from spmd_rl.model.loading import ARCH_PRESETS

    cfg = load_config(os.path.join(ROOT, "configs", "qwen1.5b-gsm8k.toml"))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**ARCH_PRESETS["qwen2-1.5b"]), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.actor.lr)
    size = start_up_size(model, opt)
    level, line = space.plan_line(size, cfg.trainer.keep_last, 34 * GB, 0, cfg.checkpoint_dir, "/")
    assert level == logging.WARNING, line
    assert line.startswith("checkpoints: 19.5 GB a save (19.5 GB per rank x 1), keep_last 2: 59.4 GB on disk at the "
                           "peak of a save (2 kept + 1 being written with 5% headroom; 39.9 GB if the older ones it "
                           "replaces are removed first); 34.0 GB free on / (runs/qwen1.5b-gsm8k-grpo/checkpoints): "
                           "DOES NOT FIT, saves will be skipped"), line


# --------------------------------------------------------------------------- a save that does not fit

def mount_or_virtual(kind, small_filesystem, monkeypatch, tmp_path, capacity: int) -> tuple[str, Any]:
    """A checkpoint root on a filesystem of `capacity` bytes: a real tmpfs, or a VirtualDisk.
    Returns (root, resize(capacity))."""
    if kind == "tmpfs":
        root = small_filesystem.mount(capacity)
        return root, small_filesystem.resize
    root = str(tmp_path / "virtual")
    disk = VirtualDisk(monkeypatch, root, capacity)
    return root, lambda c: setattr(disk, "capacity", c)


@pytest.mark.parametrize("kind", ["tmpfs", "virtual"])
def test_a_save_that_does_not_fit_is_skipped_with_one_line_and_the_next_one_tries_again(
        tmp_path, small_filesystem, monkeypatch, caplog, kind):
    """Room for one checkpoint and a half: step 1 is written; step 2 is skipped with one warning
    line (needed, free, where), training goes on, a resume would load step 1 (bit for bit); once
    there is room again, step 3 is written."""
    model, opt = make_model(width=256)
    size = space.measure({"actor": ModelAndOptimizer(model, opt).state_dict()}, trainer_state(1))
    root, resize = mount_or_virtual(kind, small_filesystem, monkeypatch, tmp_path, int(1.6 * size.total))
    ck = Checkpointer(root, keep_last=2, async_save=True)
    models = {"actor": ModelAndOptimizer(model, opt)}
    assert ck.save(1, models, trainer_state(1)) is not None and ck.wait()
    saved = snapshot(model)
    train_step(model, opt)
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        assert ck.save(2, models, trainer_state(2)) is None
    lines = log_lines(caplog)
    assert len(lines) == 1, lines
    where = root if kind == "tmpfs" else f"/virtual ({root})"  # the filesystem, and where on it
    assert re.fullmatch(rf"checkpoint of step 2 skipped: it needs [\d.]+ MB \([\d.]+ MB \+ 5%\), [\d.]+ MB free on "
                        rf"{re.escape(where)}; step_1 stays the latest; training goes on, the next save tries "
                        r"again\. Fix: .*", lines[0]), lines[0]
    assert sorted(os.listdir(root)) in (["latest", "step_1"], ["latest", "lost+found", "step_1"])
    path = ck.find_resume("auto")
    assert path == os.path.join(root, "step_1")
    fresh, fresh_opt = make_model(width=256, seed=1)
    Checkpointer(root, keep_last=2).load(path, {"actor": ModelAndOptimizer(fresh, fresh_opt)})
    for k, v in snapshot(fresh).items():
        assert torch.equal(v, saved[k]), k
    train_step(model, opt)
    resize(int(3.5 * size.total))
    assert ck.save(3, models, trainer_state(3)) is not None
    ck.close()
    assert ck.complete_steps() == [1, 3] and ck.find_resume("auto") == os.path.join(root, "step_3")


@pytest.mark.parametrize("kind", ["tmpfs", "virtual"])
@pytest.mark.parametrize("keep_last, capacity, kept", [(3, 3.5, [2, 3, 4]), (2, 2.9, [2, 3]), (1, 1.6, [1])],
                         ids=["keep3", "keep2", "keep1"])
def test_a_save_short_of_room_first_removes_what_it_replaces_never_the_latest(
        tmp_path, small_filesystem, monkeypatch, caplog, kind, keep_last, capacity, kept):
    """Room for `capacity` checkpoints: once keep_last of them are on disk, the next save removes
    the oldest first (only as many as it needs, never the newest keep_last - 1, never the latest)
    and is written. With keep_last 1 the only older one is the latest: that save is skipped."""
    model, opt = make_model(width=256)
    size = space.measure({"actor": ModelAndOptimizer(model, opt).state_dict()}, trainer_state(1))
    root, _ = mount_or_virtual(kind, small_filesystem, monkeypatch, tmp_path, int(capacity * size.total))
    ck = Checkpointer(root, keep_last=keep_last)
    models = {"actor": ModelAndOptimizer(model, opt)}
    for step in range(1, keep_last + 1):
        assert ck.save(step, models, trainer_state(step)) is not None
    train_step(model, opt)
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        written = ck.save(keep_last + 1, models, trainer_state(keep_last + 1))
    lines = [line for line in log_lines(caplog, logging.INFO) if "removed before writing" in line]
    if keep_last == 1:
        assert written is None and ck.complete_steps() == kept and not lines
        assert "checkpoint of step 2 skipped" in log_lines(caplog)[0]
        return
    assert written is not None and ck.complete_steps() == kept, ck.complete_steps()
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint step_1 removed before writing step_{keep_last + 1}, to "
                                                   "make room"), lines
    assert ck.find_resume("auto") == os.path.join(root, f"step_{keep_last + 1}")


# --------------------------------------------------------------------------- a write that fails anyway

ERRNO_LINE = re.compile(r"checkpoint of step 2 not written: rank (\d): \[Errno 28\] No space left on device \(ENOSPC\) "
                        r"writing (\S+); [\d.]+ [MG]B free on .+ when it failed; removed (\S+), step_1 stays the "
                        r"latest; training goes on")


def assert_failed_write(caplog, capfd, root, ck, rank_of_failure=0):
    lines = log_lines(caplog)
    assert len(lines) == 1, lines
    m = ERRNO_LINE.fullmatch(lines[0])
    assert m and int(m.group(1)) == rank_of_failure and m.group(3) == os.path.join(root, "step_2.tmp"), lines[0]
    assert m.group(2).startswith(os.path.join(root, "step_2.tmp") + os.sep), lines[0]
    out, err = capfd.readouterr()
    for text in (out + err, lines[0]):  # torch's zip writer's error is never what the user sees
        assert "unexpected pos" not in text and "inline_container" not in text and "Traceback" not in text, text[-3000:]
    assert not os.path.exists(os.path.join(root, "step_2.tmp")) and not os.path.exists(os.path.join(root, "step_2"))
    assert ck.latest() == os.path.join(root, "step_1") and ck.find_resume("auto") == os.path.join(root, "step_1")


def save_and_settle(ck, step, models):
    """The save of `step` to its end: its path, or None when it was not written."""
    path = ck.save(step, models, trainer_state(step))
    return path if path is not None and ck.wait() else None


@pytest.mark.parametrize("async_save", [False, True])
def test_a_write_that_fails_on_a_full_disk_is_one_errno_line_and_no_partial_directory(
        tmp_path, monkeypatch, caplog, capfd, async_save):
    """ENOSPC injected at the write (the disk fills up after the space check): torch.save's zip
    writer fails as on a real full disk, in DCP's writer threads. One error line names the errno
    and the file; no partial directory; step 1 stays the latest; the next save is written."""
    disk = InjectedFullDisk(monkeypatch)
    model, opt = make_model(width=256)
    models = {"actor": ModelAndOptimizer(model, opt)}
    root = str(tmp_path)
    ck = Checkpointer(root, keep_last=3, async_save=async_save)
    assert save_and_settle(ck, 1, models)
    disk.budget = 2 * MB  # of about 3 MB
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        assert save_and_settle(ck, 2, models) is None
    assert_failed_write(caplog, capfd, root, ck)
    disk.budget = float("inf")
    assert save_and_settle(ck, 3, models)
    ck.close()
    assert ck.complete_steps() == [1, 3]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_write_that_fills_a_real_filesystem_is_one_errno_line_and_no_partial_directory(
        small_filesystem, monkeypatch, caplog, capfd, async_save):
    """The same on a real full tmpfs: the estimate is made to lie (a tenth of the bytes), so the
    space check lets a save start that the filesystem cannot hold."""
    model, opt = make_model(width=256)
    models = {"actor": ModelAndOptimizer(model, opt)}
    size = space.measure({"actor": models["actor"].state_dict()}, trainer_state(1))
    root = small_filesystem.mount(int(1.6 * size.total))
    ck = Checkpointer(root, keep_last=3, async_save=async_save)
    assert save_and_settle(ck, 1, models)
    measure = space.measure
    monkeypatch.setattr(space, "measure", lambda *a: measure(*a)._replace(total=size.total // 10))
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        assert save_and_settle(ck, 2, models) is None
    assert_failed_write(caplog, capfd, root, ck)
    ck.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # DCP's writer thread dies
def test_a_write_failing_only_in_an_extra_writer_thread_is_caught(tmp_path, monkeypatch, caplog, capfd):
    """DCP does not see a failure in its extra writer threads (FileSystemWriter(thread_count > 1)):
    the thread dies, the save returns, its .metadata lists items without data -- verify() says so.
    The checkpointer's writer records the failure: the save is not written, one errno line."""
    import spmd_rl.checkpoint.saving as saving
    from spmd_rl.checkpoint.checkpointer import verify

    disk = InjectedFullDisk(monkeypatch, budget=0, extra_threads_only=True)
    assert save_into(str(tmp_path / "torch"), 2, async_save=False) is None  # DCP: no error
    assert re.fullmatch(r"its DCP \.metadata lists \d+ items without data \(a writer failed\)",
                        verify(str(tmp_path / "torch"), 1) or ""), verify(str(tmp_path / "torch"), 1)

    monkeypatch.setattr(saving, "WRITE_THREADS", 2)
    root = str(tmp_path / "ours")
    model, opt = make_model(width=256)
    models = {"actor": ModelAndOptimizer(model, opt)}
    ck = Checkpointer(root, keep_last=3)
    disk.budget = float("inf")
    assert save_and_settle(ck, 1, models)
    disk.budget = 0
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="spmd_rl.checkpoint.checkpointer"):
        assert save_and_settle(ck, 2, models) is None
    assert_failed_write(caplog, capfd, root, ck)


def test_the_zip_writers_error_is_a_write_error_even_when_its_os_error_is_lost():
    """DCP pickles failures to share them between ranks, which drops the OSError behind the zip
    writer's error: it still counts as a failed write, and its line does not repeat it."""
    import pickle

    from spmd_rl.checkpoint.writes import describe, is_write_error

    try:
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as e:
        zip_error = e
    assert describe(zip_error, "/c/f") == "[Errno 28] No space left on device (ENOSPC) writing /c/f"
    lost = pickle.loads(pickle.dumps(zip_error))
    assert lost.__context__ is None and is_write_error(lost) and not is_write_error(RuntimeError("other"))
    assert describe(lost, "/c/f") == "writing /c/f failed (its OS error was lost on the way; see the free space)"


def _write_fails_on_rank_1(rank, world, root):
    """Rank 1's disk fills up (ENOSPC at its write), rank 0's write goes fine: both ranks learn the
    save failed, rank 0 logs rank 1's errno, step 1 stays the latest, the next save is written."""
    import _pytest.monkeypatch

    mp = _pytest.monkeypatch.MonkeyPatch()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("spmd_rl.checkpoint.checkpointer").addHandler(handler)
    logging.getLogger("spmd_rl.checkpoint.checkpointer").setLevel(logging.INFO)
    disk = InjectedFullDisk(mp)
    model, opt = make_model(width=256)
    models = {"actor": ModelAndOptimizer(model, opt)}
    ck = Checkpointer(root, keep_last=3, async_save=True)
    assert save_and_settle(ck, 1, models)
    if rank == 1:
        disk.budget = 0.5 * MB
    assert save_and_settle(ck, 2, models) is None
    lines = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    if rank == 0:
        assert len(lines) == 1 and ERRNO_LINE.fullmatch(lines[0]).group(1) == "1", lines
    else:
        assert not lines, lines
    disk.budget = float("inf")
    assert save_and_settle(ck, 3, models)
    ck.close()
    assert ck.complete_steps() == [1, 3]
    mp.undo()


def test_a_write_that_fails_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    run_distributed(_write_fails_on_rank_1, 2, str(tmp_path))


# --------------------------------------------------------------------------- the trainer's last save

class FakeCheckpointer:
    def wait(self):
        return True

    def latest(self):
        return "/ckpt/step_2"


@pytest.mark.parametrize("stop_at, written, status", [
    (None, True, "finished"), (None, False, "not saved"), (3, True, "preempted"), (3, False, "not saved")])
def test_the_last_save_not_written_ends_the_run_as_not_saved(monkeypatch, caplog, tmp_path, stop_at, written, status):
    """Trainer.fit's last save, at the end of training or on a stop signal, that is not written (no
    room, or a failed write): "not saved" (exit status 4) with a line naming the latest complete
    checkpoint, never "finished" or "preempted" (the requeue status). Periodic saves that are not
    written (steps 2 and 4 here) change nothing: training goes on."""
    import spmd_rl.trainer as trainer_module
    from spmd_rl.config.run_config import Config
    from spmd_rl.exit_codes import EXIT_NOT_SAVED

    cfg = Config()
    cfg.trainer.total_steps, cfg.trainer.save_every = 5, 2
    t = trainer_module.Trainer.__new__(trainer_module.Trainer)
    t.cfg, t.step, t.val_data, t.run_dir = cfg, 0, None, str(tmp_path)
    t.env = type("Env", (), {"world_size": 1, "is_main": True})()
    t.samples = type("Samples", (), {"path": str(tmp_path / "samples.jsonl")})()
    t.checkpointer = FakeCheckpointer()
    saves = []

    def train_step():
        t.step += 1
        return {}

    t.train_step = train_step
    t.save_checkpoint = lambda wait=False: saves.append(t.step) or (t.step not in (2, 4) and written)
    t.startup = type("Clock", (), {"take_metrics": lambda self: {}})()
    t.metrics = type("Metrics", (), {"log": lambda self, step, m: None, "jsonl": str(tmp_path / "metrics.jsonl")})()
    t.stop = type("Stop", (), {"requested": lambda self: stop_at is not None and t.step >= stop_at})()
    monkeypatch.setattr(trainer_module, "summary_line", lambda *a: "")
    with caplog.at_level(logging.INFO, logger="spmd_rl"):
        assert t.fit() == status
    assert saves == ([2, 4, 5] if stop_at is None else [2, 3])
    from spmd_rl.telemetry.run_summary import STATUS  # the end-of-run summary says how it ended

    assert f"run {STATUS[status]} at step {t.step}/5\n  validation: none" in caplog.text, caplog.text
    if status == "not saved":
        when = "at the end of training at step 5" if stop_at is None else "on a stop signal at step 3"
        assert (f"stopped {when} without its checkpoint (see the line above): the latest complete checkpoint is "
                f"/ckpt/step_2; exiting with status {EXIT_NOT_SAVED}") in caplog.text, caplog.text


# --------------------------------------------------------------------------- whole runs

def tiny_checkpoint_bytes() -> int:
    """The tiny-cpu preset's checkpoint on one rank, as its start-up line measures it."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from spmd_rl.model.loading import ARCH_PRESETS

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**ARCH_PRESETS["tiny"]), dtype=torch.float32)
    return start_up_size(model, torch.optim.AdamW(model.parameters())).total


def test_a_run_whose_checkpoints_do_not_fit_warns_goes_on_exits_4_and_resumes(tmp_path, small_filesystem):
    """trainer.checkpoint_dir on a real filesystem with room for one checkpoint and a half (one
    rank): the start-up line warns, step 1 is written, steps 2 and 3 are skipped with a line each,
    training goes on to step 3, and the run exits 4 (its last checkpoint is not written). With room
    again, the same command resumes from step 1, the latest complete checkpoint, and finishes (0).
    Under torchrun, which exits 1 for any failing rank, the rank records its own 4 where a SLURM task
    reads it (preemption.EXIT_STATUS_DIR_ENV): that task does not requeue, even after a stop signal."""
    from launch.task import node_exit_status
    from spmd_rl.exit_codes import EXIT_NOT_SAVED
    from spmd_rl.runtime.preemption import EXIT_STATUS_DIR_ENV, recorded_exit_statuses
    from tests.helpers.cpu_runs import run_cmd, tiny_cmd

    size = tiny_checkpoint_bytes()
    ckpt = small_filesystem.mount(int(1.6 * size))
    run_dir = tmp_path / "run"
    cmd = tiny_cmd(run_dir, "trainer.total_steps=3", "trainer.save_every=1",
                   f"trainer.checkpoint_dir={ckpt}", "trainer.tensorboard=false", nproc=1)
    statuses = tmp_path / "exit_status"
    p = run_cmd(cmd, **{EXIT_STATUS_DIR_ENV: str(statuses)})
    out = p.stdout + p.stderr
    # torchrun exits 1 when a rank fails; the rank's own status is in its summary, and recorded
    assert p.returncode == 1 and re.search(rf"exitcode\s*:\s*{EXIT_NOT_SAVED}\b", out), out[-3000:]
    assert recorded_exit_statuses(str(statuses)) == {0: EXIT_NOT_SAVED}
    assert node_exit_status(p.returncode, recorded_exit_statuses(str(statuses)), stopped=True) == EXIT_NOT_SAVED
    start = [line for line in out.splitlines() if "checkpoints: " in line and "a save (" in line]
    assert len(start) == 1 and "WARNING" in start[0] and "DOES NOT FIT" in start[0], start
    for step in (2, 3):
        assert out.count(f"checkpoint of step {step} skipped: it needs") == 1, out[-3000:]
    assert "step 3/3" in out and f"stopped at the end of training at step 3 without its checkpoint (see the line " \
        f"above): the latest complete checkpoint is {ckpt}/step_1; exiting with status {EXIT_NOT_SAVED}" in out
    assert sorted(os.listdir(ckpt)) == [".lock", "latest", "step_1"]
    assert not (run_dir / "checkpoints").exists()

    small_filesystem.resize(10 * size)
    p = run_cmd(cmd, **{EXIT_STATUS_DIR_ENV: str(statuses)})
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert recorded_exit_statuses(str(statuses)) == {0: 0}
    assert f"resumed from {ckpt}/step_1 at step 1" in out, out[-3000:]
    assert (open(os.path.join(ckpt, "latest")).read().strip()) == "step_3"


def test_a_run_whose_save_fails_writing_names_the_errno_and_goes_on(tmp_path):
    """The write of step 2 fails with ENOSPC (SPMD_RL_CHECKPOINT_FAULT; one rank: the agreement of
    two is test_a_write_that_fails_on_one_rank_...): one error line with the errno, no step_2 left,
    and the run goes on: step 3 is written, exit 0."""
    import subprocess

    from tests.helpers.cpu_runs import tiny_cmd

    run_dir = tmp_path / "run"
    cmd = tiny_cmd(run_dir, "trainer.total_steps=3", "trainer.save_every=1",
                   "trainer.tensorboard=false", nproc=1)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, SPMD_RL_CHECKPOINT_FAULT="fail@2")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    ckpts = run_dir / "checkpoints"
    lines = [line for line in out.splitlines() if "checkpoint of step 2" in line]
    assert len(lines) == 1, lines
    assert (f"checkpoint of step 2 not written: rank 0: [Errno 28] No space left on device (injected: "
            f"SPMD_RL_CHECKPOINT_FAULT=fail@2) (ENOSPC) writing {ckpts}/step_2.tmp;") in lines[0], lines
    assert f"removed {ckpts}/step_2.tmp, step_1 stays the latest; training goes on" in lines[0], lines
    assert sorted(os.listdir(ckpts)) == ["latest", "step_1", "step_3"]
    assert (ckpts / "latest").read_text().strip() == "step_3"
