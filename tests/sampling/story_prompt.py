"""The prompt the sampling tests continue: a story's opening."""

PROMPT = "Once upon a time, in a land far away, there lived a"
