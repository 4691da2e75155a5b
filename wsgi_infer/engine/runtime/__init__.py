"""The machine the engine runs on: its device and dtype, the CPU's features, the CPUs a worker may use and
its share of them, the flag that stops a step between layers, and the user cache directory.

Everything here but ``device`` is plain Python without torch, so the gunicorn master may use it.
"""
