"""Loading a model: from a path or the cache to a model built on its device with its weights.

It resolves a model's files (``model_paths``), reads configs and tokenizers and converts a GGUF into the cache
(``model_loader``, ``gguf_checkpoint``): the copy keeps no 2-D weight, whose blocks or values are read from the GGUF
itself (``gguf_file``, ``file_weights``). A GGUF's header, config, resolved config and text files (``gguf_header``,
``gguf_config``, ``resolved_config``, ``text_files``) need no torch: a process without it makes them ahead. It
reads a checkpoint's tensors by name (``checkpoint_tensors``) and builds the model with its weights packed for the
CPU kernels (``packing``, ``model_builder``).
"""
