"""Evaluation: held-out pass rates during a run (gyre.eval.run) and on their own (launch/eval.py)."""
