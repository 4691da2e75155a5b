"""What the hub and the engine thread tell each other, through the bridge.

Commands go to the thread (``Submit``, ``Abort``, ``Stop``); events come back,
a list per wake-up of the hub. Plain data: this module imports neither torch
nor gevent, so both sides can share it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..engine.grammar import GrammarCompiler
    from ..engine.outputs import EngineCounters, RequestDelta
    from ..engine.sampling_params import SamplingParams
    from .streams import RequestStream


@dataclass
class Chat:
    """A conversation before the chat template; ``tools`` go to templates that take them."""

    messages: list[dict]
    tools: list[dict] | None = None


Prompts = list[str | list[int]] | list[Chat]  # texts or token ids; or conversations


# --- commands: hub to engine thread --------------------------------------------------
@dataclass
class Submit:
    stream: RequestStream
    prompts: Prompts
    params: list[SamplingParams]  # one per choice of each prompt (n)


@dataclass
class Abort:
    request_id: str
    choice_ids: list[str]


class Stop:
    pass


# --- events: engine thread to hub -----------------------------------------------------
@dataclass
class Accepted:
    """The engine queued every choice; the prompts had this many tokens."""

    prompt_tokens: int


@dataclass
class Rejected:
    """The engine refused the request (bad input): a 400 for the client."""

    message: str
    param: str | None = None  # the field at fault, when the engine knows it
    status: int = 400  # 500: the engine failed on this request (a bug), but goes on serving


@dataclass
class Admitted:
    stream: RequestStream
    outcome: Accepted | Rejected


@dataclass
class EngineReady:
    max_model_len: int
    model_dir: str
    num_blocks: int
    template_takes_tools: bool
    grammars: GrammarCompiler  # thread-safe: the hub compiles constraints before it submits


@dataclass
class EngineFailed:
    message: str  # one line, safe to show clients
    detail: str = ""  # the traceback, for the log only


@dataclass
class StepDone:
    deltas: list[RequestDelta]
    counters: EngineCounters  # sent with every delivery, so the gauges are right when the engine goes idle
    token_texts: dict[int, str]  # the text of every token id the deltas' logprobs mention
    step_tokens: list[int]  # tokens computed by each step since the last delivery


@dataclass
class Aborted:
    request_id: str
    num_choices: int


class EngineStopped:
    pass
