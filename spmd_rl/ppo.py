"""Entry point: `torchrun --nproc_per_node=N -m spmd_rl.ppo --config configs/X.toml key.sub=value ...`

(also `python -m spmd_rl.ppo ...` as a single process, and `spmd-rl --nproc_per_node=N --config ...`,
which runs torchrun and passes the exit status below on: spmd_rl/launcher.py). `--config` takes a TOML file or the name
of a shipped preset (`--config tiny-cpu`; `--list-configs` lists them). The config is loaded and
validated before the process group or any model exists, so mistakes fail in a second. Every
mistake a user can fix (config, data, model directories, reward function, run directory,
checkpoints) ends the run with one line on rank 0 and exit code 2, not a traceback per rank.
`--check` runs the start-up checks (config, reward function, memory, data) and exits without
training: `check: OK` and status 0, or the `error:` line and status 2.

Exit status: 0 finished, 1 crashed, 2 user error, 3 stopped on a signal after writing a checkpoint
(requeue), 4 ended without its last checkpoint, 130 interrupted; each status's name and meaning:
spmd_rl/exit_codes.py. Whatever the outcome, everything the run started is stopped in
the order spmd_rl/runtime/lifecycle.py describes before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from spmd_rl import preflight
from spmd_rl.config.presets import describe_presets, resolve_config
from spmd_rl.config.run_config import load_config
from spmd_rl.errors import UserError, closing_message, let_rank0_report_first, report, say_last
from spmd_rl.exit_codes import EXIT_CRASHED, EXIT_INTERRUPTED, EXIT_NOT_SAVED, EXIT_OK, EXIT_PREEMPTED, EXIT_USER_ERROR

log = logging.getLogger("spmd_rl")


def parse_args(argv: list[str] | None):
    return arg_parser().parse_args(argv)


def arg_parser() -> argparse.ArgumentParser:
    """The trainer's arguments. None of its option names may start a torchrun option name: torchrun
    would take it as its own (tests/test_launcher.py)."""
    ap = argparse.ArgumentParser(prog="python -m spmd_rl.ppo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config file or preset name (see docs/config.md, --list-configs)")
    ap.add_argument("--list-configs", action="store_true", help="list the shipped presets and exit")
    ap.add_argument("--check", action="store_true",
                    help="check the config, reward function, memory and data, then exit without training")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. actor.lr=1e-6")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the trainer; the exit status (the module docstring), also written where a launcher asks
    for it (preemption.EXIT_STATUS_DIR_ENV: under torchrun the SLURM task cannot see it otherwise)."""
    from spmd_rl.runtime.preemption import record_exit_status

    code = _main(argv)
    record_exit_status(code, closing_message())
    return code


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    if args.list_configs:
        print(describe_presets())
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        cfg = load_config(resolve_config(args.config), args.overrides)
        # Training tensors of changing shapes (packed rows) fragment the caching allocator; expandable
        # segments let empty_cache() give every free page back before the engine wakes. The vLLM engine
        # switches them off while it is awake (spmd_rl/runtime/gpu_memory.py). A user's own setting wins. Set
        # before validation, which imports vLLM when rollout.engine_kwargs are set (their names).
        if cfg.rollout.engine == "vllm" and not any(v in os.environ for v in ("PYTORCH_CUDA_ALLOC_CONF",
                                                                              "PYTORCH_ALLOC_CONF")):
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        preflight.validate(cfg, world_size=world, gpus_per_node=local_world)
    except UserError as e:
        code = report(e)
        let_rank0_report_first()
        return code

    from spmd_rl.runtime import lifecycle

    lifecycle.die_with_launcher()
    try:
        code = _check(cfg) if args.check else _train(cfg)
    finally:
        # 3. The trainer and its env went with _train's frame: collect the process group now,
        #    joining its threads while the interpreter is fully alive (see spmd_rl/runtime/lifecycle.py).
        lifecycle.destroy_process_group()
        # 4. Threads libraries started for us; 5. nothing of ours may be left.
        lifecycle.stop_library_threads()
        if lifecycle.python_threads():
            log.warning("threads still running at exit: %s", ", ".join(lifecycle.python_threads()))
        lifecycle.ignore_stop_signals()
    if not args.check and code not in (EXIT_OK, EXIT_USER_ERROR):  # stopped before its end
        # (crashed, stopped on a signal, interrupted); a user error's own line stays the last
        for line in _resume_lines(cfg, sys.argv[1:] if argv is None else argv):
            say_last(line)
    let_rank0_report_first()
    return code


def _resume_lines(cfg, trainer_args: list[str]) -> list[str]:
    """Where a run that stopped before its end can resume from, and the command (resume_hint)."""
    from spmd_rl.checkpoint.checkpointer import Checkpointer
    from spmd_rl.runtime.resume_hint import resume_lines

    return resume_lines(Checkpointer(cfg.checkpoint_dir, cfg.trainer.keep_last).latest(), trainer_args)


