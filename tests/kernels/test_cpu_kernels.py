"""The compiled CPU kernels compute what the torch ops they replace compute: every installed variant this CPU runs
and clang's build (which library loads: test_kernel_variants)."""

from __future__ import annotations

import pytest
import torch

from wsgi_infer import LLM
from wsgi_infer.engine import model_runner
from wsgi_infer.engine.kernels.cpu import CacheRows
from wsgi_infer.engine.layers.activation import GatedActivation
from wsgi_infer.engine.layers.norm import RMSNorm, rms_norm
from wsgi_infer.engine.layers.quantization import PackedLinear
from wsgi_infer.engine.layers.rotary import apply_rotary_
from wsgi_infer.engine.runtime.step_interrupt import StepInterrupted

from ..conftest import assert_idle
from ..support.batch_runs import GREEDY, PROMPTS, run_alone, run_staggered
from ..support.gguf_files import MIXED_TYPES, write_tiny_gguf
from ..support.kernel_libraries import randn

F32_CLOSE = dict(rtol=1e-5, atol=1e-6)  # float32 sums in another order


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_and_its_residual_add_compute_as_torch(kernels, with_residual):
    torch.manual_seed(0)
    x, residual, norm = randn(7, 576, scale=3), randn(7, 576), RMSNorm(576, 1e-5)
    norm.weight.data = randn(576)
    expected, expected_sum = norm(x, residual.clone() if with_residual else None)
    norm.kernels = kernels
    got, got_sum = norm(x, residual.clone() if with_residual else None)
    assert torch.equal(got_sum, expected_sum)  # the same float32 additions
    torch.testing.assert_close(got, expected, **F32_CLOSE)  # the sum of squares in another order


def test_head_norms_compute_as_torch_on_query_and_key_heads_only(kernels):
    """Qwen3's per-head norms, in place in the QKV rows: query heads under one weight, key heads under the
    other, the value heads untouched."""
    torch.manual_seed(0)
    qkv, q_weight, k_weight = randn(5, 4 + 2 * 2, 128, scale=3), randn(128), randn(128)
    got = qkv.clone()
    kernels.head_norm_(got, 4, 2, q_weight, k_weight, 1e-6)
    torch.testing.assert_close(got[:, :4], rms_norm(qkv[:, :4], q_weight, 1e-6), **F32_CLOSE)
    torch.testing.assert_close(got[:, 4:6], rms_norm(qkv[:, 4:6], k_weight, 1e-6), **F32_CLOSE)
    assert torch.equal(got[:, 6:], qkv[:, 6:])


def test_silu_and_mul_and_rotary_compute_as_torch(kernels):
    torch.manual_seed(0)
    for act in (GatedActivation("silu"), GatedActivation("gelu_pytorch_tanh")):
        for gate_up in (randn(5, 3072, scale=4), randn(3, 86, scale=4)):  # a register at a time, then 43's tail
            act.kernels = None
            expected = act(gate_up)
            act.kernels = kernels
            # e^x within 2 ulp; GELU's tail: torch's tanh saturates at -1 where x / (1 + e^-2y) keeps 1e-6
            torch.testing.assert_close(act(gate_up), expected, rtol=1e-5, atol=2e-6)
    qkv, cos, sin = randn(5, 15, 64), torch.randn(5, 1, 64), torch.randn(5, 1, 64)
    by_torch, by_kernel = qkv.clone(), qkv.clone()
    apply_rotary_(by_torch[:, :12], cos, sin)
    apply_rotary_(by_kernel[:, :12], cos, sin, kernels)
    assert torch.equal(by_kernel, by_torch)  # the same products and sums; the values' heads untouched
    partial_torch, partial_kernel = qkv.clone(), qkv.clone()  # a partial rotary: each head's first 48 dims
    apply_rotary_(partial_torch[:, :12], cos[..., :48], sin[..., :48])
    apply_rotary_(partial_kernel[:, :12], cos[..., :48].contiguous(), sin[..., :48].contiguous(), kernels)
    assert torch.equal(partial_kernel, partial_torch) and torch.equal(partial_torch[..., 48:], qkv[..., 48:])


