"""What transformers computes in float32 for a checkpoint: the reference our engine must equal."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def load_hf_model(model_dir, dtype: torch.dtype = torch.float32):
    """transformers' own model for a checkpoint directory."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)


def reference_greedy(model_dir, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = load_hf_model(model_dir, torch.float32)
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


def reference_prompt_logprobs(model_dir, prompt_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each prompt position, of the prompt token that follows."""
    model = load_hf_model(model_dir, torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    return logprobs[:-1].gather(1, torch.tensor(prompt_ids[1:]).unsqueeze(1)).squeeze(1)
