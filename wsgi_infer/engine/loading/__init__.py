"""Loading a model: from a path or the cache to a model built on its device with its weights.

It resolves a model's files (``model_paths``), reads configs and tokenizers and converts a GGUF into the cache
(``model_loader``, ``gguf_checkpoint``, ``gguf_blocks``, ``packed_groups_file``): the copy keeps the weights' packed
groups and no 2-D weight's values, which are read from the GGUF itself where a load needs them (``gguf_file``,
``file_weights``). It reads a checkpoint's tensors by name (``checkpoint_tensors``) and builds the model with its
weights packed for the CPU kernels (``packing``, ``model_builder``).
"""
