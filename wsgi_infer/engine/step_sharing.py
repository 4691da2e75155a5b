"""Which model the engine thread steps next, when several have work: the one that has computed the fewest tokens.

Tokens, not steps: one model's step may be a 512-token prefill chunk while the other's decodes 4 rows. A model
that was idle comes back level with the busy ones (as a task's virtual runtime does in Linux's fair scheduler):
its idleness is no credit to spend in a burst that would stall the others' streams, and its past work no debt.
"""

from __future__ import annotations


class StepSharing:
    def __init__(self) -> None:
        self._computed: dict[str, int] = {}  # tokens each model computed, relative to the others
        self._busy: set[str] = set()

    def next(self, busy: list[str]) -> str | None:
        """The model to step now, of those with work (in the thread's order: ties go to the first)."""
        if not busy:
            self._busy.clear()
            return None
        level = min((self._computed[name] for name in busy if name in self._busy), default=None)
        for name in busy:
            if name not in self._busy:  # just got work: level with the busy ones, neither behind nor ahead
                self._computed[name] = level if level is not None else self._computed.get(name, 0)
        self._busy = set(busy)
        return min(busy, key=self._computed.__getitem__)

    def add(self, name: str, num_tokens: int) -> None:
        """``name``'s step computed ``num_tokens`` tokens (at least one counts: an empty step still took a turn)."""
        self._computed[name] = self._computed.get(name, 0) + max(1, num_tokens)

    def forget(self, name: str) -> None:
        """The model was unloaded: nothing of it is kept (a server loading and unloading models keeps no count)."""
        self._computed.pop(name, None)
        self._busy.discard(name)

    def __len__(self) -> int:
        """The models it keeps a count for."""
        return len(self._computed)
