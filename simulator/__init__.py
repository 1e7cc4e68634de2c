"""meshplan simulator: the machine, one training step, failures, and validation.

- ``simulator.network``: device profiles, the cluster as a NetworkX graph, collective costs on
  it, placement of the parallel groups, a calibrated CPU profile;
- ``simulator.step``: per-op compute, memory per rank, per-stage costs, the pipeline schedules
  in SimPy and in closed form, the step prediction and its Chrome trace;
- ``simulator.failures``: goodput under failures (closed forms and a SimPy Monte Carlo) and
  stragglers;
- ``simulator.validation``: the readers of published runs, the bulk fit, nccl-tests and the
  error report.

Import from the modules (the packages re-export nothing)::

    from simulator.network.cluster import load_cluster
    from simulator.step.simulate import estimate, simulate
    pred = simulate(load_model("llama3-70b"), plan, load_cluster("dgx-h100", nodes=16))
"""

from pathlib import Path

#: The simulator's data: devices, node types, fabrics, cluster presets, efficiency fits.
PRESET_DIR = Path(__file__).with_name("presets")
