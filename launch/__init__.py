"""Launchers for spmd_rl: SLURM through submitit (`python -m launch.slurm`, launch/slurm.py).

Plain torchrun needs no launcher: see docs/multinode.md for the multi-node command lines.
launch/task.py is what runs inside each SLURM task; launch/jobs.py queries job states.
"""
