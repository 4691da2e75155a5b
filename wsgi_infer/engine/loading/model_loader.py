"""Finding and loading checkpoints, locally only.

A model is a Hugging Face directory (config.json, safetensors, tokenizer files)
or a ``.gguf`` file. The first load of a GGUF converts it once into such a
directory in the user cache, keyed by its header's digest: its config and
tokenizer, and where each tensor lies in the GGUF, but no tensor itself: every
load reads those from the GGUF (``file_weights``), the CPU kernels its blocks as
they are.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from ..models import model_class
from ..runtime.cache_files import read_json
from ..runtime.heap import release_free_heap
from ..runtime.native_threads import call_on_importer, import_modules
from .file_weights import PROCESSOR_IMPORTS, FileWeights, copied_gguf, orphaned_copies, save_file_weights
from .model_paths import (
    ModelLoadError,
    conversion_lock,
    converted_gguf_dir,
    gguf_identity,
    is_embedding_model,
    is_gguf,
    known_gguf_identity,
    model_path,
    older_conversions,
)
from .resolved_config import read_config, resolved_config_file
from .row_orders import GGUF_ROW_ORDERS_FILE, read_row_orders
from .text_files import (
    complete_tokenizer_files,
    config_files_dir,
    take_files,
    tokenizer_being_read,
    tokenizer_files_dir,
    write_config_files,
    write_tokenizer_files,
)

log = logging.getLogger(__name__)


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """A local Hugging Face directory for ``model`` (converting GGUF on first use)."""
    path = model_path(model)
    if is_gguf(path):
        return _converted_gguf_dir(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists():
        raise ModelLoadError(
            f"model {path}: no such file or directory (expected a Hugging Face directory or a .gguf file)"
        )
    raise ModelLoadError(f"model {path}: expected a Hugging Face directory with config.json or a .gguf file")


def _converted_gguf_dir(gguf: Path) -> Path:
    target = converted_gguf_dir(gguf, gguf_identity(gguf))
    if not (target / "config.json").is_file():  # the lock only then: reading needs no write access
        with conversion_lock(target):
            if not (target / "config.json").is_file():  # another worker may have converted it meanwhile
                _convert_gguf_into(gguf, target)
    log.debug("model %s: using converted copy %s", gguf, target)  # the load names it: "loading model from"
    return target


def _convert_gguf_into(gguf: Path, target: Path) -> None:
    log.info("model %s: reading its config and tokenizer into %s (once)", gguf, target)
    started = time.monotonic()
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert_gguf(gguf, staging, target)
        shutil.rmtree(target, ignore_errors=True)  # a conversion left without its config.json (a cleaner's work)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    release_free_heap()  # a conversion's transients (a 1B model's: 500 MB), before the load's
    log.info("model %s: converted in %.1f s", gguf, time.monotonic() - started)
    for older in older_conversions(target):
        shutil.rmtree(older, ignore_errors=True)
        log.info("model %s: removed %s, an earlier version's conversion of it", gguf.name, older)
    for orphan in orphaned_copies(target.parent):
        shutil.rmtree(orphan, ignore_errors=True)
        log.info("removed %s: the GGUF it was converted from is gone", orphan)


def _convert_gguf(gguf: Path, staging: Path, target: Path) -> None:
    """Config and tokenizer (``text_files``: made ahead without torch, or now), and where the tensors lie in the
    file: none is copied (``file_weights``). Where the tokenizer is still being read ahead, the copy is committed
    without it: its first tokenizer load takes it (``load_tokenizer``), while the weights load."""
    from .gguf_checkpoint import gguf_tensors  # gguf-py: for a conversion only

    try:
        file_config = None  # the file's config where read here: the tokenizer's generation config reads it too
        if take_files(config_files_dir(target), staging):
            log.info("model %s: config read ahead (a process without torch)", gguf.name)
        else:
            file_config = write_config_files(gguf, staging)
        config = read_config(staging)
        if tokenizer_being_read(target):
            log.info("model %s: its tokenizer is being read ahead; reading where the weights lie meanwhile", gguf.name)
        elif take_files(tokenizer_files_dir(target), staging):
            log.info("model %s: tokenizer read ahead (a process without torch)", gguf.name)
        else:
            _import_text_file_readers(staging)
            write_tokenizer_files(gguf, staging, file_config)
        log.info("model %s: reading where the weights lie", gguf.name)
        places, orders, processed, kept = {}, {}, [], {}
        architecture, tensors = gguf_tensors(gguf, config, read_row_orders(staging))
        for tensor in tensors:
            places[tensor.name] = tensor.place
            if tensor.order is not None:
                orders[tensor.name] = tensor.order
            if tensor.processed:
                processed.append(tensor.name)
            if tensor.kept is not None:
                kept[tensor.name] = tensor.kept
    except ModelLoadError:
        raise
    except Exception as exc:  # transformers and gguf-py raise many kinds for unreadable files
        raise ModelLoadError(f"model {gguf}: cannot read GGUF file ({exc})") from exc
    values = read_json(resolved_config_file(staging))  # the config as its class resolved it, wherever it was read
    save_file_weights(staging, gguf, architecture, values, places, orders, processed, kept)  # by our names
    (staging / GGUF_ROW_ORDERS_FILE).unlink()


def load_config(model_dir: Path):
    """The config of a model this engine generates with (``read_config``); a clear error for any other."""
    config = read_config(model_dir)
    try:
        model_class(config.model_type)
    except ValueError as exc:
        raise ModelLoadError(f"model {model_dir}: {exc}") from None
    return config


GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # one class in transformers 5


def _generic_tokenizer(model_dir: Path) -> bool:
    return (read_json(model_dir / "tokenizer_config.json") or {}).get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES


def load_tokenizer(model_dir: Path):
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        gguf = copied_gguf(model_dir)
        if gguf is not None:  # a GGUF's copy, perhaps committed while its tokenizer was read ahead
            complete_tokenizer_files(gguf, model_dir, functools.partial(_import_text_file_readers, model_dir))
        if _generic_tokenizer(model_dir):
            # As converted GGUFs name theirs. AutoTokenizer would first index every model's module (0.5 s).
            tokenizer = TokenizersBackend.from_pretrained(model_dir, local_files_only=True)
        else:
            from transformers import AutoTokenizer

            # Given the config, AutoTokenizer does not resolve (and import) the architecture's own class.
            tokenizer = AutoTokenizer.from_pretrained(model_dir, config=read_config(model_dir), local_files_only=True)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"model {model_dir}: cannot load tokenizer ({exc})") from exc
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ModelLoadError(f"model {model_dir}: needs a fast tokenizer (tokenizer.json)")
    return tokenizer


# The modules of transformers that loading imports, for a caller whose loading thread must not import (the
# server's hub imports them first, as importing creates loggers): a prepared model's, and a first load's besides.
PREPARED_LOAD_IMPORTS = (
    "transformers.configuration_utils",
    "transformers.generation.configuration_utils",
    "transformers.modeling_rope_utils",
    "transformers.tokenization_utils_tokenizers",
)
FIRST_LOAD_IMPORTS = ("transformers.models.auto.configuration_auto", "transformers.models.auto.tokenization_auto")
# Reading a GGUF's weights from the file (a copy keeps none), those transformers' processor changes beyond their
# row order (GPT-2's), and converting one: where its text files were all made ahead, only where the tensors lie.
FILE_IMPORTS = ("gguf", "wsgi_infer.engine.loading.gguf_file")
MADE_AHEAD_CONVERSION_IMPORTS = (*FILE_IMPORTS, "wsgi_infer.engine.loading.gguf_checkpoint")
CONVERSION_IMPORTS = (
    *MADE_AHEAD_CONVERSION_IMPORTS,
    *PROCESSOR_IMPORTS,
    "transformers.integrations.gguf.gguf_tokenizer_mapping",
    "wsgi_infer.engine.loading.gguf_tokenizer",
)

# transformers' readers of a GGUF's config and tokenizer, for a conversion that reads them itself
TEXT_FILE_IMPORTS = FIRST_LOAD_IMPORTS + CONVERSION_IMPORTS
# An embedding model's class comes through transformers' modeling_utils, whose imports start scipy's BLAS threads:
# imported with the rest in the hub, they are a worker's from its start, not from its first embedding model's load.
EMBEDDING_IMPORTS = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")


def _import_text_file_readers(model_dir: Path) -> None:
    """transformers' readers of a GGUF's text files, and the class of its config (as ``model_dir`` holds it), which
    reading the file's config imports."""
    call_on_importer(_import_readers, read_config(model_dir).model_type)


