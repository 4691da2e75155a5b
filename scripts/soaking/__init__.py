"""scripts/soak.py's parts: what each model must answer, the client loops, the sampler and the report."""
