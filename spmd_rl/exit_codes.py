"""The exit statuses of a run, each named once here (spmd_rl/ppo.py's entry point returns them; the
`spmd-rl` launcher and the SLURM task pass them on).

| status | name             | meaning                                                                      |
|--------|------------------|------------------------------------------------------------------------------|
| 0      | EXIT_OK          | finished (or `--check` passed)                                               |
| 1      | EXIT_CRASHED     | crashed: a traceback in the log                                              |
| 2      | EXIT_USER_ERROR  | a mistake the user can fix (config, data, model directories, reward          |
|        |                  | function, run directory, checkpoints): one `error:` line names it and the fix |
| 3      | EXIT_PREEMPTED   | stopped on a signal (SIGTERM, SIGUSR1/2, Ctrl-C) after writing a checkpoint: |
|        |                  | requeue (spmd_rl/runtime/preemption.py)                                       |
| 4      | EXIT_NOT_SAVED   | ended (finished, or stopped on a signal) without its last checkpoint: no disk |
|        |                  | space for it, or its write failed; the log says why and names the latest      |
|        |                  | complete checkpoint. A requeue would only repeat it, so this is not 3         |
| 130    | EXIT_INTERRUPTED | interrupted (a second Ctrl-C): no checkpoint                                  |

A run that stops with 1, 3, 4 or 130 names its latest checkpoint and the command that resumes it
(spmd_rl/runtime/resume_hint.py). Nothing here imports torch: the launcher reads these before any
GPU work.
"""

EXIT_OK = 0
EXIT_CRASHED = 1
EXIT_USER_ERROR = 2
EXIT_PREEMPTED = 3
EXIT_NOT_SAVED = 4
EXIT_INTERRUPTED = 130
