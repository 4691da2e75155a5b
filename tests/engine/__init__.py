"""The engine in this process: batching that is exact, the scheduler's blocks, sampling, speculation, constraints,
detokenizing, the transformers reference and the real Gemma 3."""