def _import_readers(model_type: str) -> None:
    import_modules(TEXT_FILE_IMPORTS)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    CONFIG_MAPPING[model_type]  # a lazy mapping: this imports the class's module


def load_imports(model: str | os.PathLike | None) -> tuple[str, ...]:
    """What loading ``model`` imports, beyond the engine's own modules: a first load's auto classes (0.6 s) only where
    no earlier load prepared it (converted the GGUF, resolved the config) or its tokenizer has a class of its own;
    gguf-py where a GGUF's weights are read from the file, and transformers' GGUF processors where one of them is
    read through those. A GGUF whose config and row orders were made ahead (``text_files``), its tokenizer too or
    still being read there, is converted with none of transformers' GGUF modules, the auto classes or its index of
    every model (0.33 s, which each of those imports): if that process ends without the tokenizer, the load has them
    imported then (``native_threads.set_importer``)."""
    try:
        path = model_path(model)
        prepared = _prepared(path)
    except (ModelLoadError, OSError):
        return PREPARED_LOAD_IMPORTS + FIRST_LOAD_IMPORTS  # the load will say why
    if prepared is None and is_gguf(path) and _made_ahead(path):
        return PREPARED_LOAD_IMPORTS + MADE_AHEAD_CONVERSION_IMPORTS
    if prepared is None and is_embedding_model(path):
        return PREPARED_LOAD_IMPORTS + FIRST_LOAD_IMPORTS + EMBEDDING_IMPORTS
    if prepared is None:
        return PREPARED_LOAD_IMPORTS + FIRST_LOAD_IMPORTS + (CONVERSION_IMPORTS if is_gguf(path) else ())
    weights = FileWeights(prepared)
    return (
        PREPARED_LOAD_IMPORTS
        + (FILE_IMPORTS if len(weights) else ())
        + (PROCESSOR_IMPORTS if weights.needs_processor else ())
    )


