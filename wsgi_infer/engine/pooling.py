"""A generating model's embedding of its prompt: the final hidden states pooled as the prompt's chunks are computed
(the last position's, or a running sum for the mean), then L2-normalized, as OpenAI's and llama-server's are."""

from __future__ import annotations

import torch

from .model_runner import PooledRows
from .scheduling.sequence import Sequence


def pool(rows: PooledRows) -> None:
    """Fold a step's rows of one prompt into its sequence's pooled state."""
    seq = rows.seq
    if seq.params.pooling == "last":
        seq.pooled = rows.hidden[-1]
    else:  # mean: a running sum, row after row, whichever chunks the prompt came in (a sum over a chunk's rows
        for row in rows.hidden:  # adds them in an order of its own: an embedding moved)
            seq.pooled = row.clone() if seq.pooled is None else seq.pooled + row
    seq.num_pooled = rows.first + len(rows.hidden)


def embedding(seq: Sequence) -> list[float]:
    """The prompt's pooled final hidden states (a mean over its positions, or the last one's), L2-normalized."""
    pooled = seq.pooled / seq.num_prompt_tokens if seq.params.pooling == "mean" else seq.pooled
    return torch.nn.functional.normalize(pooled, dim=0).tolist()