def test_the_kernels_refuse_what_they_cannot_read(kernels):
    """A tensor of another dtype, rows not contiguous, or a shape the call would read past, is an error before
    the call, never a read past a buffer."""
    with pytest.raises(TypeError, match="float32"):
        kernels.silu_mul(randn(2, 64).bfloat16())
    with pytest.raises(TypeError, match="contiguous"):
        kernels.argmax(randn(64, 2).t())
    with pytest.raises(TypeError, match="rms_norm: weight"):
        kernels.rms_norm(randn(3, 64), randn(32), 1e-5, None)
    with pytest.raises(TypeError, match="gated activation"):
        kernels.silu_mul(randn(2, 63))
    with pytest.raises(TypeError, match="rotate: table"):
        kernels.rotate_(randn(5, 4, 16), randn(4, 1, 16), randn(4, 1, 16))  # tables for 4 of 5 tokens
    with pytest.raises(TypeError, match="head_norm: weights"):
        kernels.head_norm_(randn(5, 6, 16), 4, 2, randn(8), randn(8), 1e-6)
    rows = CacheRows(4, torch.zeros(1, 2, dtype=torch.long), torch.zeros(2, dtype=torch.long), torch.ones(2).long())
    with pytest.raises(TypeError, match="paged_attention: cache"):
        kernels.paged_attention(randn(2, 4, 64), randn(8, 4, 32).half(), rows, 0.125)
    with pytest.raises(TypeError, match="a row per token"):
        kernels.paged_attention(randn(3, 4, 64), randn(8, 4, 64).half(), rows, 0.125)


