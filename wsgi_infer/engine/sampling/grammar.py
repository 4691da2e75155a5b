"""Constrained decoding with llguidance: compile a constraint, mask the logits, follow the tokens.

A ``GrammarCompiler`` turns a ``StructuredOutput`` into an llguidance matcher
for the model's tokenizer. Compiled grammars are cached by their text, so a
schema sent with every request compiles once; each choice gets a cheap copy.
llguidance is called through its C interface, which holds no GIL (``llguidance_c``):
the server compiles off its hub before it submits, and the compiled grammar travels
with the request, so the engine thread only copies it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import re
import time
from dataclasses import replace
from pathlib import Path

import torch
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from ..kernels.cpu import CpuKernels
from ..outputs import CONSTRAINT_FAILED
from ..runtime.cpu_share import beside_the_steps
from ..sampling_params import JSON_WHITESPACE, InvalidParameter, StructuredOutput
from ..text.llguidance_c import COMPUTE_MASK_INTO, NO_TOKEN_ALLOWED, Matcher, Vocabulary
from .schema_loops import loop_at, schemas_in_lark

log = logging.getLogger(__name__)
GRAMMAR_CACHE_SIZE = 128
_TOKEN_BY_TEXT = re.compile(r"<\[(?!\d+\]>)(.+?)\]>")  # <[text]>, where llguidance's own <[5]> has digits
JSON_DEFAULTS = {"whitespace_pattern": JSON_WHITESPACE}
_BITS = torch.arange(32, dtype=torch.int32)


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (not yet checked but for its schemas' loops)."""
    try:
        _refuse_loops(spec)
        if spec.after_thought:
            return LLMatcher.grammar_from_lark(_after_thought(spec))
        if spec.kind == "json":
            return LLMatcher.grammar_from_json_schema(spec.schema, defaults=JSON_DEFAULTS)
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.value)
        if spec.kind == "choice":
            return LLMatcher.grammar_from_lark(f"start: WSGI_CHOICE\n{_choice_terminal(spec.value)}")
        return LLMatcher.grammar_from_lark(_lark(spec.value))
    except (ValueError, GbnfToLarkError) as exc:  # not JSON, a schema that is not an object, GBNF it cannot read
        raise InvalidParameter(spec.source, f"the {spec.kind} constraint is not valid: {exc}") from None


def _refuse_loops(spec: StructuredOutput) -> None:
    """A ValueError where a schema of the constraint loops (``schema_loops``): llguidance would compile it to a
    grammar that no text completes."""
    schemas = [spec.schema] if spec.kind == "json" else schemas_in_lark(spec.value) if spec.kind == "grammar" else []
    for schema in schemas:
        if (where := loop_at(schema)) is not None:
            raise ValueError(
                f"the schema at {where} has no finite value: its $ref, allOf, required properties or least items "
                "lead back to it without reaching a schema of a value"
            )


def _lark(grammar: str) -> str:
    """A grammar given as Lark or as GBNF (``::=``), in Lark."""
    return gbnf_to_lark(grammar) if "::=" in grammar else grammar


def _choice_terminal(choices: list[str]) -> str:
    """The choices as one terminal, which the lexer matches: as a rule of alternatives, 2,000 of them or more were
    past the parser's items a row, the matcher failed at the second token and the choice ended "stop" on a
    prefix ("opt" of "opt0".."opt1999")."""
    return "WSGI_CHOICE: " + " | ".join(json.dumps(c) for c in choices)


# A thinking model's thought, free, before the constrained answer: the grammar's start becomes the answer's rule.
THOUGHT_FIRST = (
    'start: wsgi_think? wsgi_answer\nwsgi_think: "<think>" wsgi_thought /[ \\n]*/\n'
    'wsgi_thought[stop="</think>"]: /(.|\\n)*/\n'
)


