"""Entry point: `torchrun --nproc_per_node=N -m spmd_rl.ppo --config configs/X.toml key.sub=value ...`

(also `python -m spmd_rl.ppo ...` as a single process). The config is loaded and validated
before the process group or any model exists, so mistakes fail in a second with one message.

Exit status: 0 finished, 1 crashed, 2 configuration error, 3 stopped on a signal after writing a
checkpoint (EXIT_PREEMPTED: requeue). Whatever the outcome, everything the run started is
stopped in the order spmd_rl/lifecycle.py describes before the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from spmd_rl.config import ConfigError, load_config

log = logging.getLogger("spmd_rl")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m spmd_rl.ppo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config file (see docs/config.md)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. actor.lr=1e-6")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        cfg = load_config(args.config, args.overrides)
        cfg.validate(world_size=world, gpus_per_node=local_world)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2

    # Training tensors of changing shapes (packed rows) fragment the caching allocator; expandable
    # segments let empty_cache() give every free page back before the engine wakes. The vLLM engine
    # switches them off while it is awake (spmd_rl/gpu_memory.py). A user's own setting wins.
    if cfg.rollout.engine == "vllm" and not any(v in os.environ for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

    from spmd_rl import lifecycle

    lifecycle.die_with_launcher()
    try:
        code = _train(cfg)
    finally:
        # 3. The trainer and its env went with _train's frame: collect the process group now,
        #    joining its threads while the interpreter is fully alive (see spmd_rl/lifecycle.py).
        lifecycle.destroy_process_group()
        # 4. Threads libraries started for us; 5. nothing of ours may be left.
        lifecycle.stop_library_threads()
        if lifecycle.python_threads():
            log.warning("threads still running at exit: %s", ", ".join(lifecycle.python_threads()))
        lifecycle.ignore_stop_signals()
    return code


def _train(cfg) -> int:
    """Set up, train and close the trainer (steps 1-2 of the teardown); the exit status."""
    from spmd_rl.checkpoint import CheckpointError
    from spmd_rl.distributed import init_distributed, seed_everything, setup_logging
    from spmd_rl.lifecycle import EXIT_CONFIG_ERROR, EXIT_CRASHED, EXIT_OK
    from spmd_rl.preemption import EXIT_PREEMPTED
    from spmd_rl.startup import startup_clock
    from spmd_rl.trainer import Trainer

    clock = startup_clock()
    clock.seconds["imports"] = time.time() - clock.start  # interpreter start and imports
    os.makedirs(cfg.run_dir, exist_ok=True)
    setup_logging(int(os.environ.get("RANK", "0")), os.path.join(cfg.run_dir, "trainer.log"))
    trainer, fitting = None, False
    try:
        with clock("distributed"):
            env = init_distributed(cfg.trainer.device)
        seed_everything(cfg.trainer.seed + env.rank)
        # Built in place, so that a constructor failing half-way still leaves us what it started.
        trainer = Trainer.__new__(Trainer)
        trainer.__init__(cfg, env)
        fitting = True
        status = trainer.fit()
        log.info("run %s: %s at step %d", cfg.run_dir, status, trainer.step)
        return EXIT_OK if status == "finished" else EXIT_PREEMPTED
    except ConfigError as e:  # a setting that only the trainer could check (data, checkpoints)
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except CheckpointError as e:  # raised on every rank alike; the run directory needs the user
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"checkpoint error: {e}", file=sys.stderr)
        # at start-up (no valid checkpoint, resume = none over checkpoints): the user's to fix;
        # a save that failed in the background: the previous checkpoint is still the latest
        return EXIT_CRASHED if fitting else EXIT_CONFIG_ERROR
    except KeyboardInterrupt:
        log.error("interrupted")
        return 130
    except Exception:
        log.exception("run %s failed", cfg.run_dir)
        return EXIT_CRASHED
    finally:
        # 1. The trainer's workers (engine before the process group; TensorBoard writer; heartbeat).
        clock.close()
        if trainer is not None:
            trainer.close()
        # 2. Dropping the trainer (here, with this frame) releases the last holders of the group.


if __name__ == "__main__":
    sys.exit(main())
