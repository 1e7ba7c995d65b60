"""Cells and their scheduling: `python -m launch.run scheduler=colocate|colocate_cells|async|elastic`.

One controller runs every scheduler (proxy, harness sessions, policy, shards, the step clock, checkpoints,
metrics: gyre.sched.controller.orchestrator); the cells each hold a rollout engine and a Megatron replica
(gyre.sched.cell.worker), cell 0 the core. `scheduler=colocate` (the default) runs the core cell alone in the
controller's process, in a thread (gyre.sched.launch.in_process, no mpirun); every other layout is one MPI job
(gyre.sched.launch.local -> mpirun -> gyre.sched.launch.job): rank 0 the controller, ranks 1..C the cells
(C = 1 + len(cluster.satellites)). The policy (gyre.sched.policy) decides the roles. On one machine every
rank of an MPI job gets a CPU set (gyre.sched.launch.affinity, `sched.cpu_sets`).
"""
