"""Loading a model: from a path or the cache to a model built on its device with its weights.

It resolves a model's files (``model_paths``), reads configs and tokenizers and converts a GGUF into the cache
(``model_loader``, ``gguf_checkpoint``, ``gguf_blocks``, ``checkpoint_writer``, ``packed_groups_file``), reads a
checkpoint's tensors by name (``checkpoint_tensors``) and builds the model with its weights packed for the CPU
kernels (``packing``, ``model_builder``).
"""
