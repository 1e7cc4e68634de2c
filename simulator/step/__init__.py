"""One training step: per-op compute, memory per rank, per-stage costs, the pipeline schedules
in SimPy and their closed form, and the Chrome trace of a simulated step."""

from simulator.step import zero_bubble  # noqa: E402,F401 - registers the zero-bubble SimPy step
