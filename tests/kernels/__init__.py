"""The CPU kernels, their builds per instruction set, and the packed layers with their crossing points."""
