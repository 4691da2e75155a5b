"""HTTP routes, one blueprint per API: OpenAI-compatible, native, operational."""
