"""A GGUF's text files: its config (resolved by its architecture's class), generation config and tokenizer, as a
converted copy keeps them. All of a conversion but where the tensors lie (``gguf_checkpoint``).

None of it needs torch, and without torch transformers imports an architecture's config class in a fraction of the
time: with torch it imports its distributed tensors and sympy too (0.9 s of a 1B's first start, Intel Xeon). So a
server's first start has a process that never imports torch make them (``server.gunicorn.text_files_ahead``) while
its workers import theirs, in two halves, as a worker needs them:

- the config and the tensors' row orders (``read_config_ahead``), under the copy's lock, which the conversion takes
  (``take_files``) to find where the tensors lie,
- while that process reads the tokenizer (``read_tokenizer_ahead``: 1.3 s of Gemma 3's 262,144 tokens), under the
  tokenizer's lock. A conversion that finds it held commits the copy without them, and the copy's first tokenizer
  load (before the weights') waits for them (``complete_tokenizer_files``), or reads them itself where that process
  ended without (the server's hub then imports transformers' readers for it: ``native_threads.set_importer``).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

from ..runtime.cache_files import held_elsewhere, read_json, write_json
from ..text.builtin_chat_templates import BUILTIN_TEMPLATES
from .model_paths import conversion_lock, converted_gguf_dir, gguf_identity, tokenizer_lock, tokenizer_lock_file
from .resolved_config import resolve_config
from .row_orders import write_row_orders

log = logging.getLogger(__name__)

TOKENIZER_MARK = "tokenizer_config.json"  # a copy's tokenizer files are all there where this one is (moved last)


def write_config_files(gguf: Path, directory: Path):
    """The file's config into ``directory``, its resolved config into the cache (``resolved_config``), and the
    tensors' row orders under it into ``directory`` (``row_orders``); the config."""
    from .gguf_config import read_gguf_config

    config = read_gguf_config(gguf)
    config.save_pretrained(directory)
    values = resolve_config(directory)  # while its class is imported: no later load imports it
    write_row_orders(gguf, values, directory)  # as a later load's processor reads them: with the resolved values
    return config


def write_tokenizer_files(gguf: Path, directory: Path, config=None) -> None:
    """The file's tokenizer and generation config (its end of turn is a token) into ``directory``; ``config``: the
    file's, read again where not given."""
    from transformers import GenerationConfig
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    from .gguf_config import read_gguf_config
    from .gguf_tokenizer import read_gguf_tokenizer, tokenizer_json_saver

    config = config if config is not None else read_gguf_config(gguf)
    tokenizer, merges = read_gguf_tokenizer(gguf)
    generation = GenerationConfig.from_model_config(config)
    builtin = BUILTIN_TEMPLATES.get(config.model_type)
    if builtin is not None:
        if not tokenizer.chat_template:
            log.info("model %s: no chat template in the file; using %s's own", gguf.name, config.model_type)
            tokenizer.chat_template = builtin.template
        end_of_turn = tokenizer.convert_tokens_to_ids(builtin.end_of_turn)
        generation.eos_token_id = sorted({config.eos_token_id, end_of_turn})
    generation.save_pretrained(directory)
    with mock.patch.object(TokenizersBackend, "_save_pretrained", tokenizer_json_saver(merges)):  # with its merges
        tokenizer.save_pretrained(directory)
    _list_added_tokens(directory, tokenizer)


def _list_added_tokens(model_dir: Path, tokenizer) -> None:
    """List the special added tokens in tokenizer_config.json too (transformers 5 writes them in tokenizer.json only):
    a load without a list parses the whole tokenizer.json in Python to find them, 0.1-0.2 s of every start. The
    others (a vocabulary's user-defined tokens) stay in tokenizer.json alone, where the backend reads them: every load
    deep-copies each one listed (the Qwen3 shape's 102,784 took its tokenizer's load from 1.3 to 3.3 s)."""
    settings = read_json(model_dir / "tokenizer_config.json")
    named = set(tokenizer.all_special_tokens)
    added = {
        str(index): token.__getstate__()
        for index, token in tokenizer.added_tokens_decoder.items()
        if token.special or token.content in named
    }
    write_json(model_dir / "tokenizer_config.json", settings | {"added_tokens_decoder": added})


def config_files_dir(target: Path) -> Path:
    """Where a config read ahead of its conversion waits for it: beside the copy ``target``."""
    return target.with_name(f".{target.name}.config-files")


def tokenizer_files_dir(target: Path) -> Path:
    """Where a tokenizer read ahead waits for the copy ``target`` (or its conversion)."""
    return target.with_name(f".{target.name}.tokenizer-files")


def _write_into(ready: Path, write: Callable[[Path], object]):
    """``write(staging)``, then the staging directory renamed ``ready``: whole or not at all; what ``write`` gave."""
    staging = Path(tempfile.mkdtemp(prefix=".text-files-", dir=ready.parent))
    try:
        written = write(staging)
        os.replace(staging, ready)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def read_config_ahead(gguf: Path) -> tuple[ExitStack, object] | None:
    """The first half of a GGUF's text files made ahead: its config, where the file is not yet converted; the
    tokenizer's lock (held until ``read_tokenizer_ahead`` releases it) and the config, or None."""
    target = converted_gguf_dir(gguf, gguf_identity(gguf))
    held = ExitStack()
    with held:
        held.enter_context(tokenizer_lock(target))
        with conversion_lock(target):
            if (target / "config.json").is_file() or config_files_dir(target).is_dir():
                return None
            target.parent.mkdir(parents=True, exist_ok=True)
            config = _write_into(config_files_dir(target), lambda staging: write_config_files(gguf, staging))
        return held.pop_all(), config


def read_tokenizer_ahead(gguf: Path, held: ExitStack, config) -> None:
    """The second half: the tokenizer files, then the tokenizer's lock released."""
    target = converted_gguf_dir(gguf, gguf_identity(gguf))
    with held:
        _write_into(tokenizer_files_dir(target), lambda staging: write_tokenizer_files(gguf, staging, config))


def tokenizer_being_read(target: Path) -> bool:
    """Whether another process holds the tokenizer's lock of the copy ``target`` (reads its tokenizer ahead)."""
    return held_elsewhere(tokenizer_lock_file(target))


def tokenizer_still_read_ahead(target: Path) -> bool:
    """Whether the copy ``target`` was committed without its tokenizer, which another process still reads."""
    return not (target / TOKENIZER_MARK).is_file() and tokenizer_being_read(target)


def take_files(ready: Path, into: Path) -> bool:
    """Move files made ahead (in ``ready``) into ``into`` (a conversion's staging directory, or a copy waiting for
    its tokenizer: the mark last); whether there were. The caller holds the lock they were made under."""
    if not ready.is_dir():
        return False
    for path in sorted(ready.iterdir(), key=lambda path: path.name == TOKENIZER_MARK):
        os.replace(path, into / path.name)
    ready.rmdir()
    return True


def complete_tokenizer_files(gguf: Path, target: Path, before_reading: Callable[[], None]) -> None:
    """The tokenizer files of a copy committed without them (``tokenizer_being_read``): taken once read ahead, or
    read now where that process ended without them, ``before_reading`` called first."""
    if (target / TOKENIZER_MARK).is_file():
        return
    with tokenizer_lock(target):
        if (target / TOKENIZER_MARK).is_file() or take_files(tokenizer_files_dir(target), target):
            return
        log.info("model %s: reading its tokenizer into %s (once)", gguf.name, target)
        before_reading()
        staging = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
        try:
            write_tokenizer_files(gguf, staging)
            take_files(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
