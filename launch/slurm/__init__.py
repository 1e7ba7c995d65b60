"""Slurm adapter: heterogeneous jobs for the core and satellite cells (generated sbatch, submitit)."""
