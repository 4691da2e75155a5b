"""Compiled kernels for the CPU (a step's matrix multiplies, attention and small ops, built per x86-64 level)
and the weights they read: the block formats, GGUF's and our Q8_M (``block_fields``), and a weight packed in tiles
of those blocks as the kernels multiply it (``packed``)."""
