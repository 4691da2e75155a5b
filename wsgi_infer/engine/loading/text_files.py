"""A GGUF's text files: its config (resolved by its architecture's class), generation config and tokenizer, as a
converted copy keeps them. All of a conversion but where the tensors lie (``gguf_checkpoint``).

None of it needs torch, and without torch transformers imports an architecture's config class in a fraction of the
time: with torch it imports its distributed tensors and sympy too (0.9 s of a 1B's first start, Intel Xeon). So a
server's first start has a process that never imports torch make them (``server.gunicorn.text_files_ahead``) while
its workers import theirs: ``prepare_text_files`` writes them beside the copy, under the copy's lock, and the
conversion that follows takes them (``take_text_files``) or, where none were made, makes them itself.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..runtime.cache_files import read_json, write_json
from ..text.builtin_chat_templates import BUILTIN_TEMPLATES
from .model_paths import conversion_lock, converted_gguf_dir, gguf_identity
from .resolved_config import resolve_config

log = logging.getLogger(__name__)


def write_text_files(gguf: Path, directory: Path) -> None:
    """The file's config, generation config and tokenizer into ``directory``, and its resolved config into the
    cache (``resolved_config``)."""
    from transformers import GenerationConfig

    from .gguf_config import read_gguf_config
    from .gguf_tokenizer import read_gguf_tokenizer

    config = read_gguf_config(gguf)
    tokenizer = read_gguf_tokenizer(gguf)
    config.save_pretrained(directory)
    resolve_config(directory)  # while its class is imported: no later load imports it
    generation = GenerationConfig.from_model_config(config)
    builtin = BUILTIN_TEMPLATES.get(config.model_type)
    if builtin is not None:
        if not tokenizer.chat_template:
            log.info("model %s: no chat template in the file; using %s's own", gguf.name, config.model_type)
            tokenizer.chat_template = builtin.template
        end_of_turn = tokenizer.convert_tokens_to_ids(builtin.end_of_turn)
        generation.eos_token_id = sorted({config.eos_token_id, end_of_turn})
    generation.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    _list_added_tokens(directory, tokenizer)


def _list_added_tokens(model_dir: Path, tokenizer) -> None:
    """Keep the added tokens in tokenizer_config.json too (transformers 5 writes them in tokenizer.json only): a
    load without them parses the whole tokenizer.json in Python to find them, 0.1-0.2 s of every start."""
    settings = read_json(model_dir / "tokenizer_config.json")
    added = {str(index): token.__getstate__() for index, token in tokenizer.added_tokens_decoder.items()}
    write_json(model_dir / "tokenizer_config.json", settings | {"added_tokens_decoder": added})


def text_files_dir(target: Path) -> Path:
    """Where text files made ahead of its conversion waits for it: beside the copy ``target``."""
    return target.with_name(f".{target.name}.text-files")


def prepare_text_files(gguf: Path) -> bool:
    """Make the text files of a GGUF not yet converted, ahead of its conversion; whether one was made."""
    target = converted_gguf_dir(gguf, gguf_identity(gguf))
    with conversion_lock(target):
        if (target / "config.json").is_file() or text_files_dir(target).is_dir():
            return False
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".text-files-", dir=target.parent))
        try:
            write_text_files(gguf, staging)
            os.replace(staging, text_files_dir(target))
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return True


def take_text_files(target: Path, staging: Path) -> bool:
    """Move text files made ahead (``prepare_text_files``) into a conversion's ``staging``; whether there were.
    The caller holds the copy's lock."""
    ready = text_files_dir(target)
    if not ready.is_dir():
        return False
    for path in ready.iterdir():
        os.replace(path, staging / path.name)
    ready.rmdir()
    return True
