"""The engine in this process: batching that is exact, the scheduler's blocks, detokenizing, the transformers
reference and the real Gemma 3 (sampling, speculation and constraints: tests/sampling)."""