def _check(cfg) -> int:
    """--check: the checks a run makes before its models load, on every rank; one line each
    (rank 0), then `check: OK`. Loads the tokenizer and the data, no model weights."""
    from spmd_rl.build import build_data, check_memory, choose_speed_settings
    from spmd_rl.data.rewards import RewardFunction
    from spmd_rl.runtime.distributed import init_distributed

    env = init_distributed(cfg.trainer.device, cfg.trainer.fsdp_size, cfg.trainer.ulysses_size)
    say = print if env.is_main else (lambda line: None)
    try:
        say(f"config: valid for {env.world_size} rank(s); run directory {cfg.run_dir}")
        speed = choose_speed_settings(cfg, env)
        if speed:
            say(speed)
        reward = RewardFunction(cfg.reward)
        say(f"reward: {cfg.reward.custom_function or 'built-in scorers'} loaded")
        plan = check_memory(cfg, env)
        say(plan.line() if plan is not None else f"memory: not predicted (trainer.memory_check = "
                                                  f"{cfg.trainer.memory_check!r}, or see the log)")
        data = build_data(cfg, env, reward)
        say(f"data: {len(data.train)} training prompts, "
            f"{len(data.val) if data.val is not None else 0} validation prompts; every data source "
            "has a scorer")
    except UserError as e:
        return report(e)
    say("check: OK")
    return EXIT_OK


def _train(cfg) -> int:
    """Lock the run directory, check a resumed config, set up, train, export (trainer.export_hf_dir)
    and close the trainer (steps 1-2 of the teardown); the exit status."""
    from spmd_rl.build import choose_speed_settings
    from spmd_rl.checkpoint.checkpointer import CheckpointError
    from spmd_rl.preflight.memory import OutOfMemory
    from spmd_rl.preflight.resume import check_resume_config
    from spmd_rl.runtime import lifecycle
    from spmd_rl.runtime.distributed import init_distributed, raise_together, seed_everything, setup_logging
    from spmd_rl.runtime.run_lock import RunDirLock
    from spmd_rl.telemetry.startup import startup_clock
    from spmd_rl.trainer import Trainer

    clock = startup_clock()
    clock.seconds["imports"] = time.time() - clock.start  # interpreter start and imports
    trainer, lock, checkpoint_lock, fitting = None, None, None, False
    try:
        with clock("distributed"):
            env = init_distributed(cfg.trainer.device, cfg.trainer.fsdp_size, cfg.trainer.ulysses_size)
        os.makedirs(cfg.run_dir, exist_ok=True)
        lock = RunDirLock(cfg.run_dir)
        raise_together(lock.acquire if env.is_main else None)  # before anything is written into run_dir
        if not _inside(cfg.checkpoint_dir, cfg.run_dir):  # trainer.checkpoint_dir elsewhere: one run there too
            os.makedirs(cfg.checkpoint_dir, exist_ok=True)
            checkpoint_lock = RunDirLock(cfg.checkpoint_dir, key="trainer.checkpoint_dir")
            raise_together(checkpoint_lock.acquire if env.is_main else None)
        setup_logging(env.rank, os.path.join(cfg.run_dir, "trainer.log"))
        speed = choose_speed_settings(cfg, env)  # "auto" settings: before the resume check and the trainer read them
        if speed and env.is_main:
            log.info(speed)
        check_resume_config(cfg, env.is_main)
        seed_everything(cfg.trainer.seed + env.rank)
        # Built in place, so that a constructor failing half-way still leaves us what it started.
        trainer = Trainer.__new__(Trainer)
        trainer.__init__(cfg, env)
        fitting = True
        status = trainer.fit()
        lifecycle.ignore_stop_signals()  # the stop, if any, is done: a late signal must not cut the rest short
        log.info("run %s: %s at step %d", cfg.run_dir, status, trainer.step)
        if status == "finished" and cfg.trainer.export_hf_dir and env.is_main:
            from spmd_rl.export import export_checkpoint

            out = export_checkpoint(os.path.join(cfg.checkpoint_dir, f"step_{trainer.step}"), cfg.trainer.export_hf_dir)
            log.info("exported the final actor as a Hugging Face model to %s", out)
        return {"finished": EXIT_OK, "preempted": EXIT_PREEMPTED}.get(status, EXIT_NOT_SAVED)
    except OutOfMemory as e:  # a step out of GPU memory: each rank's own (trainer.PhaseTimer), one line on each
        return report(e, per_rank=True)
    except UserError as e:  # config, data, reward function, run directory: raised on every rank alike
        return report(e)
    except CheckpointError as e:  # raised on every rank alike; one line on rank 0
        # at start-up (no valid checkpoint, resume = none over checkpoints): the user's to fix;
        # a save that failed in the background: a crash, the previous checkpoint is still the latest
        code = report(e, kind="checkpoint error")
        return EXIT_CRASHED if fitting else code
    except KeyboardInterrupt:
        log.error("interrupted")
        return EXIT_INTERRUPTED
    except Exception:
        log.exception("run %s failed", cfg.run_dir)
        return EXIT_CRASHED
    finally:
        # 1. The trainer's workers (the save in flight, the engine before the process group,
        #    TensorBoard's writer, the heartbeat), then the run directory's lock.
        clock.close()
        if trainer is not None:
            trainer.close()
        for held in (checkpoint_lock, lock):
            if held is not None:
                held.release()
        # 2. Dropping the trainer (here, with this frame) releases the last holders of the group.


def _inside(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([path, directory]) == directory


if __name__ == "__main__":
    sys.exit(main())