def _made_ahead(gguf: Path) -> bool:
    """Whether a GGUF's config and row orders were made ahead of its conversion, and its tokenizer is or is being."""
    digest = known_gguf_identity(gguf)
    target = converted_gguf_dir(gguf, digest) if digest is not None else None
    return (
        target is not None
        and (config_files_dir(target) / GGUF_ROW_ORDERS_FILE).is_file()
        and (tokenizer_files_dir(target).is_dir() or tokenizer_being_read(target))
    )


def _prepared(path: Path) -> Path | None:
    """The directory a prepared model loads from (a GGUF's converted copy), or None where it is not prepared."""
    if is_gguf(path):
        digest = known_gguf_identity(path)
        if digest is None or not (converted_gguf_dir(path, digest) / "config.json").is_file():
            return None  # hashed, not converted: by a process that made its text files ahead, say
        path = converted_gguf_dir(path, digest)
    resolved = read_json(resolved_config_file(path))
    prepared = resolved is not None and _generic_tokenizer(path) and not (path / "modules.json").is_file()
    return path if prepared else None


def eos_token_ids(model_dir: Path, config, tokenizer) -> set[int]:
    """Every token id that ends generation: generation_config, config and tokenizer."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        candidates = [GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id]
    except OSError:
        candidates = []
    candidates += [getattr(config, "eos_token_id", None), tokenizer.eos_token_id]
    for value in candidates:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