def _after_thought(spec: StructuredOutput) -> str:
    """The constraint as a Lark grammar whose answer may follow a thought in ``<think>…</think>``."""
    if spec.kind == "json":
        answer = f"wsgi_answer: {spec.lark_json()}"
    elif spec.kind == "regex":
        answer = "wsgi_answer: /" + spec.value.replace("/", "\\/") + "/"
    elif spec.kind == "choice":
        answer = f"wsgi_answer: WSGI_CHOICE\n{_choice_terminal(spec.value)}"
    else:
        answer = re.sub(r"(?m)^(\s*)start(\s*):", r"\1wsgi_answer\2:", _lark(spec.value))
    return THOUGHT_FIRST + answer


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe: the cache is ``functools.lru_cache``."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        # lru_cache, not a lock (gevent would patch one): two racing first compiles both build it, harmlessly.
        self.vocabulary = functools.lru_cache(maxsize=1)(self._build_vocabulary)
        self._compiled = functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)(self._compile)

    def has_vocabulary(self) -> bool:
        return self.vocabulary.cache_info().currsize > 0

    def prepare_vocabulary(self) -> None:
        """The vocabulary built ahead of the first compile, on the caller's thread; a tokenizer llguidance cannot
        read is left for that compile to report (a ValueError is not cached: it raises again there)."""
        with contextlib.suppress(ValueError):
            self.vocabulary()

    def _build_vocabulary(self) -> Vocabulary:
        """llguidance's view of the tokenizer, built by the first compile (1.2 s for Gemma 3's 262,144 tokens, in a
        native thread that holds no GIL meanwhile) rather than by every start.

        It reads the tokens from the tokenizer's own file where it has one: the backend's JSON would be written out
        under the GIL (0.3 s for Gemma 3's)."""
        started, backend = time.perf_counter(), self._hf_tokenizer.backend_tokenizer
        path = Path(self._hf_tokenizer.name_or_path, "tokenizer.json")
        tokenizer_json = path.read_bytes() if path.is_file() else backend.to_str().encode()
        with beside_the_steps():  # a core of its own, not the steps' team's
            vocabulary = Vocabulary(
                tokenizer_json,
                self.vocab_size,
                self._hf_tokenizer.eos_token_id,
                lambda text: backend.encode(text, add_special_tokens=False).ids,
            )
        name = Path(self._hf_tokenizer.name_or_path).name
        log.info("%s: llguidance's vocabulary built in %.2f s", name, time.perf_counter() - started)
        return vocabulary

    def compile(self, spec: StructuredOutput) -> StructuredOutput:
        """The constraint with its compiled grammar (from the cache when it is there).

        Converting and compiling a large schema takes a while: callers that must
        not wait (the engine thread) get constraints compiled ahead, elsewhere.
        InvalidParameter names the problem.
        """
        if spec.kind == "grammar":
            spec = replace(spec, value=self._with_token_ids(spec))
        text = grammar_text(spec)
        try:
            if spec.after_thought:  # the answer alone: an empty one would show only after the thought
                self._compiled(grammar_text(replace(spec, after_thought=False)))
            return replace(spec, compiled=self._compiled(text))
        except ValueError as exc:  # the cache is keyed by the text alone, which knows no request field
            raise InvalidParameter(spec.source, str(exc)) from None

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A fresh matcher for one choice (microseconds when ``spec`` was compiled ahead)."""
        compiled = spec.compiled if spec.compiled is not None else self.compile(spec).compiled
        return compiled.deep_copy()

    def _with_token_ids(self, spec: StructuredOutput) -> str:
        """A Lark grammar's special tokens named by their text, ``<[[TOOL_CALLS]]>``, as llguidance's ``<[5]>``:
        it knows only ids, and names of the ``<|...|>`` form."""

        def token_id(found: re.Match) -> str:
            ids = self._hf_tokenizer.convert_tokens_to_ids([found.group(1)])
            if ids[0] is None or ids[0] == self._hf_tokenizer.unk_token_id:
                raise InvalidParameter(spec.source, f"{found.group(1)!r} is not one of this model's tokens")
            return f"<[{ids[0]}]>"

        return _TOKEN_BY_TEXT.sub(token_id, spec.value)

    def _compile(self, grammar: str) -> Matcher:
        matcher = self.vocabulary().matcher(grammar)
        if matcher.is_error():
            # its first line, and the reason where the parser names it below a picture of the input
            lines = [line.strip() for line in matcher.get_error().strip().splitlines()]
            reason = " ".join([lines[0], *(line for line in lines[1:] if line.startswith("error:"))])
            raise ValueError(f"the constraint does not compile: {reason}")
        reason = matcher.next_mask_error()  # a grammar whose start allows no token, the end included
        if reason == NO_TOKEN_ALLOWED:
            raise ValueError("the constraint is unsatisfiable: no text matches it (a rule that only refers to itself?)")
        if reason is not None:
            raise ValueError(f"the constraint does not compile: {reason}")
        return matcher


def constraint_end(matcher: Matcher, request_id: str) -> str:
    """The finish reason of a choice its matcher ends: "stop" where the grammar is complete; ``CONSTRAINT_FAILED``,
    with a warning, where it is in error, the text breaking its constraint: no token could follow it (its mask let
    the end of sequence alone through, ``Matcher.mask_not_filled``), one was refused, or a limit of llguidance's
    met."""
    if not matcher.is_error():
        return "stop"
    reason = (matcher.get_error().strip().splitlines() or ["?"])[0]
    log.warning(
        "request %s: its constraint cannot be completed (%s): finish_reason %r", request_id, reason, CONSTRAINT_FAILED
    )
    return CONSTRAINT_FAILED


def apply_grammar_masks(
    logits: torch.Tensor, rows: list[int], matchers: list[Matcher], kernels: CpuKernels | None = None
) -> None:
    """In place: each listed row keeps only the tokens its matcher allows.

    One bitmask row (32 tokens per int32) per matcher, filled by llguidance, then unpacked by the CPU kernels where
    they take the logits (16 rows of SmolLM2's 49,152 tokens: 0.1 ms against torch's 1.5-1.8, Zen 4), else by torch
    for the whole batch at once. The kernels also fill the rows, on the steps' threads (1.5 ms one after another).
    """
    words = (logits.shape[1] + 31) // 32
    bitmask = torch.zeros((len(rows), words), dtype=torch.int32)
    if kernels is not None and logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        for k in kernels.fill_masks(COMPUTE_MASK_INTO, [matcher.handle for matcher in matchers], bitmask):
            matchers[k].mask_not_filled(bitmask[k].data_ptr(), words * 4)
        kernels.mask_rows_(logits, rows, bitmask)
        return
    for k, matcher in enumerate(matchers):
        matcher.fill_mask(bitmask[k].data_ptr(), words * 4)
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).view(len(rows), words * 32)[:, : logits.shape[1]]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(allowed.to(logits.device) == 0, float("-inf"))