@pytest.mark.parametrize("vocab", [49152, 49157, 5])  # whole chunks of 16, a tail, a tail alone
def test_argmax_picks_what_torch_picks(kernels, vocab):
    """The first of equal maxima, a NaN before any number, all -inf, infinities, and rows of ties."""
    torch.manual_seed(0)
    logits = torch.randn(10, vocab)
    logits[1, vocab // 2] = logits[1, vocab - 1] = 100.0  # equal maxima far apart
    logits[9, 17 % vocab] = logits[9, 32 % vocab] = 100.0  # the earlier in a higher lane (8 or 16 of them)
    logits[2, 3 % vocab] = logits[2, vocab - 2] = float("nan")
    logits[3] = float("-inf")
    logits[4, vocab // 3] = float("inf")
    logits[5] = 1.0
    logits[6] = logits[6] * 0  # zeros and negative zeros
    logits[7, -1] = 50.0  # in the tail, where there is one
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))
    assert kernels.argmax(logits[7:8]).item() == logits[7].argmax().item()  # one row: no threads


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory) -> str:
    return str(write_tiny_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf", MIXED_TYPES).path)


@pytest.mark.parametrize(
    "arch, quantization",
    [("llama", "int4"), ("qwen2", "int4"), ("llama", "int8"), ("mixed GGUF", "auto"), ("qwen3", "int4")]
    + [("smollm3", "int8"), ("phi3", "int4"), ("gemma3", "int4")],
)  # qwen2: QKV biases; the GGUF: 4- and 8-bit projections in each layer; qwen3: q and k norms and a sliding window;
# smollm3: NoPE layers; phi3: a partial rotary; gemma3: its norms, GeGLU and RoPE per kind
def test_the_fused_decoder_equals_the_layers_one_by_one(tiny_model_dirs, mixed_gguf, arch, quantization):
    """Every step, prefill chunks included, runs every layer in one call; without it the layers' loop runs. Each
    request's tokens are the same either way, in staggered batches and alone, and every KV block is free
    afterwards."""
    llm = LLM(
        model=mixed_gguf if arch == "mixed GGUF" else str(tiny_model_dirs[arch]),
        quantization=quantization,
        block_size=4,
        max_num_batched_tokens=64,
    )
    model = llm.engine.runner.model
    for layer in model.modules():
        if isinstance(layer, PackedLinear) and layer.bias is not None:
            with torch.no_grad():  # transformers initializes biases to zero: make them count
                layer.bias.normal_(0, 0.5)
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            with torch.no_grad():  # initialized to ones: make each head's scales count
                param.normal_(1, 0.5)
    assert model.fused_decoder is not None
    fused, calls = model.fused_decoder, []
    model.fused_decoder = lambda x, *args: calls.append((len(x), args[-2].num_single_token_seqs)) or fused(x, *args)
    alone = {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    staggered = run_staggered(llm, PROMPTS)
    assert (1, 1) in calls and any(rows > single > 1 for rows, single in calls)  # a token, decodes and a chunk
    model.fused_decoder = None
    assert staggered == alone == {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    assert_idle(llm)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: its layers one by one, a sliding window
def test_batches_on_the_kernels_equal_each_request_alone(tiny_model_dirs, arch):
    llm = LLM(model=str(tiny_model_dirs[arch]), block_size=4, max_num_batched_tokens=64)
    layer = llm.engine.runner.model.layers[0]
    assert layer.self_attn.kernels is not None and layer.input_layernorm.kernels is not None
    assert isinstance(layer.mlp.gate_up_proj, PackedLinear)
    assert llm.engine.dtype == torch.float32 and llm.engine.runner.kv_caches[0].dtype == torch.float16
    alone = {f"r{i}": run_alone(llm, p) for i, p in enumerate(PROMPTS)}
    assert run_staggered(llm, PROMPTS) == alone
    assert_idle(llm)


def test_each_build_writes_the_kv_cache_as_torch_rounds_it(kernels, tiny_model_dirs, monkeypatch):
    """The fused decoder stores each step's keys and values as IEEE halves (vcvtps2ph, or plain C without F16C),
    rounded as the layers' loop rounds them with torch (``.half()``): both paths fill the cache with the same bits,
    and give the same tokens, whichever build runs (a build without F16C rounds every value in C)."""
    monkeypatch.setattr(model_runner, "load_cpu_kernels", lambda: kernels)
    fused, layers = (LLM(model=str(tiny_model_dirs["llama"]), block_size=4) for _ in range(2))  # fresh caches
    assert fused.engine.runner.model.fused_decoder is not None and fused.engine.runner.kernels is kernels
    layers.engine.runner.model.fused_decoder = None
    assert run_alone(fused, PROMPTS[1]) == run_alone(layers, PROMPTS[1])
    assert all(torch.equal(a, b) for a, b in zip(fused.engine.runner.kv_caches, layers.engine.runner.kv_caches))


def test_an_interrupted_step_stops_before_its_next_layer(tiny_model_dirs):
    """A stop asked from another thread while a step runs: the fused decoder (in C) and the layers' loop both
    read the flag before each layer, and the step raises instead of returning half-computed tokens."""
    llm = LLM(model=str(tiny_model_dirs["llama"]), block_size=4)
    engine, model = llm.engine, llm.engine.runner.model
    assert model.fused_decoder is not None
    engine.add_request("r", "Hello there", GREEDY)
    ran = []
    fused = model.fused_decoder

    def watched(x, *args):
        before = x.clone()
        out = fused(x, *args)
        ran.append(not torch.equal(out, before))  # a layer (or the final norm) changed the rows
        return out

    model.fused_decoder = watched
    engine.interrupt()
    with pytest.raises(StepInterrupted):
        engine.step()
    assert ran == [False]  # called, and no layer ran
    model.fused_decoder = None  # the layers' loop, as for large steps
    layers_run = _watch_layers(model)
    with pytest.raises(StepInterrupted):
        engine.step()
    assert layers_run == []
    # a stop asked while the loop is at its first layer: the second never runs
    llm = LLM(model=str(tiny_model_dirs["llama"]), block_size=4)
    engine, model = llm.engine, llm.engine.runner.model
    model.fused_decoder = None
    layers_run = _watch_layers(model)
    model.layers[0].register_forward_pre_hook(lambda *_: engine.interrupt())
    engine.add_request("r", "Hello there", GREEDY)
    with pytest.raises(StepInterrupted):
        engine.step()
    assert layers_run == [0]


def _watch_layers(model) -> list[int]:
    """The indices of the decoder layers that run, in order, from now on."""
    ran: list[int] = []
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: ran.append(i))
    return ran
