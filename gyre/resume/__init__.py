"""Preemption-safe resume: what a run saves when it is stopped, and how a restart continues it.

- `preemption`: SIGTERM (Slurm preemption, `scontrol requeue`, the time-limit signal) and SIGUSR1
  ask the run to stop. Rollouts in flight are abandoned at once; an optimizer update in progress
  finishes first (its step then counts as completed).
- `checkpoint`: `output_dir/checkpoint/` holds the trainer (weights + optimizer), RNG states and
  `state.json` (next step, weight version, task-pool position, the ledger of trained rollout ids
  per step, one entry per start of the job). It is replaced atomically as a whole directory.
- `recovery`: on start, `resume=auto|never|must` decides whether to continue from that
  checkpoint. Whatever the output directory holds for steps at or after the checkpoint's next step
  (shards, partial shard temp files, metrics rows, call-log lines, rollout workspaces of
  abandoned rollouts) is *moved aside* into `output_dir/preempted/<name>/` with a manifest, never
  deleted; those steps are then run again with the same rollout ids. So the shards of a
  preempted and resumed run hold each rollout id of each completed step exactly once, and the
  ledger lists every completed step exactly once.

The controller (gyre/sched/controller/orchestrator.py) uses all three, for every scheduler. Only
`checkpoint` imports torch, so the CLI can import `preemption` and `recovery` cheaply.
"""
