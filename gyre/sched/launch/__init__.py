"""Starting a run: on this machine (`local.run_cells`: in this process, `in_process`, or under mpirun, `job`),
and each rank's place and preflight in an MPI or Slurm job."""
