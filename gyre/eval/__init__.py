"""Evaluation: held-out pass rates during a run (gyre.sched.controller.evaluation) and on their own (launch/eval.py)."""
