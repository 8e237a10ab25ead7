"""Every mistake a user can fix ends the run with one line on rank 0 and exit code 2.

Config keys are checked in-process (fast, all of them); a few cases run end to end under
torchrun with 2 ranks, as users run it, asserting the exit code, the message once, no traceback
but torchrun's own failure block, and that an existing run's files were not touched.
"""

import fcntl
import json
import os
import re
import subprocess
import sys
import typing

import pytest

from spmd_rl import preflight
from spmd_rl.config.reward import RewardConfig
from spmd_rl.config.run_config import SECTIONS, load_config
from spmd_rl.data.rewards import RewardError, RewardFunction
from spmd_rl.errors import ConfigError
from tests.helpers import ROOT
from tests.helpers.cpu_runs import run_cmd, tiny_cmd
from tests.helpers.dist_utils import run_distributed

TINY = os.path.join(ROOT, "configs", "tiny-cpu.toml")


def check(overrides, world=2):
    cfg = load_config(TINY, overrides)
    preflight.validate(cfg, world_size=world, gpus_per_node=world)
    return cfg


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_every_numeric_key_rejects_a_negative_value_naming_the_key(section):
    """-5 is out of range for every numeric key; the message names that key."""
    cfg = load_config(TINY)
    hints = typing.get_type_hints(type(getattr(cfg, section)))
    extra = ['algorithm.adv_estimator="gae"'] if section == "critic" else []  # critic keys count only with a critic
    for name, hint in hints.items():
        if hint in (int, float):
            with pytest.raises(ConfigError, match=re.escape(f"{section}.{name}")):
                check([f"{section}.{name}={-5 if hint is int else -5.0}", *extra])


