"""The HTTP API: one blueprint per API (OpenAI-compatible, native, tokenization, operational, the chat page),
the request schemas they parse, tool calls, and the formatters that turn engine deltas into responses."""
