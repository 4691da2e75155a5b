"""A first start's GGUF text files made ahead, by a process that never imports torch.

In the master's process, before any worker (``wsgi-infer serve`` before it imports gunicorn, else gunicorn's hook):
``start_text_files_ahead`` starts this module as a process, which reads the settings' models and, for each GGUF not
yet converted (those loaded at start first), writes its config and tokenizer (``engine.loading.text_files``) under
the copy's locks while the workers import torch and transformers: every config first, then every tokenizer. A
worker's conversion then takes them, where it would have imported the config's class with torch (0.9 s of a 1B's
first start, Intel Xeon), and finds where the weights lie while a tokenizer is still being read (Gemma 3's 1.3 s).
What this process cannot read, or reads too late, the worker reads itself, and says why a file is unreadable: this
one says nothing of it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Mapping

from ...engine.runtime.cpu_budget import cpu_budget

log = logging.getLogger(__name__)


_started = False  # the master's process starts it once, wherever called first


def start_text_files_ahead() -> None:
    """Start the process where the settings may name a GGUF and a second CPU lets it run beside the workers' imports;
    returns at once (the copies' locks order it with the workers' conversions). ``wsgi-infer serve`` calls it before
    it imports gunicorn and the server's configuration, where the master's hook would start it after them: Gemma 3
    270M's first start waited for its tokenizer that much less (4.39 -> 3.90 s, Intel Xeon, 2026-12-07); the hook
    calls it for ``gunicorn -c``."""
    global _started
    if not _started and may_name_a_gguf(os.environ) and cpu_budget().cpus >= 2:
        subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.DEVNULL)
        _started = True


def may_name_a_gguf(environ: Mapping[str, str]) -> bool:
    """Whether the settings may serve a GGUF: read from the variables' text, as the master does not parse settings
    (0.12 s of every start). The default model is one; a model named by a path not ending in .gguf is not."""
    model = environ.get("WSGI_INFER_MODEL")
    more = any(environ.get(f"WSGI_INFER_{name}") for name in ("MODELS", "MODELS_DIR", "MODELS_CONFIG"))
    return not model or model.endswith(".gguf") or more


def main() -> None:
    # Before transformers is imported: it then reads configs and tokenizers as it does where torch is not installed.
    sys.modules["torch"] = None
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"  # not its warning that torch is missing
    gunicorn_format = "[%(asctime)s] [%(process)d] [%(levelname)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=gunicorn_format, datefmt="%Y-%m-%d %H:%M:%S %z")
    from ...engine.loading.model_paths import is_gguf
    from ...engine.loading.text_files import read_config_ahead, read_tokenizer_ahead
    from ..model_specs import model_specs
    from ..settings import ServerSettings

    try:
        specs = sorted(model_specs(ServerSettings()), key=lambda spec: not spec.preload)
    except Exception:  # the workers say what is wrong with the settings
        return
    begun = []  # every config first: a worker loads a model's weights while its tokenizer is read
    for path in (spec.files for spec in specs):
        try:
            if is_gguf(path) and (held := read_config_ahead(path)) is not None:
                begun.append((path, held))
        except Exception:  # the worker's conversion reads the file again, and says why it cannot
            continue
    for path, (lock, config) in begun:
        try:
            read_tokenizer_ahead(path, lock, config)
            log.info("model %s: its config and tokenizer read ahead of its conversion", path.name)
        except Exception:  # as above: its copy's tokenizer load reads it again
            continue


if __name__ == "__main__":
    main()