@pytest.mark.parametrize("override,message", [
    ("actor.lr=0", "actor.lr = 0.0 must be > 0"),
    ("actor.clip_ratio_low=0", "actor.clip_ratio_low = 0.0 must be > 0: with 0 the clipped loss has no gradient"),
    ("actor.clip_ratio_high=0", "actor.clip_ratio_high = 0.0 must be > 0"),
    ("actor.clip_ratio_low=1", "actor.clip_ratio_low = 1.0 must be < 1"),
    ("actor.lr=nan", "actor.lr = nan must be a finite number"),
    ("actor.betas=[0.9, 1.5]", "actor.betas"),
    ("actor.min_lr_ratio=2", "actor.min_lr_ratio"),
    ("rollout.val_n=0", "rollout.val_n"),
    ("rollout.max_model_len=5", "rollout.max_model_len"),
    ("trainer.log_every=0", "trainer.log_every"),
    ("data.val_batch_size=0", "data.val_batch_size"),
    ("data.synthetic_size=3", "data.synthetic_size"),
    ("algorithm.target_kl=0", "algorithm.target_kl"),
    ('reward.on_error="ignore"', "reward.on_error = 'ignore' is not one of 'fail', 'zero'"),
    ("reward.warn_error_share=1.5", "reward.warn_error_share"),
    ('trainer.experiment_name=" "', "trainer.experiment_name"),
])
def test_out_of_range_values_are_refused_with_the_reason(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check([override])


def test_a_presets_synthetic_task_never_writes_or_replaces_files_the_user_named(tmp_path):
    """The preset's data.synthetic_task beside files of one's own (a typo in the training file's name, an
    existing validation file): refused in one line before anything is written, the user's file byte for
    byte as it was, nothing created beside it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    mine = tmp_path / "mine"
    mine.mkdir()
    pq.write_table(pa.table({"prompt": ["12"] * 64, "data_source": ["synthetic/successor"] * 64,
                             "ground_truth": ["3"] * 64}), mine / "val.parquet")
    before = (mine / "val.parquet").read_bytes()
    with pytest.raises(ConfigError, match=re.escape(
            f"data.train_files names '{mine}/trian.parquet' but data.synthetic_task = 'successor' trains on synthetic "
            f"data the run writes under its own directory ({tmp_path}/run/data/train.parquet): to train on your files "
            'set data.synthetic_task=""')):
        check([f"trainer.run_dir={tmp_path}/run", f'data.train_files=["{mine}/trian.parquet"]',
               f'data.val_files=["{mine}/val.parquet"]'])
    with pytest.raises(ConfigError, match=re.escape(f"data.val_files names '{mine}/val.parquet'")):
        check([f"trainer.run_dir={tmp_path}/run", f'data.val_files=["{mine}/val.parquet"]'])
    assert (mine / "val.parquet").read_bytes() == before and sorted(os.listdir(mine)) == ["val.parquet"]
    assert not (tmp_path / "run").exists()
    # the fix the message names: the user's own files, the typo then reported as such
    with pytest.raises(ConfigError, match=re.escape(f"data file '{mine}/trian.parquet' does not exist")):
        check([f"trainer.run_dir={tmp_path}/run", 'data.synthetic_task=""', f'data.train_files=["{mine}/trian.parquet"]',
               f'data.val_files=["{mine}/val.parquet"]'])


def test_synthetic_data_is_the_runs_own_and_a_changed_recipe_is_refused(tmp_path):
    """Empty or naming the run's own files: both become <run_dir>/data/{train,val}.parquet (as the saved
    config.toml then records); a run directory whose synthetic data was written with another size is refused."""
    from spmd_rl.data.synthetic import write_run_data
    from spmd_rl.preflight.synthetic_data import synthetic_recipe

    run = tmp_path / "run"
    cfg = check([f"trainer.run_dir={run}"])
    own = [str(run / "data" / "train.parquet")], [str(run / "data" / "val.parquet")]
    assert (cfg.data.train_files, cfg.data.val_files) == own
    named = check([f"trainer.run_dir={run}", f'data.train_files=["{own[0][0]}"]', f'data.val_files=["{own[1][0]}"]'])
    assert (named.data.train_files, named.data.val_files) == own
    write_run_data(str(run), synthetic_recipe(cfg))
    check([f"trainer.run_dir={run}"])  # a restart with the same recipe reuses them
    with pytest.raises(ConfigError, match=re.escape(f"{run}/data/synthetic.json says this run's synthetic data was "
                                                    "written as {'task': 'successor', 'train_size': 2048")):
        check([f"trainer.run_dir={run}", "data.synthetic_size=512"])
    file = tmp_path / "a_file"
    file.write_text("")
    with pytest.raises(ConfigError, match="cannot be used"):  # the run directory's own check names it
        check([f"trainer.run_dir={file}/run"])


def test_export_dir_that_exists_is_refused_before_training(tmp_path):
    (tmp_path / "x").write_text("")
    with pytest.raises(ConfigError, match="trainer.export_hf_dir .* exists and is not empty"):
        check([f"trainer.export_hf_dir={tmp_path}"])


def test_paths_the_run_cannot_write_are_refused_before_it_starts(tmp_path, monkeypatch):
    """Found by validation, not by a makedirs/os.replace traceback on every rank after start-up."""
    file = tmp_path / "a_file"
    file.write_text("")
    (tmp_path / "dir").mkdir()
    for overrides, message in [
        ([f"trainer.run_dir={file}"], f"trainer.run_dir = '{file}' cannot be used (it is a file): choose another "
                                      "directory"),
        ([f"trainer.run_dir={file}/run"], f"trainer.run_dir = '{file}/run' cannot be used ('{file}' is a file)"),
        ([f"trainer.export_hf_dir={file}"], f"trainer.export_hf_dir = '{file}' cannot be used (it is a file)"),
        (['data.synthetic_task=""', f'data.train_files=["{tmp_path}/dir"]'], f"data file '{tmp_path}/dir' is a directory: list the Parquet "
                                                   "files in it"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check([f"trainer.run_dir={tmp_path}/run", *overrides])
    check([f"trainer.run_dir={tmp_path}/new/run"])  # to be created: fine
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(tmp_path))  # as a read-only directory
    with pytest.raises(ConfigError, match=re.escape(f"trainer.run_dir = '{tmp_path}/run' cannot be used "
                                                    f"('{tmp_path}' is not writable)")):
        check([f"trainer.run_dir={tmp_path}/run"])


# --------------------------------------------------------------------------- rewards


CUSTOM = '''
def score(data_source, response, ground_truth, extra_info):
    if ground_truth == "7":
        raise KeyError("boom")
    return float("nan") if ground_truth == "8" else 1.0
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return f"{path}:score"


def test_reward_failure_names_source_row_and_response(reward_file):
    fn = RewardFunction(RewardConfig(custom_function=reward_file))
    with pytest.raises(RewardError, match=r"failed on data_source 'src', row 41 \(KeyError: 'boom'\) for the "
                                          r"response 'xxxxx.*\.\.\.'.*reward.on_error = \"zero\""):
        fn(["src", "src"], ["ok", "x" * 500], ["1", "7"], [{}, {}], [40, 41])
    with pytest.raises(RewardError, match=r"row 3 \(RewardError: .*non-finite score nan"):
        fn(["src"], ["r"], ["8"], [{}], [3])
    zero = RewardFunction(RewardConfig(custom_function=reward_file, on_error="zero"), defer_errors=True)
    out = zero(["s"] * 4, ["a", "b", "c", "d"], ["1", "7", "8", "2"], [{}] * 4, [0, 1, 2, 3])
    assert [r["score"] for r in out] == [1.0, 0.0, 0.0, 1.0]
    assert zero.sync_failures().count == 2 and zero.sync_failures().count == 0  # counted once, then reset


def _sync_worker(rank, world, spec):
    fn = RewardFunction(RewardConfig(custom_function=spec), defer_errors=True)
    fn(["s"], ["r"], ["7" if rank == 1 else "1"], [{}], [rank])  # only rank 1's sample fails
    with pytest.raises(RewardError, match="row 1 "):
        fn.sync_failures()  # every rank raises rank 1's message: nobody is left waiting in a collective


def test_reward_failure_on_one_rank_stops_every_rank(reward_file):
    run_distributed(_sync_worker, 2, reward_file)


def _suggested_command_shows(message: str, error: str, cwd) -> None:
    """The message's "run <command> to see the traceback" is a shell command that shows it."""
    command = re.search(r"; run (.*) to see the traceback$", message).group(1)
    p = subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1)], cwd=cwd,
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(cwd)))
    assert p.returncode == 1 and "Traceback" in p.stderr and error in p.stderr, (command, p.stderr)


