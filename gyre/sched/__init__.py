"""Cells and their scheduling: `python -m launch.run scheduler=elastic|async|colocate_cells`.

The run is one MPI job (gyre.sched.launch -> mpirun -> gyre.sched.job): rank 0 is the controller
(proxy, harness sessions, policy, shards, metrics: gyre.sched.controller), ranks 1..C are the cells
(C = 1 + len(cluster.satellites)), each with its own rollout engine and Megatron replica
(gyre.sched.cell); cell 0 (rank 1) is the core. The same code runs the three schedulers
(gyre.sched.policy); `scheduler=colocate` (the default) is still the single-process loop of
gyre.loop. On one machine every rank gets a CPU set (gyre.sched.affinity, `sched.cpu_sets`).
"""
