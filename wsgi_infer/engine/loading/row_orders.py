"""Where transformers' GGUF processor for a file's architecture puts each tensor's rows (llama.cpp's permutation of
the query and key rows, undone), and which tensors it changes otherwise (Gemma's norms, stored less one; GPT-2's
Conv1D weights, transposed), by the file's tensor names: what a conversion records so that a load reads the file's
own blocks in our row order (``file_weights``).

Found with the config, from the file's table and the processor alone: no torch. So the process that reads a first
start's text files ahead finds them with the config (``text_files``), and the worker's conversion imports neither
the processors nor transformers' index of every model that they import (0.33 s of a first start, AMD EPYC Zen 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_ROW_ORDERS_FILE = "gguf_row_orders.npz"  # beside a config read: the orders by GGUF name, and the processed names
_PROCESSED = "processed"  # its array of those names (no tensor's name: every one ends in .weight or .bias)


@dataclass
class RowOrders:
    orders: dict[str, np.ndarray]  # GGUF name -> our row r is the file's order[r], where the processor moves rows
    processed: set[str]  # GGUF names of the tensors it changes beyond their rows' order


def write_row_orders(gguf: Path, config: dict, directory: Path) -> None:
    """The row orders of every tensor of ``gguf`` under the processor for ``config`` (a resolved config's values),
    into ``directory``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from .gguf_file import tensor_table

    architecture, tensors = tensor_table(gguf)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    orders, processed = {}, []
    for tensor in tensors:
        if len(tensor.shape) != 2:  # a norm's, a bias's: the processor's output for its values, against them
            try:
                values = tensor.array().reshape(tensor.shape)
            except ValueError:  # a type gguf-py cannot read: said by name where a load reads it
                continue
            if not np.array_equal(processor.process(weights=values.copy(), name=tensor.name).weights, values):
                processed.append(tensor.name)
            continue
        rows = np.arange(tensor.shape[0], dtype=np.float32)[:, None]
        moved = processor.process(weights=rows, name=tensor.name).weights
        if moved.shape != rows.shape or not np.array_equal(np.sort(moved, axis=0), rows):
            processed.append(tensor.name)
        elif not np.array_equal(moved, rows):
            orders[tensor.name] = moved[:, 0].astype(np.int64)
    np.savez(directory / GGUF_ROW_ORDERS_FILE, **orders, **{_PROCESSED: np.array(processed, dtype=str)})


def read_row_orders(directory: Path) -> RowOrders:
    """What ``write_row_orders`` wrote into ``directory``."""
    with np.load(directory / GGUF_ROW_ORDERS_FILE) as saved:
        orders = {name: saved[name] for name in saved.files if name != _PROCESSED}
        return RowOrders(orders, set(saved[_PROCESSED].tolist()))