def test_unimportable_reward_module_is_one_line(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("def score(:\n")
    with pytest.raises(RewardError, match=r"importing .*broken.py' failed with SyntaxError") as e:
        RewardFunction(RewardConfig(custom_function=f"{bad}:score"))
    _suggested_command_shows(str(e.value), "SyntaxError", tmp_path)
    (tmp_path / "needs_dep.py").write_text("import surely_not_installed_dep\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RewardError, match="importing 'needs_dep' failed with ModuleNotFoundError") as e:
            RewardFunction(RewardConfig(custom_function="needs_dep:score"))
    finally:
        sys.path.remove(str(tmp_path))
    _suggested_command_shows(str(e.value), "No module named 'surely_not_installed_dep'", tmp_path)


# --------------------------------------------------------------------------- run directory


def test_run_dir_lock_refuses_a_second_holder_and_dies_with_its_process(tmp_path):
    from spmd_rl.runtime.run_lock import RunDirInUse, RunDirLock

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                               "from spmd_rl.runtime.run_lock import RunDirLock; lock = RunDirLock(sys.argv[2]); lock.acquire(); "
                               "print('locked', flush=True); time.sleep(600)", ROOT, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirInUse, match=f"in use by a running job \\(pid {holder.pid} "):
            RunDirLock(str(tmp_path)).acquire()
    finally:
        holder.kill()  # SIGKILL: no cleanup, like a crashed node process
        holder.wait()
    lock = RunDirLock(str(tmp_path))
    lock.acquire()  # the kernel dropped the dead process's lock
    lock.release()


def test_changed_config_at_resume_is_listed_or_refused(tiny_run):
    from spmd_rl.preflight.resume import check_resume_config

    run_dir, _, _ = tiny_run
    base = [f"trainer.run_dir={run_dir}", "data.synthetic_size=256", "data.val_batch_size=64",
            "trainer.val_every=0", "trainer.total_steps=2"]
    exported = {"trainer.export_hf_dir": (str(tiny_run[2]), "")}  # the export exists now: not asked again
    assert check_resume_config(check(base)) == exported
    changed = check(base + ["trainer.total_steps=4", "actor.lr=1e-3"])
    assert check_resume_config(changed) == {"trainer.total_steps": (2, 4), "actor.lr": (3e-3, 1e-3), **exported}
    for override, key in (("model.seed=5", "model.seed"), ('algorithm.adv_estimator="gae"', "algorithm.adv_estimator"),
                          ('model.dtype="bfloat16"', "model.dtype"), ('model.arch="qwen2-0.5b"', "model.arch")):
        with pytest.raises(ConfigError, match=f"cannot resume with {re.escape(key)} changed"):
            check_resume_config(check(base + [override]))
    assert check_resume_config(check(base + ["model.seed=5", "trainer.resume=none", f"trainer.run_dir={run_dir}x"])) == {}


# --------------------------------------------------------------------------- end to end (torchrun, 2 ranks)


def run_files(run_dir):
    """Every file of a run except its log and lock, with size and modification time."""
    out = {}
    for root, _, files in os.walk(run_dir):
        for f in files:
            p = os.path.join(root, f)
            if f not in ("trainer.log", ".lock"):
                st = os.stat(p)
                out[os.path.relpath(p, run_dir)] = (st.st_size, st.st_mtime_ns)
    return out


def assert_one_line_error(p, message):
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], out[-4000:]
    assert p.returncode != 0 and re.search(r"exitcode\s*: 2 ", out), out[-4000:]
    frames = re.findall(r'File "([^"]+)"', out)
    assert all(f == "<frozen runpy>" or "/torch/distributed/" in f for f in frames), frames  # torchrun's own only
    assert out.count("Traceback (most recent call last)") <= 1, out[-4000:]


