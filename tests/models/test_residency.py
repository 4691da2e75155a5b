"""Which models stay loaded: the budget's arithmetic and the least recently used choice (the fast tier)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from wsgi_infer.engine.loading.model_paths import default_model_path
from wsgi_infer.engine.messages import TextPrepared
from wsgi_infer.server.engine_client import residency
from wsgi_infer.server.engine_client.model_loads import ModelLoads
from wsgi_infer.server.engine_client.residency import (
    CONVERTED_COPY,
    Evictions,
    Resident,
    default_budget,
    evictions,
    footprint,
    kv_token_bytes,
)

MB = 1 << 20


def residents(*specs: tuple[str, int, float, bool]) -> list[Resident]:
    return [Resident(name, size * MB, used, busy) for name, size, used, busy in specs]


def test_a_model_that_fits_unloads_nothing():
    assert evictions(100 * MB, residents(("a", 200, 1.0, False)), 400 * MB, 0).unload == []


def test_the_least_recently_used_idle_models_make_room():
    loaded = residents(("old", 100, 1.0, False), ("busy", 100, 0.5, True), ("recent", 100, 3.0, False))
    assert evictions(150 * MB, loaded, 400 * MB, 0).unload == ["old"]
    assert evictions(250 * MB, loaded, 400 * MB, 0).unload == ["old", "recent"]  # never the busy one, however old


def test_no_room_when_the_busy_models_fill_the_budget():
    loaded = residents(("busy", 300, 1.0, True), ("idle", 50, 0.0, False))
    assert evictions(200 * MB, loaded, 400 * MB, 0) is None
    assert evictions(500 * MB, [], 400 * MB, 0) is None  # larger than the whole budget


def test_kept_text_sides_go_first_then_models_keep_theirs_where_room_is_left():
    kept = [Resident("old text", 0, 0.5, False, 60 * MB), Resident("newer text", 0, 2.0, False, 60 * MB)]
    loaded = [Resident("a", 100 * MB, 1.0, False, 30 * MB), Resident("b", 100 * MB, 3.0, False, 30 * MB)]
    # 380 MB held: 50 MB more needs one text side to go, the least recently used, and no model.
    assert evictions(70 * MB, kept + loaded, 400 * MB, 0) == Evictions([], ["old text"])
    # Every kept text side goes before the least recently used model unloads; its own text side stays.
    assert evictions(150 * MB, kept + loaded, 400 * MB, 0) == Evictions(["a"], ["old text", "newer text"])
    # Where unloading it is not enough, its text side goes too.
    assert evictions(260 * MB, kept + loaded, 400 * MB, 0) == Evictions(["a"], ["old text", "newer text", "a"])
    # A busy model's text side is never let go of; the count of models loaded ignores text sides.
    assert evictions(20 * MB, [Resident("t", 0, 0.0, True, 390 * MB)], 400 * MB, 0) is None
    assert evictions(1 * MB, kept, 400 * MB, 1) == Evictions()


def test_the_most_loaded_models_count_too():
    loaded = residents(("a", 1, 1.0, False), ("b", 1, 2.0, False))
    assert evictions(1 * MB, loaded, 400 * MB, 2).unload == ["a"]
    assert evictions(1 * MB, loaded, 400 * MB, 3).unload == []
    assert evictions(1 * MB, residents(("a", 1, 1.0, True)), 400 * MB, 1) is None


def test_a_footprint_is_the_files_and_the_kv_budget(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * (10 * MB))
    assert footprint(gguf, 64) == int(10 * MB * CONVERTED_COPY) + 64 * MB
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"\0" * (3 * MB))
    (hf / "config.json").write_text("{}")
    assert footprint(hf, None) == 3 * MB + 256 * MB  # the CPU's least KV budget, where the config tells nothing
    llama_3b = {"num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "hidden_size": 3072}
    (hf / "config.json").write_text(json.dumps(llama_3b | {"head_dim": 128}))
    assert kv_token_bytes(hf) == 112 * 1024  # keys and values in halves
    assert footprint(hf, None) == 3 * MB + 8192 * 112 * 1024  # room for 8,192 tokens: more than 256 MiB
    shipped = default_model_path()  # SmolLM2-135M: 30 layers of 3 KV heads of 64, 22.5 KiB a token
    assert kv_token_bytes(shipped) == 2 * 30 * 3 * 64 * 2
    assert footprint(shipped, None) == int(shipped.stat().st_size * CONVERTED_COPY) + 256 * MB
    gguf.write_bytes(b"GGUF\3\0\0\0")  # cut short: it will fail to load, and say why
    assert kv_token_bytes(gguf) == 0 and footprint(gguf, None) == int(8 * CONVERTED_COPY) + 256 * MB


@pytest.mark.parametrize(
    ("cgroup_v2", "cgroup_v1", "usable_gib"),
    [(None, None, 16), ("max", None, 16), ("8589934592", None, 8), (None, "4294967296", 4), ("68719476736", None, 16)],
    ids=["no cgroup", "v2 unlimited", "v2 8 GiB", "v1 4 GiB", "v2 above the machine"],
)
def test_the_default_budget_is_three_quarters_of_the_memory_a_share_per_worker(
    monkeypatch, tmp_path, cgroup_v2, cgroup_v1, usable_gib
):
    """3/4 of the machine's memory (16 GiB here), or of the cgroup's limit where it is lower, over the workers."""
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 4 << 20}
    monkeypatch.setattr(residency.os, "sysconf", pages.__getitem__)
    limits = {"/sys/fs/cgroup/memory.max": cgroup_v2, "/sys/fs/cgroup/memory/memory.limit_in_bytes": cgroup_v1}
    files = {name: tmp_path / str(number) for number, name in enumerate(limits)}
    for name, limit in limits.items():
        if limit is not None:
            files[name].write_text(limit + "\n")
    monkeypatch.setattr(residency, "Path", lambda name: files.get(name, Path(name)))
    for workers in (1, 2, 3, 4):
        assert default_budget(workers) == int(usable_gib * (1 << 30) * 3 / 4 / workers), workers


@dataclass
class Text:
    """A built text side as the budget sees it."""

    size: int

    def memory_bytes(self) -> int:
        return self.size


@dataclass
class Served:
    """A served model as ``ModelLoads`` weighs it."""

    name: str
    state: str
    footprint: int
    text: Text | None = None
    busy: bool = False
    last_used: float = 0.0
    failure: str | None = None

    @property
    def text_bytes(self) -> int:
        return self.text.size if self.text is not None else 0

    def on_failed(self, event) -> None:
        self.state, self.failure = "failed", event.message


def test_text_sides_built_at_start_are_kept_while_they_fit_beside_the_loaded_models():
    served = [Served("loaded", "loaded", 300 * MB, Text(20 * MB))]
    served += [Served("first", "unloaded", 200 * MB), Served("second", "unloaded", 200 * MB)]
    loads = ModelLoads({m.name: m for m in served}, lambda command: None, budget=400 * MB, most=0)
    loads.preparing = {"first", "second"}
    loads.on_text_prepared(served[1], TextPrepared("first", Text(50 * MB)))
    # 370 MB held: the second's 40 MB do not fit (its load makes room then, and builds it again)
    loads.on_text_prepared(served[2], TextPrepared("second", Text(40 * MB)))
    assert served[1].text == Text(50 * MB) and served[2].text is None and not loads.preparing
    loads.preparing = {"first"}
    loads.on_text_prepared(served[1], TextPrepared("first", None, "no such file"))  # kept from before: its load says
    assert served[1].text == Text(50 * MB) and served[1].state == "unloaded" and not loads.preparing
    loads.on_text_prepared(served[2], TextPrepared("second", None, "no such file"))  # so would its load: failed now
    assert (served[2].state, served[2].failure) == ("failed", "no such file")


def test_a_text_side_weighs_its_vocabulary_whatever_form_its_tokenizer_json_takes(tmp_path, default_model_dir):
    """The same tokenizer, compact with its merges as strings (as a conversion writes it) or indented with pairs, holds
    the same memory, though its files are 2.5x apart; llguidance's view of it, once built, weighs more."""
    from tokenizers import Tokenizer

    from wsgi_infer.engine.text_side import text_side

    indented = tmp_path / "indented"
    shutil.copytree(default_model_dir, indented)
    Tokenizer.from_file(str(indented / "tokenizer.json")).save(str(indented / "tokenizer.json"), pretty=True)
    sizes = [(d / "tokenizer.json").stat().st_size for d in (default_model_dir, indented)]
    assert sizes[1] > 2 * sizes[0]
    compact, pretty = (text_side(d, None, 49_152) for d in (default_model_dir, indented))
    assert compact.memory_bytes() == pretty.memory_bytes() >= 49_152 * 200
    compact.grammars.vocabulary()
    assert compact.memory_bytes() > 2 * pretty.memory_bytes()
