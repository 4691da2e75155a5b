"""A conversation's path through the model, shared by chat completions, Responses and Messages: its schema
(``schemas``), rendered with the model's template and started (``conversation``), tool calls (``tools``,
``tool_formats``), a thinking model's thought (``reasoning``), and the engine's deltas as replies
(``formatters``)."""
