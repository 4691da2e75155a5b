"""A vocabulary's BPE merges, recovered as transformers recovers them for a file that lists none (Gemma's).

transformers' ``generate_merges`` cuts every token into two tokens every way it can and sorts the cuts by the token's
score: 1.1 s of Gemma 3's 262,144 tokens (Intel Xeon), 0.5 s of it sorting. Where no two scores tie, as in every
file whose merges follow its tokens' order, that order is the tokens' sorted once and their cuts' in turn, and the
ids that break ties never count: the same list from 1.2 million cuts. In Python those took 0.72 s, on the path to a
first start's tokenizer (``text_files``); the CPU kernels' library (``c/vocabulary.c``) makes them in a fraction of
that where one is there, and Python where none is. The library's are pairs of the vocabulary's indices
(``MergeList``), written into ``tokenizer.json`` from them by the library too (``merges_json``): as Python tuples,
then strings, Gemma 3's 514,906 took 0.45 s more of the process that reads a first start's tokenizer ahead, while the
worker waited for it, and gathered in numpy 0.3-1.3 s and 115 MB of fresh memory (Zen 4).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Collection, Mapping, Sequence
from itertools import accumulate

import numpy as np

from ..kernels.build import kernels_library_now

_P, _I = ctypes.c_void_p, ctypes.c_int64


def vocabulary_merges(
    vocab: Mapping[str, int], vocab_scores: Mapping[str, float] | None = None, skip_tokens: Collection[str] = ()
) -> list[tuple[str, str]]:
    """transformers' ``generate_merges``: each token's cuts into two tokens, best token first (the highest score, or
    the lowest id without scores), then by the left part's length (longest first with scores). Where scores tie (or
    are NaN), or tokens are skipped, transformers' own."""
    from transformers.tokenization_utils_base import generate_merges

    scores = dict(vocab_scores) if vocab_scores is not None else vocab
    distinct = set(scores.values())
    if skip_tokens or len(distinct) < len(scores) or any(score != score for score in distinct):  # ties, NaN
        return generate_merges(vocab, vocab_scores, skip_tokens)
    best_first = vocab_scores is not None
    order = sorted(scores, key=scores.__getitem__, reverse=best_first)
    library = kernels_library_now()
    if library is None:
        return python_merges(vocab, order, best_first)
    return library_merges(ctypes.CDLL(str(library)), vocab, order, best_first)


def python_merges(vocab: Collection[str], order: Sequence[str], best_first: bool) -> list[tuple[str, str]]:
    """The tokens' cuts into two tokens of ``vocab``, ``order``'s tokens in turn, each token's from its right end
    (``best_first``) or from its left."""
    merges = []
    for merge in order:
        for index in range(len(merge) - 1, 0, -1) if best_first else range(1, len(merge)):
            left = merge[:index]
            if left in vocab:
                right = merge[index:]
                if right in vocab:
                    merges.append((left, right))
    return merges


def library_merges(
    library: ctypes.CDLL, vocab: Collection[str], order: Sequence[str], best_first: bool
) -> list[tuple[str, str]]:
    """``python_merges``, cut by the library."""
    members = list(vocab)
    members_text, member_offsets = _utf8(members)
    tokens_text, token_offsets = _utf8(order)
    capacity = max(len(tokens_text) - len(order), 1)  # every cut between two bytes: no fewer than between code points
    left, right = np.empty(capacity, np.int32), np.empty(capacity, np.int32)
    merges = library.vocabulary_merges
    merges.argtypes, merges.restype = [_P, _P, _I, _P, _P, _I, ctypes.c_int, _P, _P, _I], _I
    count = merges(
        members_text, member_offsets.ctypes.data, len(members), tokens_text, token_offsets.ctypes.data,
        len(order), int(best_first), left.ctypes.data, right.ctypes.data, capacity,
    )  # fmt: skip
    if count < 0:
        raise MemoryError("no memory for the vocabulary's table of tokens")
    return MergeList(library, members, members_text, member_offsets, left[:count], right[:count])


class MergeList(Sequence):
    """Merges as pairs of a vocabulary's indices: a sequence of ``(left, right)`` strings, and their JSON list."""

    def __init__(
        self,
        library: ctypes.CDLL,
        members: list[str],
        text: bytes,
        offsets: np.ndarray,
        left: np.ndarray,
        right: np.ndarray,
    ):
        self.library, self.members, self.text, self.offsets = library, members, text, offsets
        self.left, self.right = left, right

    def __len__(self) -> int:
        return len(self.left)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        return self.members[self.left[index]], self.members[self.right[index]]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def json(self) -> str:
        """``tokenizer.json``'s list of them: "a b" strings, or ``["a","b"]`` pairs where a part has a space (as
        ``gguf_tokenizer`` writes a list of tuples), assembled by the library from the members' escaped bytes."""
        used = np.zeros(len(self.members), bool)
        used[self.left] = used[self.right] = True
        blob = np.frombuffer(self.text, np.uint8)
        spaced = np.searchsorted(self.offsets, np.flatnonzero(blob == ord(" ")), "right") - 1
        opening, between, closing = (b'["', b'","', b'"]') if used[spaced].any() else (b'"', b" ", b'"')
        escaped, offsets = self._escaped(blob)
        lengths = np.diff(offsets)
        size = 2 + int(lengths[self.left].sum() + lengths[self.right].sum())
        size += len(self) * (len(opening) + len(between) + len(closing) + 1)
        out = ctypes.create_string_buffer(size)
        write = self.library.merges_json
        write.argtypes, write.restype = [_P, _P, _P, _P, _I, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, _P], _I
        left, right = (np.ascontiguousarray(side, np.int32) for side in (self.left, self.right))
        written = write(
            escaped, offsets.ctypes.data, left.ctypes.data, right.ctypes.data, len(self), opening, between, closing,
            out,
        )  # fmt: skip
        return out.raw[:written].decode("utf-8")

    def _escaped(self, blob: np.ndarray) -> tuple[bytes, np.ndarray]:
        """The members' UTF-8 as JSON strings hold them (quotes, backslashes and control characters escaped, as
        ``json.dumps`` escapes them), one after another, and where each starts."""
        special = np.flatnonzero((blob < 0x20) | (blob == ord('"')) | (blob == ord("\\")))
        if not len(special):
            return self.text, self.offsets
        marked = set((np.searchsorted(self.offsets, special, "right") - 1).tolist())
        spelled = [
            json.dumps(member, ensure_ascii=False)[1:-1] if index in marked else member
            for index, member in enumerate(self.members)
        ]
        return _utf8(spelled)


def _utf8(strings: Sequence[str]) -> tuple[bytes, np.ndarray]:
    """The strings' UTF-8 bytes one after another, and where each starts (one more: where the last ends)."""
    encoded = [string.encode("utf-8") for string in strings]
    return b"".join(encoded), np.fromiter(accumulate(map(len, encoded), initial=0), np.int64, len(encoded) + 1)
