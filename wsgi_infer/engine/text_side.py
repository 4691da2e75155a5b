"""A model's text side: its tokenizer and grammar compiler, which outlive its weights.

Building the tokenizer holds the GIL, so every stream of the worker waits while it is built: Gemma 3's 262,144
tokens take 1.3 s. llguidance's view of it (built by the first constrained request, 1.2 s more) holds none
(``text.llguidance_c``). Neither depends on the weights, so a load takes the text side a model had at its
last load, where the server kept it (the hub keeps it while its memory budget has room:
``server.engine_client.residency``), or the one a worker built as it started (``prepared_text_side``), before it
served anyone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .loading.file_weights import copied_gguf
from .loading.model_loader import load_config, load_tokenizer, resolve_model_dir
from .loading.model_paths import is_embedding_model
from .loading.text_files import tokenizer_still_read_ahead
from .runtime.heap import release_free_heap
from .sampling.grammar import GrammarCompiler

log = logging.getLogger(__name__)
Weights = TypeVar("Weights")

# Memory held per token of the vocabulary (added tokens included), measured (resident set, after malloc_trim) on
# SmolLM2's 49,152 tokens and Gemma 3's 262,144: the tokenizer with transformers' wrapper 252 and 390 bytes,
# llguidance's view of it 386 and 483 (Intel Xeon, 2026-12-01). Per byte of tokenizer.json the tokenizer's varied
# 2.5x with the file's form.
TOKENIZER_BYTES = 400
VOCABULARY_BYTES = 500
# A tokenizer read ahead that holds less than this share of the weights' memory does not hold up their load: Gemma 3
# 270M's (262,144 tokens beside 253 MB: 41%) does, the 1B shape's (49,152 beside 669 MB: 3%) does not.
TOKENIZER_SHARE = 0.1


@dataclass(frozen=True)
class TextSide:
    model_dir: Path
    tokenizer: Any  # transformers' (its Rust backend is what holds the memory)
    grammars: GrammarCompiler | None  # None for an embedding model: nothing to constrain
    tokens: int  # its vocabulary's, read once: the hub weighs text sides at every load it considers

    def memory_bytes(self) -> int:
        """What keeping it holds, estimated from its vocabulary (and whether a grammar built its own view of it)."""
        built = self.grammars is not None and self.grammars.has_vocabulary()
        return self.tokens * (TOKENIZER_BYTES + (VOCABULARY_BYTES if built else 0))


def text_side(model_dir: Path, kept: TextSide | None, vocab_size: int | None) -> TextSide:
    """``kept`` where it is this directory's (a model file replaced since is prepared in another directory), else a
    new one: with a grammar compiler for a vocabulary of ``vocab_size`` (None: an embedding model, none)."""
    if kept is not None and kept.model_dir == model_dir:
        log.info("%s: its text side kept (built as the worker started, or at its last load)", model_dir.name)
        return kept
    tokenizer = load_tokenizer(model_dir)
    grammars = GrammarCompiler(tokenizer, vocab_size) if vocab_size is not None else None
    tokens = tokenizer.backend_tokenizer.get_vocab_size(with_added_tokens=True)
    return TextSide(model_dir, tokenizer, grammars, tokens)


def with_weights(
    model_dir: Path, kept: TextSide | None, vocab_size: int | None, load_weights: Callable[[], Weights]
) -> tuple[Weights, TextSide]:
    """``load_weights()`` and ``text_side(model_dir, kept, vocab_size)``: the tokenizer read first and the heap its
    reading left given back, so that what reading it holds for a while (Gemma 3's: 60 MB above the 100 it keeps)
    comes before the weights' memory, not on top of it: Gemma 3's first start peaks at 696-698 MB instead of 743
    (llama-server 617), for 0.15 s more (its tokenizer read ahead ends 0.5 s after the worker's imports, Intel Xeon).
    Where a process still reads the tokenizer ahead (a GGUF's first start) and it is small beside the weights
    (``_weights_first``), the weights load meanwhile instead of waiting for it."""
    if kept is None and _weights_first(model_dir, vocab_size):
        log.info("%s: loading the weights while its tokenizer is read ahead", model_dir.name)
        weights = load_weights()
        return weights, text_side(model_dir, kept, vocab_size)
    text = text_side(model_dir, kept, vocab_size)
    if text is not kept:
        release_free_heap()
    return load_weights(), text


def _weights_first(model_dir: Path, vocab_size: int | None) -> bool:
    """Whether a process still reads the copy's tokenizer ahead and the tokenizer's memory is under
    ``TOKENIZER_SHARE`` of its file's weights', so that it moves the peak little: the Qwen3-1.7B shape's first start
    (1.1 GB; 151,936 tokens, 102,784 of them added) waited 1.2 s for it, idle (AMD EPYC Zen 4)."""
    if vocab_size is None or not tokenizer_still_read_ahead(model_dir):
        return False
    gguf = copied_gguf(model_dir)
    return gguf is not None and vocab_size * TOKENIZER_BYTES < TOKENIZER_SHARE * gguf.stat().st_size


def prepared_text_side(model: str | None) -> TextSide:
    """``model``'s text side ahead of its first load (``PrepareText``): its directory resolved (a GGUF's converted
    once), its config read for the grammar's vocabulary (an embedding model has none)."""
    model_dir = resolve_model_dir(model)
    vocab_size = None if is_embedding_model(model_dir) else load_config(model_dir).vocab_size
    return text_side(model_dir, None, vocab_size)
