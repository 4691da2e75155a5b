"""llguidance through its C interface (``llguidance.h``, the one llama.cpp uses), called with ``ctypes``.

Its Python binding holds the GIL while it builds its view of a vocabulary: 1.6-1.9 s for Gemma 3's 262,144 tokens
(Intel Xeon, 2026-12-01), in which a server's hub and its engine thread both stood still. ``ctypes`` releases the
GIL around every foreign call, so here the same build (1.2 s) and each grammar's compile stall nobody. The
functions live in the Python package's own extension module, so the library is the one pip installed.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable

import llguidance._lib

_LIB = ctypes.CDLL(llguidance._lib.__file__)
_ERROR_BYTES = 1024
# LlgTokenizeFn: (user data, bytes, their length, tokens out, room for them) -> how many tokens the bytes make.
_TokenizeFn = ctypes.CFUNCTYPE(
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint8),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_uint32),
    ctypes.c_size_t,
)


class _TokenizerInit(ctypes.Structure):
    """``LlgTokenizerInit``, whose layout the library keeps for callers built against older headers."""

    _fields_ = [
        ("vocab_size", ctypes.c_uint32),
        ("tok_eos", ctypes.c_uint32),
        ("token_lens", ctypes.c_void_p),
        ("token_bytes", ctypes.c_void_p),
        ("tokenizer_json", ctypes.c_char_p),
        ("tokenize_assumes_string", ctypes.c_bool),
        ("tokenize_fn", _TokenizeFn),
        ("use_approximate_greedy_tokenize_fn", ctypes.c_bool),
        ("tokenize_user_data", ctypes.c_void_p),
        ("slices", ctypes.c_void_p),
    ]


# ``LlgConstraintInit`` is filled by the library alone (llg_constraint_init_set_defaults): room for it and for fields
# a later version may append (80 bytes in 1.9), so that its layout is never spelled out here.
_ConstraintInit = ctypes.c_char * 512


def _declare(name: str, restype, *argtypes) -> None:
    function = getattr(_LIB, name)
    function.restype, function.argtypes = restype, list(argtypes)


_P = ctypes.c_void_p
_declare("llg_new_tokenizer", _P, ctypes.POINTER(_TokenizerInit), ctypes.c_char_p, ctypes.c_size_t)
_declare("llg_free_tokenizer", None, _P)
_declare("llg_constraint_init_set_defaults", None, _P, _P)
_declare("llg_new_matcher", _P, _P, ctypes.c_char_p, ctypes.c_char_p)
_declare("llg_clone_matcher", _P, _P)
_declare("llg_free_matcher", None, _P)
_declare("llg_matcher_is_error", ctypes.c_bool, _P)
_declare("llg_matcher_get_error", ctypes.c_char_p, _P)
_declare("llg_matcher_consume_token", ctypes.c_int32, _P, ctypes.c_uint32)
_declare("llg_matcher_is_stopped", ctypes.c_bool, _P)
_declare("llg_matcher_is_accepting", ctypes.c_bool, _P)
_declare("llg_matcher_compute_mask_into", ctypes.c_int32, _P, _P, ctypes.c_size_t)
_declare("llg_matcher_get_mask_byte_size", ctypes.c_size_t, _P)
# llg_matcher_compute_mask_into's address, for C that fills many matchers' masks at once (the CPU kernels'
# fill_masks): each matcher is its own, so several threads may fill different ones.
COMPUTE_MASK_INTO: int = ctypes.cast(_LIB.llg_matcher_compute_mask_into, ctypes.c_void_p).value
NO_TOKEN_ALLOWED = "NoExtensionBias"  # the error of a mask that would allow nothing: no text completes the grammar


def _angle_bracketed_tokens_special(tokenizer_json: bytes) -> bytes:
    """The file with its added tokens written ``<...>`` marked special: the Python binding takes them as special
    (control tokens such as Gemma 3's ``<start_of_image>`` seldom say they are), so no free text holds them; the C
    interface reads the mark alone. Only the ``added_tokens`` list is decoded and written again (Gemma 3's 6,384
    entries, 1.2 MB of a 33 MB file: the whole file's text took 0.15 s of the GIL)."""
    key = b'"added_tokens":'
    start = tokenizer_json.find(key)
    if start < 0:
        return tokenizer_json
    start += len(key)
    window = 1 << 20
    while True:  # a window large enough to hold the list (a character cut at its end is dropped)
        text = tokenizer_json[start : start + window].decode(errors="ignore")
        try:
            added, end = json.JSONDecoder().raw_decode(text.lstrip())
            break
        except json.JSONDecodeError:
            if start + window >= len(tokenizer_json):
                raise
            window *= 4
    end += len(text) - len(text.lstrip())
    marked = [
        token | {"special": True} if token["content"].startswith("<") and token["content"].endswith(">") else token
        for token in added
    ]
    return tokenizer_json[:start] + json.dumps(marked).encode() + tokenizer_json[start + len(text[:end].encode()) :]


class Vocabulary:
    """llguidance's view of a tokenizer: each token's bytes (read from its ``tokenizer.json``), in a trie, with
    the slices that make masks fast, and the tokenizer's own ``encode`` (text to ids, no special tokens added):
    where a grammar forces text, only its canonical tokens are allowed, as with llguidance's Python binding."""

    def __init__(
        self, tokenizer_json: bytes, vocab_size: int, eos_token_id: int, encode: Callable[[str], list[int]]
    ) -> None:
        def tokenize(_user_data, text, length: int, tokens, room: int) -> int:
            ids = encode(ctypes.string_at(text, length).decode())  # valid UTF-8: tokenize_assumes_string
            for index, token in enumerate(ids[:room]):
                tokens[index] = token
            return len(ids)

        self._tokenize = _TokenizeFn(tokenize)  # called back as long as the tokenizer lives
        init = _TokenizerInit(
            vocab_size=vocab_size,  # the model's logits may be wider than the tokenizer's vocabulary
            tok_eos=eos_token_id,
            tokenizer_json=_angle_bracketed_tokens_special(tokenizer_json),
            tokenize_assumes_string=True,
            tokenize_fn=self._tokenize,
        )
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        self._handle = _LIB.llg_new_tokenizer(ctypes.byref(init), error, _ERROR_BYTES)
        if not self._handle:
            raise ValueError(f"llguidance cannot read the tokenizer: {error.value.decode(errors='replace')}")
        self.eos_token_id = eos_token_id

    def matcher(self, grammar: str) -> Matcher:
        """A matcher of ``grammar`` (llguidance's JSON, as ``LLMatcher.grammar_from_*`` write it), perhaps in error."""
        init = _ConstraintInit()
        _LIB.llg_constraint_init_set_defaults(init, self._handle)
        return Matcher(_LIB.llg_new_matcher(init, b"llguidance", grammar.encode()), self)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            _LIB.llg_free_tokenizer(self._handle)


class Matcher:
    """A grammar's state as tokens are taken: which tokens may come next, and whether it has ended."""

    def __init__(self, handle: int, vocabulary: Vocabulary) -> None:
        self._handle = handle
        self._vocabulary = vocabulary  # its tokenizer outlives it

    def deep_copy(self) -> Matcher:
        return Matcher(_LIB.llg_clone_matcher(self._handle), self._vocabulary)

    def is_error(self) -> bool:
        return _LIB.llg_matcher_is_error(self._handle)

    def get_error(self) -> str:
        return (_LIB.llg_matcher_get_error(self._handle) or b"").decode(errors="replace")

    def consume_token(self, token: int) -> bool:
        """False where the grammar does not allow ``token`` (the matcher is then in error)."""
        return _LIB.llg_matcher_consume_token(self._handle, token) == 0

    def is_stopped(self) -> bool:
        return _LIB.llg_matcher_is_stopped(self._handle)

    def is_accepting(self) -> bool:
        return _LIB.llg_matcher_is_accepting(self._handle)

    def next_mask_error(self) -> str | None:
        """Why a copy's mask cannot be computed (the first line of its error: ``NO_TOKEN_ALLOWED`` where no token
        may come next, the end of sequence included), or None where it can; this matcher is left as it was."""
        probe = self.deep_copy()
        mask = (ctypes.c_uint8 * probe.mask_bytes())()
        if _LIB.llg_matcher_compute_mask_into(probe.handle, ctypes.addressof(mask), len(mask)) == 0:
            return None
        return (probe.get_error().strip().splitlines() or ["its mask could not be computed"])[0]

    def mask_bytes(self) -> int:
        return _LIB.llg_matcher_get_mask_byte_size(self._handle)

    @property
    def handle(self) -> int:
        """The matcher's ``LlgMatcher *``, for ``COMPUTE_MASK_INTO``; valid as long as this object lives."""
        return self._handle

    def fill_mask(self, address: int, size: int) -> None:
        """The allowed tokens' bits written at ``address`` (``size`` bytes, 32 tokens a word); a matcher in error
        allows its end-of-sequence token alone, as the Python binding's does."""
        if _LIB.llg_matcher_compute_mask_into(self._handle, address, size) != 0:
            self.mask_not_filled(address, size)

    def mask_not_filled(self, address: int, size: int) -> None:
        """After ``llg_matcher_compute_mask_into`` failed on this mask: a matcher in error allows its end-of-sequence
        token alone; any other failure is a size that is not the vocabulary's."""
        if not self.is_error():
            raise ValueError(f"a mask of {size} bytes where llguidance writes {self.mask_bytes()}")
        ctypes.memset(address, 0, size)
        eos = self._vocabulary.eos_token_id
        word = ctypes.c_uint32.from_address(address + 4 * (eos // 32))
        word.value = 1 << (eos % 32)

    def __del__(self) -> None:
        if getattr(self, "_handle", None):
            _LIB.llg_free_matcher(self._handle)
