"""What the property-based tests share: a fixed set of examples in the suite (the same on every run), or, with
``WSGI_INFER_FUZZ_RANDOM=1``, random ones (``scripts/fuzz_server.sh`` runs many); ``WSGI_INFER_FUZZ_EXAMPLES``
sets how many."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings


def examples(default: int) -> int:
    return int(os.environ.get("WSGI_INFER_FUZZ_EXAMPLES", default))


def fuzzing(max_examples: int) -> settings:
    """No deadline (a step may take long on a loaded machine), no example database and no health checks: the
    examples are the test's, each run."""
    random = os.environ.get("WSGI_INFER_FUZZ_RANDOM") == "1"
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=not random,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
