"""OpenAI's Responses API: requests translated to a chat (``schemas``), its output as output items and typed
events (``events``), and the routes with stored responses (``routes``)."""
