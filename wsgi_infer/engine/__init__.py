"""The model-facing side: requests in, token deltas out, on one thread.

It knows nothing of HTTP, gevent or gunicorn (tests/test_layout.py checks).
Its core (``config``, ``sampling_params``, ``outputs``, ``sequence``,
``block_manager``, ``kv_cache_manager``, ``scheduler``) is plain Python without torch; the torch work
is in ``model_runner``, ``sampler`` (with ``grammar``, llguidance's
constrained decoding), ``layers/`` and ``models/``, and ``llm_engine`` ties
them together.
"""
