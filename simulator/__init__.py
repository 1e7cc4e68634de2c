"""meshplan simulator: hardware profiles, NetworkX clusters, collective costs, memory and the
SimPy step simulation.

Import from the submodules (this package re-exports nothing, so that the module
``simulator.simulate`` is never shadowed by the function of the same name)::

    from simulator.cluster import load_cluster
    from simulator.simulate import estimate, simulate
    pred = simulate(load_model("llama3-70b"), plan, load_cluster("dgx-h100", nodes=16))
"""
