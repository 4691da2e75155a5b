"""A model's text side: its tokenizer and grammar compiler, which outlive its weights.

Building them holds the GIL, so every stream of the worker waits while they are built: Gemma 3's 262,144-token
tokenizer takes 1.3 s, llguidance's view of it (built by the first constrained request) 2.4 s more. Neither
depends on the weights, so a load takes the text side a model had at its last load, where the server kept it
(the hub keeps it while its memory budget has room: ``server.engine_client.residency``), or the one a worker built
as it started (``prepared_text_side``), before it served anyone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .loading.model_loader import load_config, load_tokenizer, resolve_model_dir
from .loading.model_paths import is_embedding_model
from .sampling.grammar import GrammarCompiler

log = logging.getLogger(__name__)

# Memory held per byte of tokenizer.json, measured (resident set, after malloc_trim) on SmolLM2's (3.4 MB) and
# Gemma 3's (33 MB): the tokenizer with transformers' wrapper 5.6 and 3.4, llguidance's view 9.3 and 5.2.
TOKENIZER_BYTES = 6
VOCABULARY_BYTES = 10


@dataclass(frozen=True)
class TextSide:
    model_dir: Path
    tokenizer: Any  # transformers' (its Rust backend is what holds the memory)
    grammars: GrammarCompiler | None  # None for an embedding model: nothing to constrain
    json_bytes: int  # its tokenizer.json's size, read once: the hub weighs text sides at every load it considers

    def memory_bytes(self) -> int:
        """What keeping it holds, estimated from its tokenizer.json (and whether a grammar built its vocabulary)."""
        built = self.grammars is not None and self.grammars.vocabulary.cache_info().currsize > 0
        return self.json_bytes * (TOKENIZER_BYTES + (VOCABULARY_BYTES if built else 0))


def text_side(model_dir: Path, kept: TextSide | None, vocab_size: int | None) -> TextSide:
    """``kept`` where it is this directory's (a model file replaced since is prepared in another directory), else a
    new one: with a grammar compiler for a vocabulary of ``vocab_size`` (None: an embedding model, none)."""
    if kept is not None and kept.model_dir == model_dir:
        log.info("%s: its text side kept from its last load", model_dir.name)
        return kept
    tokenizer = load_tokenizer(model_dir)
    grammars = GrammarCompiler(tokenizer, vocab_size) if vocab_size is not None else None
    json_file = model_dir / "tokenizer.json"  # absent where transformers converted another form: not weighed
    return TextSide(model_dir, tokenizer, grammars, json_file.stat().st_size if json_file.is_file() else 0)


def prepared_text_side(model: str | None) -> TextSide:
    """``model``'s text side ahead of its first load (``PrepareText``): its directory resolved (a GGUF's converted
    once), its config read for the grammar's vocabulary (an embedding model has none)."""
    model_dir = resolve_model_dir(model)
    vocab_size = None if is_embedding_model(model_dir) else load_config(model_dir).vocab_size
    return text_side(model_dir, None, vocab_size)
