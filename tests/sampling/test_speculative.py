"""Speculative decoding by prompt lookup: the proposer's n-grams, and outputs equal token for token with and without
it (greedy alone and staggered into batches beside requests it does not speculate, through preemption and the
prefix cache), on a tiny model in float32 and on the default model in its shipped format."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from wsgi_infer import LLM, SamplingParams
from wsgi_infer.engine.config import EngineConfig
from wsgi_infer.engine.sampling.speculative import NgramProposer, proposer_for, verify_sampled

from ..conftest import assert_idle
from ..support.batch_runs import run_staggered

PASSAGE = "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold. "
REPEAT = PASSAGE * 2 + "\nRepeat the passage above:\n" + PASSAGE[:40]


def seq_of(tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(token_ids=tokens, num_tokens=len(tokens), lookup=None)


def test_the_longest_earlier_ngram_proposes_what_followed_it():
    proposer = NgramProposer(num_tokens=3, n_min=2, n_max=3)
    assert proposer.propose(seq_of([5, 1, 2, 3, 4, 9, 1, 2, 3]), limit=8) == [4, 9, 1]  # the trigram 1 2 3
    assert proposer.propose(seq_of([7, 1, 2, 8, 6, 1, 2]), limit=8) == [8, 6, 1]  # the bigram 1 2
    assert proposer.propose(seq_of([1, 2, 3, 4, 5]), limit=8) == []  # nothing repeats
    assert proposer.propose(seq_of([1, 2, 3, 1, 2]), limit=1) == [3]  # within the room left


def test_a_sequence_grows_and_the_latest_occurrence_wins():
    proposer, tokens = NgramProposer(num_tokens=2, n_min=2, n_max=2), [1, 2, 3, 1, 2]
    seq = seq_of(tokens)
    assert proposer.propose(seq, limit=8) == [3, 1]
    tokens += [4, 1, 2]
    seq.num_tokens = len(tokens)
    assert proposer.propose(seq, limit=8) == [4, 1]  # 1 2 was last followed by 4


def test_rejected_drafts_back_off_and_an_accepted_one_resets():
    proposer, seq = NgramProposer(num_tokens=2, n_min=2, n_max=2), seq_of([1, 2, 3, 1, 2])
    assert proposer.propose(seq, limit=8)
    proposer.verified(seq, proposed=2, accepted=0)
    assert proposer.propose(seq, limit=8) == []  # one step without a draft
    assert proposer.propose(seq, limit=8)
    proposer.verified(seq, proposed=2, accepted=0)
    assert [proposer.propose(seq, limit=8) for _ in range(3)] == [[], [], [3]]  # then two, and one token
    proposer.verified(seq, proposed=1, accepted=1)
    assert proposer.propose(seq, limit=8)


def test_a_draft_grows_while_accepted_whole_and_halves_when_cut_short():
    """The first draft is as long as allowed; one accepted whole doubles the next (within num_tokens and the room
    left), one cut short halves it, but not below its accepted part and one more: verified rows cost arithmetic."""
    proposer, seq = NgramProposer(num_tokens=15, n_min=2, n_max=2), seq_of([1, 2, *range(3, 40), 1, 2])
    assert len(proposer.propose(seq, limit=20)) == 15
    proposer.verified(seq, proposed=15, accepted=2)
    assert proposer.propose(seq, limit=20) == list(range(3, 10))  # half of 15
    proposer.verified(seq, proposed=7, accepted=1)
    assert proposer.propose(seq, limit=20) == [3, 4, 5]  # half of 7
    proposer.verified(seq, proposed=3, accepted=2)
    assert proposer.propose(seq, limit=20) == [3, 4, 5]  # not below what was accepted, and one more
    proposer.verified(seq, proposed=3, accepted=3)
    assert len(proposer.propose(seq, limit=20)) == 6
    assert len(proposer.propose(seq, limit=4)) == 4  # the room left
    proposer.verified(seq, proposed=6, accepted=6)
    proposer.verified(seq, proposed=12, accepted=12)
    assert len(proposer.propose(seq, limit=20)) == 15  # never past num_tokens


def test_a_draft_fills_the_rows_the_kernels_multiply_in_one_pass_unless_set():
    """One token less than the rows of a pass over the weights (8 with AVX-512 VNNI, 5 with AVX2); 4 without the
    kernels; a setting wins."""
    assert proposer_for(EngineConfig(), SimpleNamespace(rows_per_pass=8)).num_tokens == 7
    assert proposer_for(EngineConfig(), SimpleNamespace(rows_per_pass=5)).num_tokens == 4
    assert proposer_for(EngineConfig(), None).num_tokens == 4
    assert proposer_for(EngineConfig(num_speculative_tokens=2), SimpleNamespace(rows_per_pass=8)).num_tokens == 2
    assert proposer_for(EngineConfig(speculative="none"), None) is None


def test_drafts_share_the_rows_of_one_pass_over_the_weights():
    """With the kernels a step's decodes and drafts fit the rows they multiply in one pass: one stream drafts all
    7 tokens, two 3 each, three or four one, five or more none; without the kernels each drafts its own."""
    proposer = NgramProposer(num_tokens=7, n_min=3, n_max=4, rows_per_pass=8)
    assert [proposer.draft_share(n) for n in (1, 2, 3, 4, 5, 16)] == [7, 3, 1, 1, 0, 0]
    assert NgramProposer(num_tokens=2, n_min=3, n_max=4, rows_per_pass=8).draft_share(1) == 2  # a setting caps it
    assert [NgramProposer(num_tokens=4, n_min=3, n_max=4).draft_share(n) for n in (1, 16)] == [4, 4]


def test_a_sampled_row_takes_its_draft_token_with_its_probability():
    """Rows of fixed logits and a draft of two tokens, 20,000 seeded verifications: the first token is accepted
    as often as the target gives it (temperature, top-p), the second as often given the first; a token top-p cut
    away is never accepted. (Seeded: the counts are the same every run.)"""
    import torch

    from wsgi_infer.engine.sampling.filters import in_bits, kept_floor, weights_

    logits = torch.tensor([[2.0, 0.5, 1.5, -1.0, 0.0], [0.0, 1.0, -0.5, 2.0, 0.3], [1.0, 1.0, 1.0, 1.0, -3.0]])
    kept = [weights_(bits, kept_floor(bits, 0, 0.95, 0.0)) for bits in (in_bits(row, 0.9) for row in logits)]
    target = [w / w.sum() for w in kept]
    runs, params, position = 20_000, SamplingParams(temperature=0.9, top_p=0.95), 17
    accepted = [0, 0]
    for seed in range(runs):  # a request a seed, its draft's rows at positions 17, 18, 19
        tokens = verify_sampled(logits, [2, 3], params, seed, position)
        accepted[0] += tokens[0] == 2
        accepted[1] += len(tokens) == 3
    assert abs(accepted[0] / runs - target[0][2]) < 0.01
    assert abs(accepted[1] / accepted[0] - target[1][3]) < 0.015
    cut = (verify_sampled(logits, [3], params, seed, position)[0] for seed in range(runs, runs + 200))
    assert target[0][3] == 0 and all(token != 3 for token in cut)


def mixed_requests(llm: LLM) -> dict[str, list[int]]:
    """Greedy repeats (speculated) beside a seeded sample, logprobs and a stop string (not speculated)."""
    engine, tokens = llm.engine, {}
    requests = {
        "repeat": (REPEAT, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)),
        "short": (PASSAGE, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)),
        "sampled": (REPEAT, SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True)),
        "logprobs": (REPEAT, SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True)),
        "stop": (REPEAT, SamplingParams(temperature=0, max_tokens=60, stop=["fox"], ignore_eos=True)),
    }
    for step, (name, (prompt, params)) in enumerate(requests.items()):
        engine.add_request(name, prompt, params)
        tokens[name] = []
        for delta in engine.step() if step % 2 else []:
            tokens[delta.request_id] += delta.token_ids
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    return tokens


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dirs):
    def build(**options) -> LLM:
        settings = dict(dtype="float32", quantization="none", block_size=4, max_num_batched_tokens=64)
        return LLM(model=str(tiny_model_dirs["llama"]), **settings, **options)

    return build(speculative="none"), build(speculative="ngram", num_speculative_tokens=4)


def test_outputs_are_equal_with_and_without_it_in_a_mixed_batch(tiny_pair):
    """Greedy requests and a seeded sampled one (speculated too) give the same tokens with and without it."""
    plain, speculative = tiny_pair
    assert mixed_requests(speculative) == mixed_requests(plain)
    counters = speculative.engine.counters()
    assert counters.num_spec_accepted_tokens > 0 and counters.num_spec_drafts > 0
    assert plain.engine.counters().num_spec_drafts == 0
    assert_idle(speculative)


def test_outputs_are_equal_through_preemption_and_the_prefix_cache(tiny_model_dirs, tiny_pair):
    plain, _ = tiny_pair
    settings = dict(dtype="float32", quantization="none", block_size=4, max_num_batched_tokens=64, num_kv_blocks=32)
    cramped = LLM(model=str(tiny_model_dirs["llama"]), **settings, speculative="ngram", num_speculative_tokens=4)
    prompts = [REPEAT, REPEAT + " again", PASSAGE * 3]
    assert run_staggered(cramped, prompts) == run_staggered(plain, prompts)
    counters = cramped.engine.counters()
    assert counters.num_preemptions > 0 and counters.num_prefix_hit_tokens > 0 and counters.num_spec_accepted_tokens
    assert_idle(cramped)


@pytest.mark.slow  # the default model
def test_the_default_model_repeats_the_same_tokens_faster_steps(default_model_dir):
    """In its shipped format (the packed kernels' fused step verifies several rows of one sequence)."""
    ask = [{"role": "user", "content": PASSAGE * 3 + "\nRepeat the passage above, correcting any spelling mistakes:"}]
    outputs, steps = [], []
    for options in ({"speculative": "none"}, {}):  # on by default
        llm = LLM(model=None, **options)
        engine, count = llm.engine, 0
        engine.add_request("r", engine.apply_chat_template(ask), SamplingParams(temperature=0, max_tokens=100))
        tokens = []
        while engine.has_unfinished():
            tokens += [t for d in engine.step() for t in d.token_ids]
            count += 1
        outputs.append(tokens)
        steps.append(count)
    assert llm.engine.proposer.num_tokens == llm.engine.runner.kernels.rows_per_pass - 1
    assert outputs[0] == outputs[1]
    assert steps[1] < 0.6 * steps[0]  # most of the repeat was accepted from drafts


def test_the_server_counts_drafts_with_vllms_names(tiny_model_dirs):
    from ..conftest import tiny_settings
    from ..support.in_process import InProcessServer

    with InProcessServer(tiny_settings(tiny_model_dirs, speculative="ngram")) as server:
        with server.client() as http:
            body = {"prompt": REPEAT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            assert http.post("/v1/completions", json=body).status_code == 200
        with server.client() as http:
            text = http.get("/metrics").text
        metrics, label = server.metrics(), f'model_name="{server.manager.model_name}"'  # other apps share the registry
    drafts, proposed, accepted = (
        metrics[f"wsgi_infer:spec_decode_num_{name}_total"] for name in ("drafts", "draft_tokens", "accepted_tokens")
    )
    assert 0 < drafts <= proposed and 0 < accepted <= proposed
    per_position = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("wsgi_infer:spec_decode_num_accepted_tokens_per_pos_total{") and label in line
    ]
    assert per_position and sum(per_position) == accepted


def test_sampled_requests_are_speculated_and_sample_the_same_tokens(tiny_pair):
    plain, speculative = tiny_pair
    before = speculative.engine.counters()
    params = SamplingParams(temperature=0.01, seed=5, max_tokens=60, ignore_eos=True)  # loops as greedy does
    out = speculative.generate(REPEAT, params)[0]
    after = speculative.engine.counters()
    assert after.num_spec_drafts > before.num_spec_drafts
    assert after.num_spec_accepted_tokens > before.num_spec_accepted_tokens
    assert out.token_ids == plain.generate(REPEAT, params)[0].token_ids
