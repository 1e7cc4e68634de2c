"""The machine: device profiles, the cluster as a NetworkX graph of devices, switches and links,
collective costs on it, and where each rank's devices sit (placement)."""
