"""The model-facing side: requests in, token deltas out, on one thread.

It knows nothing of HTTP, gevent or gunicorn (tests/test_layout.py checks). At its root are the engine's own
modules: its vocabulary (``config``, ``sampling_params``, ``outputs``, ``messages``), the engines that tie the
parts together (``llm_engine``, ``embedding_engine``), the step's forward pass (``model_runner``,
``attention_inputs``) and the thread's life (``loop``). The parts, each a sub-package that imports only from
those listed before it:
- ``runtime/``: the machine: device and dtype, the CPU's features, budget and share, the user cache;
- ``text/``: chat templates and detokenization;
- ``kernels/``: the C kernels for a CPU step and the packed weight formats they read;
- ``layers/`` and ``models/``: the network;
- ``loading/``: a model's files, GGUF conversion, weights loaded and packed;
- ``scheduling/``: sequences, the scheduler and the paged KV cache with prefix caching;
- ``sampling/``: the sampler, constrained decoding and speculative drafts.
"""
