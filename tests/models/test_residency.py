"""Which models stay loaded: the budget's arithmetic and the least recently used choice (the fast tier)."""

from __future__ import annotations

from wsgi_infer.server.engine_client.residency import CONVERTED_COPY, Resident, default_budget, evictions, footprint

MB = 1 << 20


def residents(*specs: tuple[str, int, float, bool]) -> list[Resident]:
    return [Resident(name, size * MB, used, busy) for name, size, used, busy in specs]


def test_a_model_that_fits_unloads_nothing():
    assert evictions(100 * MB, residents(("a", 200, 1.0, False)), 400 * MB, 0) == []


def test_the_least_recently_used_idle_models_make_room():
    loaded = residents(("old", 100, 1.0, False), ("busy", 100, 0.5, True), ("recent", 100, 3.0, False))
    assert evictions(150 * MB, loaded, 400 * MB, 0) == ["old"]
    assert evictions(250 * MB, loaded, 400 * MB, 0) == ["old", "recent"]  # never the busy one, however old


def test_no_room_when_the_busy_models_fill_the_budget():
    loaded = residents(("busy", 300, 1.0, True), ("idle", 50, 0.0, False))
    assert evictions(200 * MB, loaded, 400 * MB, 0) is None
    assert evictions(500 * MB, [], 400 * MB, 0) is None  # larger than the whole budget


def test_the_most_loaded_models_count_too():
    loaded = residents(("a", 1, 1.0, False), ("b", 1, 2.0, False))
    assert evictions(1 * MB, loaded, 400 * MB, 2) == ["a"]
    assert evictions(1 * MB, loaded, 400 * MB, 3) == []
    assert evictions(1 * MB, residents(("a", 1, 1.0, True)), 400 * MB, 1) is None


def test_a_footprint_is_the_files_and_the_kv_budget(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"\0" * (10 * MB))
    assert footprint(gguf, 64) == int(10 * MB * CONVERTED_COPY) + 64 * MB
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "model.safetensors").write_bytes(b"\0" * (3 * MB))
    (hf / "config.json").write_text("{}")
    assert footprint(hf, None) == 3 * MB + 256 * MB  # the CPU's default KV budget


def test_the_default_budget_is_a_share_per_worker():
    assert 0 < default_budget(4) * 4 <= default_budget(1) * 4 + 4
    assert default_budget(2) < default_budget(1)
