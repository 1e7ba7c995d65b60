"""A discrete-event simulator that drives the production scheduling code (gyre.sched) on a simulated clock."""
