"""The engine: ties tokenizer, scheduler, block manager, model runner and sampler.

Requests go in with ``add_request`` and leave with ``abort``/``abort_all`` or by finishing; ``step`` computes one
batch and returns what it did to each request; ``has_unfinished`` says whether a step has work. ``tokenize`` and
``apply_chat_template`` turn text into prompts, and ``counters`` proves that nothing leaks. It is single-threaded:
the server drives it from one native thread.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable

from .config import EngineConfig
from .kv_store.prefix_store import open_prefix_store
from .loading.model_builder import kernels_serve
from .loading.model_loader import eos_token_ids, load_config, resolve_model_dir
from .model_runner import DraftLogits, ModelRunner
from .outputs import EngineCounters, RequestDelta, TokenLogprob
from .pooling import embedding, pool
from .runtime.device import resolve_device, resolve_dtype
from .runtime.native_threads import start_native_thread
from .sampling.grammar import constraint_end
from .sampling.sampler import Sampler, ending_tokens, prompt_logprobs, stop_reason
from .sampling.speculative import SpecCounters, proposer_for, speculates, verify_sampled
from .sampling.token_bans import token_bans
from .sampling_params import InvalidParameter, SamplingParams, max_tokens_within, tokens_to_keep
from .scheduling.fair_share import FairShare
from .scheduling.kv_cache_manager import KVCacheManager
from .scheduling.prefill_pacer import FLOOR, PrefillPacer
from .scheduling.scheduler import Scheduler
from .scheduling.sequence import Sequence, SequenceStatus
from .text.chat_template import chat_prompt_ids
from .text.detokenizer import IncrementalDetokenizer
from .text.truncation import prompt_tokens
from .text_side import TextSide, with_weights

log = logging.getLogger(__name__)

Prompt = str | list[int]  # text, or token ids


class LLMEngine:
    task = "generate"

    def __init__(
        self,
        config: EngineConfig | None = None,
        start_thread: Callable[[Callable[[], None]], None] = start_native_thread,
        notify: Callable[[], None] = lambda: None,
        share: FairShare | None = None,
        text: TextSide | None = None,
        beside: Callable[[], bool] = lambda: False,
    ) -> None:
        """``start_thread`` and ``notify``: the KV store's threads' (``kv_store.prefix_store``); ``share``: the tenants'
        fair share, of every model of a thread; ``text``: the model's text side from its last load, where kept;
        ``beside``: whether another model of the thread serves streams (``Scheduler``'s)."""
        self.config = config = config or EngineConfig()
        self.device = resolve_device(config.device)
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = load_config(self.model_dir)
        self.dtype = resolve_dtype(config.dtype, self.device, kernels_serve(config, self.hf_config, self.device))
        log.info("loading model from %s on %s as %s", self.model_dir, self.device, self.dtype)
        runner = lambda: ModelRunner(config, self.hf_config, self.model_dir, self.device, self.dtype)  # noqa: E731
        self.runner, self.text = with_weights(self.model_dir, text, self.hf_config.vocab_size, runner)
        self.tokenizer, self.grammars = self.text.tokenizer, self.text.grammars
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config, self.tokenizer)
        self.max_model_len = self.runner.max_model_len
        self.kv_cache = KVCacheManager(self.runner.kv_groups, config.block_size, config.enable_prefix_caching)
        self.store = open_prefix_store(config, self.model_dir, self.runner, start_thread, notify)
        # From the floor up, a quarter more a step: 64 tokens of a 1B model take 0.14 s on a Xeon, 0.7 s on a Zen 3
        pacer = PrefillPacer(
            config.shared_step_ms / 1000, FLOOR, config.max_num_batched_tokens, config.min_prefill_chunk
        )
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, self.store, share, pacer, beside
        )
        self.sampler = Sampler(self.runner.kernels, self.eos_token_ids)
        self._seqs: dict[str, Sequence] = {}
        self._seed_source = random.Random(config.seed)
        self.proposer = proposer_for(config, self.runner.kernels)
        self.spec = SpecCounters()
        self.last_step_num_tokens = 0
        log.info("model ready: %s, max_model_len %d", self.hf_config.model_type, self.max_model_len)

    # --- requests ------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the reply."""
        return chat_prompt_ids(self.tokenizer, messages, tools)

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, generated: list[int] | tuple[int, ...] = ()
    ) -> int:
        """Queue a request; return its prompt length. Raises ValueError for bad input. ``generated``: its tokens
        from where it ran before (a stream continued here), computed again with the prompt."""
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt_ids = prompt_tokens(self.tokenizer, prompt, tokens_to_keep(params, self.max_model_len))
        if not prompt_ids:
            raise InvalidParameter("prompt", "prompt must not be empty")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in (*prompt_ids, *generated)):
            raise InvalidParameter("prompt", f"prompt token ids must be integers in [0, {vocab})")
        max_tokens = max_tokens_within(len(prompt_ids), params, self.max_model_len)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidParameter("logit_bias", f"logit_bias token ids must be below the vocabulary size {vocab}")
        bans = token_bans(params, self.tokenizer, vocab, ending_tokens(params, self.eos_token_ids), self.device)
        matcher = self.grammars.matcher(params.structured_output) if params.structured_output else None
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        detokenizer = IncrementalDetokenizer.for_request(self.tokenizer.backend_tokenizer, prompt_ids, params)
        for token in generated:  # their text went out before: only the detokenizer's and grammar's states count
            detokenizer.push(token)
            if matcher is not None:
                matcher.consume_token(token)
        seq = Sequence(request_id, prompt_ids, params, max_tokens, detokenizer, seed, matcher, bans)
        seq.token_ids += generated
        seq.tenant = seq.tenant if self.config.fair_share else ""  # one tenant: first come, first served
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        if self.store is not None and not seq.computes_every_position:  # read ahead what the store has
            hit = self.kv_cache.find_cached_prefix(seq)
            self.store.prefetch(seq, hit.num_blocks if hit else 0, (seq.num_tokens - 1) // self.kv_cache.block_size)
        return len(prompt_ids)

    def abort(self, request_id: str) -> bool:
        """Drop a request at once, freeing its blocks. False when it is unknown or done."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    def abort_all(self) -> None:
        for request_id in list(self._seqs):
            self.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def serving(self) -> bool:
        """Requests waiting or streams decoding: what another model's long step would keep waiting."""
        return self.scheduler.serving()

    def write_stored_blocks(self) -> None:
        """Hand the last step's newly computed prompt blocks to the KV store's writer; the loop calls it after
        posting the step's output, so that no token waits for their copies."""
        if self.store is not None:
            self.store.write_noted()

    def close(self, wait: bool = False) -> None:
        """End the KV store's threads; with ``wait``, after the blocks it has noted are written."""
        if self.store is not None:
            self.store.close(wait)

    def interrupt(self) -> None:
        """From any thread: the step in progress (and any later one) raises ``StepInterrupted`` at its next layer,
        leaving the engine to be aborted and dropped."""
        self.runner.model.interrupt.request()

    def counters(self) -> EngineCounters:
        kv = self.kv_cache
        return EngineCounters(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_free_blocks=kv.num_free_blocks,
            num_cached_blocks=kv.num_cached_blocks,
            num_total_blocks=kv.num_blocks,
            num_prefix_query_tokens=self.scheduler.num_prefix_query_tokens,
            num_prefix_hit_tokens=kv.num_prefix_hit_blocks * kv.block_size,
            num_store_query_tokens=self.scheduler.num_store_query_tokens,
            num_store_hit_tokens=kv.num_stored_hit_blocks * kv.block_size,
            store=dataclasses.asdict(self.store.store.counters) if self.store else {},
            store_degraded=self.store is not None and self.store.degraded,
            num_preemptions=self.scheduler.num_preemptions,
            num_spec_drafts=self.spec.drafts,
            num_spec_draft_tokens=self.spec.draft_tokens,
            num_spec_accepted_tokens=self.spec.accepted_tokens,
            num_spec_accepted_per_position=tuple(self.spec.accepted_per_position),
        )

    # --- the step --------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Compute one batch; return a delta for every request that got a token or ended (several for one that
        accepted draft tokens)."""
        self.write_stored_blocks()  # the last step's, where no loop did once it was posted
        if self.proposer is not None:
            share = self.proposer.draft_share(len(self.scheduler.running))
            for seq in self.scheduler.running:
                seq.draft = self.proposer.propose(seq, min(share, self._draft_room(seq))) if speculates(seq) else []
        batch = self.scheduler.schedule()
        self.last_step_num_tokens = sum(item.num_new_tokens for item in batch)
        if not batch:
            return []
        started = time.perf_counter()
        computed = self.runner.execute(batch)
        self.scheduler.step_took(time.perf_counter() - started)
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_computed_blocks(item.seq)
            if self.store is not None:
                self.store.note_computed(item.seq)
        for found in computed.prompt:
            targets = found.seq.token_ids[found.first : found.first + len(found.logits)]
            found.seq.prompt_logprobs += prompt_logprobs(found.logits, targets, found.seq.params.prompt_logprobs)
        for rows in computed.pooled:
            pool(rows)
        read = [seq for seq in computed.sampling if not seq.max_tokens]  # max_tokens 0: ends here, not sampled
        deltas = [self._finish(seq, "stop" if seq.params.pooling else "length", [], "", None) for seq in read]
        rows = [i for i, seq in enumerate(computed.sampling) if seq.max_tokens]
        if rows:
            sampling = [computed.sampling[i] for i in rows]
            logits = computed.logits if len(rows) == len(computed.sampling) else computed.logits[rows]
            tokens, logprobs = self.sampler(logits, sampling)
            deltas += [self._append_token(seq, token, lp) for seq, token, lp in zip(sampling, tokens, logprobs)]
        for draft in computed.drafts:
            deltas += self._verify(draft)
        for item in batch:  # after verification, which takes rejected draft tokens back
            if item.seq.status is SequenceStatus.RUNNING:
                self.kv_cache.release_behind(item.seq)
        return deltas

    def _draft_room(self, seq: Sequence) -> int:
        """Draft tokens that may still be accepted: each verified step adds one more token than it accepts."""
        return min(seq.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens + 1) - 1

    def _verify(self, draft: DraftLogits) -> list[RequestDelta]:
        """The draft's tokens as far as the model takes them (greedy: each is its own argmax; sampled:
        ``verify_sampled``), then the model's next one. The KV of rejected tokens is left stale (their positions
        are computed again when reached)."""
        seq, proposed = draft.seq, draft.seq.draft
        if seq.params.greedy:
            chosen = self.sampler.greedy(draft.logits)
            accepted = next((i for i, (p, c) in enumerate(zip(proposed, chosen)) if p != c), len(proposed))
            chosen = chosen[: accepted + 1]
        else:
            chosen = verify_sampled(draft.logits, proposed, seq.params, seq.seed, seq.num_tokens)
            accepted = len(chosen) - 1
        seq.num_computed_tokens -= len(proposed) - accepted
        seq.draft = []
        self.spec.count(len(proposed), accepted)
        self.proposer.verified(seq, len(proposed), accepted)
        deltas = []
        for token in chosen:
            deltas.append(self._append_token(seq, token, None))
            if deltas[-1].finished:
                break
        return deltas

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestDelta:
        seq.token_ids.append(token)
        finish_reason, text = self._advance(seq, token)
        return self._finish(seq, finish_reason, [token], text, logprob)

    def _finish(
        self, seq: Sequence, finish_reason: str | None, tokens: list[int], text: str, logprob: TokenLogprob | None
    ) -> RequestDelta:
        """The step's delta for ``seq``; a finished sequence leaves the engine."""
        if finish_reason is not None:
            self.scheduler.finish(seq)
            del self._seqs[seq.request_id]
        first = seq.num_output_tokens <= 1
        wants_prompt = first and seq.params.prompt_logprobs is not None
        return RequestDelta(
            request_id=seq.request_id,
            text=text,
            token_ids=tokens,
            logprobs=[logprob] if logprob is not None else None,
            finish_reason=finish_reason,
            stop_reason=stop_reason(seq, finish_reason, self.eos_token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            queue_seconds=seq.first_scheduled_time - seq.arrival_time if first else None,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens] if wants_prompt else None,
            prompt_logprobs=list(seq.prompt_logprobs) if wants_prompt else None,
            embedding=embedding(seq) if finish_reason is not None and seq.params.pooling else None,
        )

    def _advance(self, seq: Sequence, token: int) -> tuple[str | None, str]:
        """Feed the new token to the detokenizer and grammar; return (finish_reason, text)."""
        params = seq.params
        if seq.matcher is not None and seq.matcher.is_error():  # no token could follow: its mask let the end through
            return constraint_end(seq.matcher, seq.request_id), seq.detokenizer.flush()
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop", seq.detokenizer.flush(token if params.include_stop_str_in_output else None)
        text = seq.detokenizer.push(token)
        if seq.detokenizer.matched is not None:
            return "stop", text
        # A complete grammar allows nothing more: the choice ends without waiting for EOS.
        if seq.matcher is not None and (not seq.matcher.consume_token(token) or seq.matcher.is_stopped()):
            return constraint_end(seq.matcher, seq.request_id), text + seq.detokenizer.flush()
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length", text + seq.detokenizer.flush()
        return None, text
