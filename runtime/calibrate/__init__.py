"""`meshplan calibrate`: microbenchmarks of this machine, run with the runtime's own model and
parallelisms, written as a profile that the simulator reads (`simulator.network.cpu_profile`)."""
