"""Anthropic's Messages API: requests translated to a chat (``schemas``), its output as content blocks and
Anthropic's events (``events``), and the routes (``routes``)."""
