"""One training step: per-op compute, memory per rank, per-stage costs, the pipeline schedules
in SimPy and their closed form, and the Chrome trace of a simulated step."""
