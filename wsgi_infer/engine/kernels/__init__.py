"""Compiled kernels for the CPU: a decode step's small ops fused, where a C compiler is present."""