def test_torchrun_config_error(tmp_path):
    p = run_cmd(tiny_cmd(tmp_path / "run", "actor.lr=-1"))
    assert_one_line_error(p, "actor.lr = -1.0 must be > 0")
    assert not (tmp_path / "run").exists()


def test_torchrun_refused_engine_kwarg_is_found_before_vllm_or_cuda_is_needed(tmp_path):
    """On this CPU machine, with or without vLLM installed: the config check refuses it first."""
    p = run_cmd(tiny_cmd(tmp_path / "run", 'rollout.engine="vllm"',
                         "rollout.engine_kwargs.max_num_seqs=64"))
    assert_one_line_error(p, "rollout.engine_kwargs.max_num_seqs duplicates rollout.max_num_seqs: set "
                             "rollout.max_num_seqs instead, and remove it from rollout.engine_kwargs")
    assert not (tmp_path / "run").exists()


def test_torchrun_bad_data_leaves_an_existing_run_untouched(tiny_run, tmp_path):
    run_dir, _, _ = tiny_run
    before = run_files(run_dir)
    csv = tmp_path / "train.parquet"
    csv.write_text("prompt,data_source,ground_truth\n384,synthetic/successor,5\n")
    p = run_cmd(tiny_cmd(run_dir, 'data.synthetic_task=""', f'data.train_files=["{csv}"]'))
    assert_one_line_error(p, f"data file '{csv}' is not a readable Parquet file")
    assert run_files(run_dir) == before


def test_torchrun_second_run_on_a_locked_run_dir_is_refused(tiny_run):
    run_dir, _, _ = tiny_run
    before = run_files(run_dir)
    with open(os.path.join(run_dir, ".lock"), "a+") as f:  # as a live run holds it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        p = run_cmd(tiny_cmd(run_dir, "trainer.total_steps=4"))
    assert_one_line_error(p, f"trainer.run_dir '{run_dir}' is in use by a running job")
    assert run_files(run_dir) == before


def test_torchrun_reward_function_failure_names_the_sample(tmp_path, reward_file):
    p = run_cmd(tiny_cmd(tmp_path / "run", f'reward.custom_function="{reward_file}"', "trainer.total_steps=1"))
    assert_one_line_error(p, "failed on data_source 'synthetic/successor', row ")
    assert re.search(r"row \d+ \((KeyError: 'boom'|RewardError: .*non-finite score nan)\) for the response ", p.stderr)


