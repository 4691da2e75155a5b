"""Loading models: every GGUF type, conversion into the cache, and the model's files."""
