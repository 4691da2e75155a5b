"""What transformers computes in float32 for a checkpoint: the reference our engine must equal."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
from transformers.initialization import no_init_weights

from wsgi_infer.engine.loading.checkpoint_tensors import CheckpointTensors
from wsgi_infer.engine.loading.file_weights import FileWeights


def load_hf_model(model_dir, dtype: torch.dtype = torch.float32):
    """transformers' own model for a checkpoint directory. A converted GGUF keeps its 2-D weights only in the GGUF:
    its model is given the checkpoint's tensors as our reader dequantizes them there (gguf-py's values)."""
    model_dir = Path(model_dir)
    if not FileWeights(model_dir):
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with no_init_weights():  # every weight is loaded next: Gemma 3 270M drew random ones first for 2 s more
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(dict(CheckpointTensors(model_dir, dtype).items()), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    model.tie_weights()  # the head is the embedding's own tensor where the config ties them, as it was made
    model.generation_config = GenerationConfig.from_pretrained(model_dir, local_files_only=True)
    return model.eval()


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


# What from_pretrained writes back of its own arguments into a tokenizer's settings (conversions before 2026-11-30
# kept them too): nothing a load reads.
LOADING_ARGUMENTS = ("is_local", "local_files_only")


def assert_tokenizer_as_transformers_reads(gguf: Path, converted: Path, saved: Path) -> None:
    """A converted GGUF's tokenizer is the one transformers' GGUF loading gives the same file: its ``tokenizer.json``
    read as the same tokenizer (written with its merges as strings, ``tokenizer_json``), the file's chat template byte
    for byte, the same settings, and the special added tokens also listed in them (so that a load need not parse
    ``tokenizer.json`` to find them), the others read from ``tokenizer.json``."""
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    reference = TokenizersBackend.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    reference.save_pretrained(saved)
    merges = json.loads((converted / "tokenizer.json").read_bytes())["model"].get("merges", [])
    assert all(isinstance(merge, str) for merge in merges)
    read, expected = (Tokenizer.from_file(str(d / "tokenizer.json")).to_str() for d in (converted, saved))
    assert read == expected
    if (saved / "chat_template.jinja").is_file():  # where the file has none, a conversion adds its family's own
        assert (converted / "chat_template.jinja").read_bytes() == (saved / "chat_template.jinja").read_bytes()
    settings, expected = (json.loads((d / "tokenizer_config.json").read_text()) for d in (converted, saved))
    added = settings.pop("added_tokens_decoder")
    assert {k: v for k, v in settings.items() if k not in LOADING_ARGUMENTS} == {
        k: v for k, v in expected.items() if k not in LOADING_ARGUMENTS
    }
    named = set(reference.all_special_tokens)
    assert {int(i): t["content"] for i, t in added.items()} == {
        i: t.content for i, t in reference.added_tokens_decoder.items() if t.special or t.content in named
    }
    loaded = TokenizersBackend.from_pretrained(converted)  # the others are read from tokenizer.json
    assert loaded.added_tokens_decoder == reference.added_tokens_decoder
    assert loaded.special_tokens_map == reference.special_tokens_map