def test_torchrun_tokenizer_larger_than_the_model_vocabulary_stops_before_models_load(tmp_path):
    """Token ids past the embedding would be a device-side assert mid-run on GPU: refused at start-up,
    before the random model is built, TensorBoard starts or the config is written."""
    from transformers import Qwen2Config

    from spmd_rl.model.loading import ARCH_PRESETS
    from spmd_rl.model.tokenizer import build_char_tokenizer

    model_dir, run_dir = tmp_path / "config_only", tmp_path / "run"
    Qwen2Config(**{**ARCH_PRESETS["tiny"], "vocab_size": 40}).save_pretrained(model_dir)
    p = run_cmd(tiny_cmd(run_dir, f"model.path={model_dir}", 'model.arch=""'))
    n = len(build_char_tokenizer())
    assert_one_line_error(p, f"the tokenizer (model.tokenizer = 'char') has {n} tokens but the model (model.path = "
                             f"'{model_dir}') has vocab_size 40: token ids 40..{n - 1} would index past its embedding")
    assert run_files(run_dir) == {}


def test_torchrun_resume_on_another_number_of_ranks_keeps_the_data_order(tiny_run, tmp_path):
    """A checkpoint of 1 rank resumed on 2: models and optimizers reshard, every rank takes rank 0's
    trainer state, and each step trains on the prompts it had in the uninterrupted 2-rank run."""
    run_dir = tmp_path / "run"
    one = run_cmd(tiny_cmd(run_dir, "trainer.total_steps=1", nproc=1))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_cmd(tiny_cmd(run_dir, "trainer.total_steps=2"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "resuming a checkpoint of 1 ranks on 2: the models and optimizers are resharded" in two.stdout
    assert "at step 1 (epoch 0, batch 1)" in two.stdout

    def prompt_lengths(run):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        return {r["step"]: r["prompt/length_mean"] for r in rows if "prompt/length_mean" in r}

    assert prompt_lengths(run_dir) == pytest.approx(prompt_lengths(tiny_run[0]))  # the same prompts, steps 1 and 2
    assert sorted(prompt_lengths(run_dir)) == [1, 2]


LINGER = '''
import os, sys, time
sys.path.insert(0, sys.argv[1])
from spmd_rl import errors
errors.RANK0_GRACE_S = float(sys.argv[2])
errors.report(errors.UserError("data file 'x' is missing:   give another"))
print("waiting", flush=True)
errors.let_rank0_report_first()
'''


def test_a_rank_other_than_0_leaves_the_message_to_rank_0_and_prints_it_only_if_nobody_ends_it():
    """torchrun stops every rank once one exits with an error: a rank other than 0 that exits
    first must not take rank 0's one line with it (a CI run once ended with exit 2 and no message)."""
    plain = subprocess.run([sys.executable, "-c", LINGER, ROOT, "60"], env=dict(os.environ, RANK="1"),
                           capture_output=True, text=True, timeout=30)
    assert plain.returncode == 0 and plain.stderr == "", plain.stderr  # no torchrun: rank 0 prints, nobody waits
    env = dict(os.environ, RANK="1", TORCHELASTIC_RUN_ID="test")
    alone = subprocess.run([sys.executable, "-c", LINGER, ROOT, "0.2"], env=env, capture_output=True, text=True)
    assert alone.returncode == 0 and alone.stderr.strip() == (
        "(rank 1; rank 0 did not report it) error: data file 'x' is missing: give another"), alone.stderr
    ended = subprocess.Popen([sys.executable, "-c", LINGER, ROOT, "60"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert ended.stdout.readline().strip() == "waiting"
    ended.terminate()  # as torchrun does once rank 0 has reported and exited
    _, err = ended.communicate(timeout=10)
    assert ended.returncode == -15 and err == "", err
    rank0 = subprocess.run([sys.executable, "-c", LINGER, ROOT, "60"], env=dict(env, RANK="0"),
                           capture_output=True, text=True, timeout=30)
    assert rank0.stderr.strip() == "error: data file 'x' is missing: give another"  # at once, no wait
