"""Failures over a run: goodput and checkpoint intervals (closed forms), the SimPy Monte Carlo
of failures and restarts, and stragglers in the step simulation."""
