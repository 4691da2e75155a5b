"""OpenAI's classic routes: /v1/completions, /v1/chat/completions and /v1/models (``routes``), and
/v1/embeddings (``embeddings``)."""
