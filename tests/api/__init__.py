"""The HTTP API over the tiny engine in this process (the fast tier): OpenAI's, Responses, Messages, embeddings,
tools and reasoning, and how streams end."""
