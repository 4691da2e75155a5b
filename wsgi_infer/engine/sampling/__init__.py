"""What the next tokens are: logits to tokens (``sampler``), constraints compiled by llguidance (``grammar``),
and prompt-lookup drafts with their verification (``speculative``).
"""
