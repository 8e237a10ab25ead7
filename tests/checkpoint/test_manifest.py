"""A checkpoint records its format and the package version (spmd_rl/checkpoint/manifest.py): an older
format is upgraded step by step as it is read, a newer one is refused in one line naming both versions."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from spmd_rl import __version__
from spmd_rl.checkpoint import manifest as manifest_format
from spmd_rl.checkpoint.checkpointer import Checkpointer, CheckpointError, run_dir_of, saved_world_size
from spmd_rl.export import main as export
from tests.checkpoint.test_checkpointer import save_steps
from tests.checkpoint.test_old_checkpoint import OLD_RUNS

STEP_2 = os.path.join(OLD_RUNS, "0.1.0-9d108d1", "checkpoints", "step_2")


def test_a_save_records_todays_format_and_package_version(tmp_path):
    save_steps(tmp_path, [1], async_save=False)
    with open(tmp_path / "step_1" / "manifest.json") as f:
        written = json.load(f)
    assert (written["format"], written["spmd_rl_version"], written["step"]) == (2, __version__, 1)
    assert manifest_format.read(str(tmp_path / "step_1")) == written


def test_a_format_1_manifest_of_9d108d1_is_upgraded_as_it_is_read():
    with open(os.path.join(STEP_2, "manifest.json")) as f:
        on_disk = json.load(f)
    assert "format" not in on_disk  # what 9d108d1 wrote
    assert manifest_format.read(STEP_2) == {**on_disk, "format": 2, "spmd_rl_version": "0.1.0"}
    assert saved_world_size(STEP_2) == 2 and run_dir_of(STEP_2) == on_disk["run_dir"]


def test_a_checkpoint_without_manifest_is_described_by_its_directory(tmp_path):
    path = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(STEP_2, path, ignore=shutil.ignore_patterns("manifest.json"))
    assert manifest_format.read(str(path)) == {"format": 2, "spmd_rl_version": "0.1.0", "step": 2, "world_size": 2,
                                               "run_dir": str(tmp_path / "run"), "files": {}}
    assert Checkpointer(str(path.parent), keep_last=2).find_resume("auto") == str(path)


def test_every_older_format_has_its_upgrade_step():
    assert sorted(manifest_format.UPGRADES) == list(range(1, manifest_format.FORMAT))


@pytest.fixture
def newer_checkpoint(tmp_path):
    """The 9d108d1 checkpoint as a later version, of format FORMAT + 1, would have labelled it."""
    path = tmp_path / "run" / "checkpoints" / "step_2"
    shutil.copytree(STEP_2, path)
    with open(path / "manifest.json") as f:
        manifest = json.load(f)
    manifest.update(format=manifest_format.FORMAT + 1, spmd_rl_version="9.1.0")
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path.parent / "latest").write_text("step_2\n")
    return path


def expect_newer_format_line(message):
    assert f"written by spmd_rl 9.1.0 in checkpoint format {manifest_format.FORMAT + 1}" in message
    assert f"this spmd_rl {__version__} reads formats up to {manifest_format.FORMAT}" in message
    assert "\n" not in message


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_checkpoint_of_a_newer_format_is_refused_in_one_line(newer_checkpoint, resume):
    ck = Checkpointer(str(newer_checkpoint.parent), keep_last=2)
    with pytest.raises(CheckpointError) as e:  # never "broken", never a fallback to an older one
        ck.find_resume("auto" if resume == "auto" else str(newer_checkpoint))
    expect_newer_format_line(str(e.value))


def test_the_export_refuses_a_newer_format_in_one_line(newer_checkpoint, tmp_path, capsys):
    assert export(["--checkpoint", str(newer_checkpoint), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: checkpoint ")
    expect_newer_format_line(err)
