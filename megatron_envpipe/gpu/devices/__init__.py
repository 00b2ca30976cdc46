"""GPU devices: the GpuDevice interface, the backends (nvml, simulated, none) and their registry."""
