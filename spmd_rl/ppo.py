"""Entry point: `torchrun --nproc_per_node=N -m spmd_rl.ppo --config configs/X.toml key.sub=value ...`

(also `python -m spmd_rl.ppo ...` as a single process). `--config` takes a TOML file or the name
of a shipped preset (`--config tiny-cpu`; `--list-configs` lists them). The config is loaded and
validated before the process group or any model exists, so mistakes fail in a second. Every
mistake a user can fix (config, data, reward function, run directory) ends the run with one line
on rank 0 and exit code 2, not a traceback per rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from spmd_rl.config import load_config
from spmd_rl.errors import UserError, report
from spmd_rl.presets import describe_presets, resolve_config

log = logging.getLogger("spmd_rl")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(prog="python -m spmd_rl.ppo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="TOML config file or preset name (see docs/config.md, --list-configs)")
    ap.add_argument("--list-configs", action="store_true", help="list the shipped presets and exit")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. actor.lr=1e-6")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_configs:
        print(describe_presets())
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    try:
        cfg = load_config(resolve_config(args.config), args.overrides)
        cfg.validate(world_size=world, gpus_per_node=local_world)
    except UserError as e:
        return report(e)

    from spmd_rl.distributed import destroy_distributed, init_distributed

    try:
        env = init_distributed(cfg.trainer.device)
    except UserError as e:
        return report(e)
    try:
        status, step = run(cfg, env)
    except UserError as e:  # raised on every rank alike (the trainer makes sure of it)
        destroy_distributed()
        return report(e, env.rank)
    destroy_distributed()
    log.info("run %s: %s at step %d", cfg.run_dir, status, step)
    if status != "finished":
        from spmd_rl.preemption import EXIT_PREEMPTED

        return EXIT_PREEMPTED
    return 0


def run(cfg, env) -> tuple[str, int]:
    """Lock the run directory, check a resumed config, train, export (trainer.export_hf_dir).
    Returns (status, last step)."""
    from spmd_rl.distributed import raise_together, seed_everything, setup_logging
    from spmd_rl.resume_check import check_resume_config
    from spmd_rl.run_lock import RunDirLock
    from spmd_rl.trainer import Trainer

    os.makedirs(cfg.run_dir, exist_ok=True)
    lock = RunDirLock(cfg.run_dir)
    raise_together(lock.acquire if env.is_main else None)  # before anything is written into run_dir
    try:
        setup_logging(env.rank, os.path.join(cfg.run_dir, "trainer.log"))
        check_resume_config(cfg, env.is_main)
        seed_everything(cfg.trainer.seed + env.rank)
        trainer = Trainer(cfg, env)
        try:
            status = trainer.fit()
        finally:
            trainer.close()
        if status == "finished" and cfg.trainer.export_hf_dir and env.is_main:
            from spmd_rl.export import export_checkpoint

            out = export_checkpoint(os.path.join(cfg.run_dir, "checkpoints", f"step_{trainer.step}"),
                                    cfg.trainer.export_hf_dir)
            log.info("exported the final actor as a Hugging Face model to %s", out)
        return status, trainer.step
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
