"""Entry point: `torchrun --nproc_per_node=N -m spmd_rl.ppo --config configs/X.toml key.sub=value ...`

(also `python -m spmd_rl.ppo ...` as a single process). The config is loaded and validated
before the process group or any model exists, so mistakes fail in a second with one message.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

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

    from spmd_rl.checkpoint import CheckpointError
    from spmd_rl.distributed import destroy_distributed, init_distributed, seed_everything, setup_logging
    from spmd_rl.preemption import EXIT_PREEMPTED
    from spmd_rl.trainer import Trainer

    env = init_distributed(cfg.trainer.device)
    os.makedirs(cfg.run_dir, exist_ok=True)
    setup_logging(env.rank, os.path.join(cfg.run_dir, "trainer.log"))
    seed_everything(cfg.trainer.seed + env.rank)
    try:
        trainer = Trainer(cfg, env)
    except CheckpointError as e:  # a run directory's checkpoints the user must sort out: one line, rank 0
        if env.is_main:
            print(f"checkpoint error: {e}", file=sys.stderr)
        destroy_distributed()
        return 2
    try:
        status = trainer.fit()
    except CheckpointError as e:  # raised on every rank alike; the previous checkpoint is still the latest
        if env.is_main:
            print(f"checkpoint error: {e}", file=sys.stderr)
        status = "failed"
    except BaseException:
        trainer.close(failed=True)
        raise
    trainer.close()
    destroy_distributed()
    log.info("run %s: %s at step %d", cfg.run_dir, status, trainer.step)
    return {"finished": 0, "failed": 1}.get(status, EXIT_PREEMPTED)


if __name__ == "__main__":
    sys.exit(main())
