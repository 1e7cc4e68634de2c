"""The straggler detector's defaults, shared by the runtime that applies them
(`runtime.health`, ``meshplan run --straggler-threshold / --straggler-window``) and the
planner that prices what they cost (`planner.objective`); it imports nothing, so both layers
can read it.
"""

#: Relative performance score below which a rank is slow (nvidia-resiliency-ext's default
#: ``gpu_relative_perf_threshold``; `runtime.health` describes the score).
STRAGGLER_THRESHOLD = 0.7
#: Consecutive slow steps that confirm a straggler.
STRAGGLER_WINDOW = 5
