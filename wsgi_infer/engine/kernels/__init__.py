"""Compiled kernels for the CPU (a step's matrix multiplies, attention and small ops, built per x86-64 level)
and the packed weight formats they read (``weight_groups``)."""
