"""A request's JSON body, read: the schemas of the OpenAI-compatible and native routes, the fields that constrain
the output, the fields other APIs define that this server refuses, and how a body becomes a request."""
