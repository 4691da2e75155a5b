"""Where transformers' GGUF processor for a file's architecture puts each tensor's rows (llama.cpp's permutation of
the query and key rows, undone), and which tensors it changes otherwise (Gemma's norms, stored less one; GPT-2's
Conv1D weights, transposed), by the file's tensor names: what a conversion records so that a load reads the file's
own blocks in our row order (``file_weights``).

Found with the config, from the file's table and the processor alone: no torch. So the process that reads a first
start's text files ahead finds them with the config (``text_files``), and the worker's conversion imports neither
the processors nor transformers' index of every model that they import (0.33 s of a first start, AMD EPYC Zen 4).
Of a vector it changes (a norm, a bias: small), the processor's values are kept too, beside the file's: a load whose
file still holds those takes them and imports no processor either (Gemma's norms made every load import it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_ROW_ORDERS_FILE = "gguf_row_orders.npz"  # beside a config read: the orders by GGUF name, and the processed names
_PROCESSED = "processed"  # its array of those names (no tensor's name: every one ends in .weight or .bias)
FILE_VALUES, PROCESSED_VALUES = "file:", "processed:"  # before a vector's name: its values, the file's and processed
_KEPT = (FILE_VALUES, PROCESSED_VALUES)


@dataclass
class RowOrders:
    orders: dict[str, np.ndarray]  # GGUF name -> our row r is the file's order[r], where the processor moves rows
    processed: set[str]  # GGUF names of the tensors it changes beyond their rows' order
    kept: dict[str, tuple[np.ndarray, np.ndarray]]  # GGUF name of a vector it changes -> its values: file's, its


def write_row_orders(gguf: Path, config: dict, directory: Path) -> None:
    """The row orders of every tensor of ``gguf`` under the processor for ``config`` (a resolved config's values),
    into ``directory``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from .gguf_file import tensor_table

    architecture, tensors = tensor_table(gguf)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    orders, processed, kept = {}, [], {}
    for tensor in tensors:
        if len(tensor.shape) != 2:  # a norm's, a bias's: the processor's output for its values, against them
            try:
                values = tensor.array().reshape(tensor.shape)
            except ValueError:  # a type gguf-py cannot read: said by name where a load reads it
                continue
            output = np.asarray(processor.process(weights=values.copy(), name=tensor.name).weights)
            if not np.array_equal(output, values):
                processed.append(tensor.name)
                kept[tensor.name] = (values, output)
            continue
        rows = np.arange(tensor.shape[0], dtype=np.float32)[:, None]
        moved = processor.process(weights=rows, name=tensor.name).weights
        if moved.shape != rows.shape or not np.array_equal(np.sort(moved, axis=0), rows):
            processed.append(tensor.name)
        elif not np.array_equal(moved, rows):
            orders[tensor.name] = moved[:, 0].astype(np.int64)
    np.savez(
        directory / GGUF_ROW_ORDERS_FILE, **orders, **kept_arrays(kept), **{_PROCESSED: np.array(processed, dtype=str)}
    )


def kept_arrays(kept: dict[str, tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """Vectors' values, the file's and the processor's, by name, as arrays to save beside row orders."""
    arrays = {FILE_VALUES + name: values for name, (values, _) in kept.items()}
    return arrays | {PROCESSED_VALUES + name: output for name, (_, output) in kept.items()}


def kept_values(saved: Mapping[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """What ``kept_arrays`` gave, from the arrays saved."""
    names = [key.removeprefix(PROCESSED_VALUES) for key in saved if key.startswith(PROCESSED_VALUES)]
    return {name: (saved[FILE_VALUES + name], saved[PROCESSED_VALUES + name]) for name in names}


def read_row_orders(directory: Path) -> RowOrders:
    """What ``write_row_orders`` wrote into ``directory``."""
    with np.load(directory / GGUF_ROW_ORDERS_FILE) as npz:
        saved = {name: npz[name] for name in npz.files}
    processed = set(saved.pop(_PROCESSED).tolist())
    orders = {name: order for name, order in saved.items() if not name.startswith(_KEPT)}
    return RowOrders(orders, processed, kept_values(saved))
