"""Starting a run: on this machine (`local`: in this process, `in_process`, or under mpirun, `job`), behind one
`launcher.Launcher` with the Slurm ones (launch/slurm/launchers.py), and each rank's place and preflight in an
MPI or Slurm job."""
