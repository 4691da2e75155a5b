"""What an engine thread and its client tell each other (``EngineLoop`` and the server's manager).

Commands go to the thread (``Submit``, ``Abort``, ``Load``, ``PrepareText``, ``Unload``, ``Stop``); events come back,
a list per wake-up of the client. Plain data: this module imports neither
torch nor gevent, so both sides can share it. Prompts arrive as token ids: the
client tokenizes and applies chat templates, so that no running stream waits
for a long prompt's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import EngineConfig
    from .outputs import EngineCounters, RequestDelta
    from .sampling_params import SamplingParams
    from .text_side import TextSide


# --- commands: hub to engine thread --------------------------------------------------
@dataclass
class Submit:
    """Every choice of every prompt (choice index = prompt * n + j, n = len(params)), or none of them."""

    model: str  # the served model's name (``Load``)
    key: str  # the client's name for this request in ``Admitted``
    request_id: str  # the request's id in the logs
    choice_ids: list[str]  # the engine's request id of each choice
    prompts: list[list[int]]
    params: list[SamplingParams]  # one per choice of each prompt
    # A stream continued from where another host left it: per choice, the tokens it had generated, or None for a
    # choice that had ended (not run again). Empty: a new request.
    generated: list[list[int] | None] = field(default_factory=list)


@dataclass
class Abort:
    model: str
    request_id: str
    choice_ids: list[str]


@dataclass
class Load:
    """Load a model under this name, off the stepping path (a loader thread); ``EngineReady`` or
    ``EngineFailed`` says how it went. Loads run one at a time, in order."""

    model: str
    config: EngineConfig
    text: TextSide | None = None  # the model's text side from its last load, which the hub kept (``text_side``)


@dataclass
class PrepareText:
    """Build a model's text side (tokenizer, grammar compiler) ahead of its first load, in the loads' queue;
    ``TextPrepared`` hands it to the hub, which keeps it for the model's loads (``text_side``)."""

    model: str
    config: EngineConfig


@dataclass
class Unload:
    """Free the model (its requests are aborted: the client unloads only models without any); ``ModelUnloaded``."""

    model: str


@dataclass
class Loaded:
    """The loader thread's result, through the thread's own command queue: the engine, or why it failed."""

    model: str
    engine: Any = None
    failure: EngineFailed | None = None
    text: TextSide | None = None  # a ``PrepareText``'s


@dataclass
class StoreProgress:
    """From a model's KV store threads: reads or writes finished, so its counters (``StepDone``) moved."""

    model: str


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
    key: str  # the submission's
    outcome: Accepted | Rejected


@dataclass
class EngineReady:
    model: str
    max_model_len: int
    model_dir: str
    num_blocks: int
    # The engine's own tokenizer and grammar compiler, for the front end's prompts and constraints (the compiler is
    # thread-safe; a second tokenizer took another load: 0.12 s for the default model, 1.3 s for Gemma 3's), and for
    # the model's next load. The tokenizer is shared read-only: the engine thread only detokenizes through its Rust
    # backend, and neither side changes its truncation or padding (a change while the other encodes would be the
    # tokenizers library's "Already borrowed").
    text: TextSide
    task: str = "generate"  # or "embed": an embedding model's engine


@dataclass
class EngineFailed:
    message: str  # one line, safe to show clients
    detail: str = ""  # the traceback, for the log only
    model: str = ""  # the model that failed to load; empty: the thread itself failed


@dataclass
class TextPrepared:
    model: str
    text: TextSide | None  # None: it could not be built (nor will the model's load)
    failure: str = ""  # why not (a load's EngineFailed message)


@dataclass
class ModelUnloaded:
    model: str


@dataclass
class StepDone:
    model: str
    deltas: list[RequestDelta]
    counters: EngineCounters  # sent with every delivery, so the gauges are right when the engine goes idle
    token_texts: dict[int, str]  # the text of every token id the deltas' logprobs mention (text.token_pieces)
    step_tokens: list[int]  # tokens computed by each step since the last delivery


@dataclass
class Aborted:
    model: str
    request_id: str
    num_choices: int


class EngineStopped:
    pass
