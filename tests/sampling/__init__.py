"""What the next tokens are, in this process: sampling parameters, banned tokens, speculation and constraints."""
