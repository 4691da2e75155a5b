"""The ``wsgi-infer`` command.

Imports stay inside the commands: `serve` runs the gunicorn master in this
process, which must not import torch before forking workers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .engine.config import QUANTIZATION_METHODS


def _generate(args: argparse.Namespace) -> int:
    from .engine.sampling_params import SamplingParams
    from .llm import LLM

    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    print(output.text)
    return 0


def _name_models(args: argparse.Namespace) -> None:
    """The models' options, as the WSGI_INFER_* settings that the server (or ``prepare``) reads."""
    import os

    models = args.model or []
    if models:
        os.environ["WSGI_INFER_MODEL"] = models[0]
    if models[1:]:
        os.environ["WSGI_INFER_MODELS"] = ",".join(models[1:])
    for option in ("models_dir", "models_config"):
        if getattr(args, option):
            os.environ[f"WSGI_INFER_{option.upper()}"] = getattr(args, option)


def _prepare(args: argparse.Namespace) -> int:
    """A first start's work, done ahead for the engines the server's WSGI_INFER_* settings describe (every
    model): compile the CPU kernels (where none are installed), convert each GGUF, resolve its config, and measure
    the crossing points of torch's packed layers (where the kernels do not serve) with each worker's threads. In a
    container image's build, say, so that every start is a later one and the cache may be read-only."""
    import torch
    from pydantic import ValidationError

    from .engine.kernels.build import kernels_library
    from .engine.loop import build_engine
    from .engine.runtime.cpu_budget import cpu_budget
    from .server.model_specs import model_specs
    from .server.settings import ServerSettings, named_problems, unknown_variables

    _name_models(args)
    for name, nearest in unknown_variables(os.environ):  # as the server's master says it
        logging.getLogger("wsgi_infer").warning(
            "%s is no setting of wsgi-infer, ignored%s", name, f": {nearest}?" if nearest else ""
        )
    try:
        settings = ServerSettings()
    except ValidationError as exc:  # pydantic's own words spanned lines, naming the field, not its variable
        raise ValueError("; ".join(named_problems(exc))) from None
    torch.set_num_threads(max(1, cpu_budget().threads // args.workers))  # as each worker will (gunicorn config)
    kernels_library(build=True)
    for spec in model_specs(settings):
        build_engine(spec.settings.engine_config()).close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    """gunicorn with wsgi_infer.server.gunicorn.config, as `gunicorn -c gunicorn.conf.py` would run it."""
    from .server.gunicorn.text_files_ahead import start_text_files_ahead

    _name_models(args)
    if not _sets_variables(args.gunicorn_args):  # else the master's hook starts it, once they are set
        start_text_files_ahead()  # before gunicorn's imports and the configuration's: a first start's tokenizer sooner
    from gunicorn.app.wsgiapp import WSGIApplication
    from gunicorn.errors import HaltServer

    argv = ["gunicorn", "-c", "python:wsgi_infer.server.gunicorn.config"]
    if args.bind:
        argv += ["--bind", args.bind]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    sys.argv = argv + args.gunicorn_args
    try:
        WSGIApplication("%(prog)s [OPTIONS]").run()
    except HaltServer as halted:  # a second worker's boot error, reaped while the master halted for the first's:
        from .server.gunicorn.owned_dirs import remove_owned_dirs  # gunicorn's halt stopped there, its hook not run

        remove_owned_dirs()
        print(f"wsgi-infer: {halted.reason}", file=sys.stderr)
        return halted.exit_status
    return 0


def _sets_variables(gunicorn_args: list[str]) -> bool:
    """Whether gunicorn's own flags set environment variables (``-e``, ``--env``), which its master reads later."""
    flags = [*gunicorn_args, *os.environ.get("GUNICORN_CMD_ARGS", "").split()]
    return any(flag == "--env" or flag.startswith(("--env=", "-e")) for flag in flags)


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return int(text)


def _address(text: str) -> str:
    port = text.rpartition(":")[2] if not text.startswith("unix:") else "0"
    if not text.strip() or (port.isdigit() and int(port) > 65535):  # "": the default bound unsaid; a port past
        raise argparse.ArgumentTypeError(f"must be HOST:PORT or unix:PATH, got {text!r}")  # 65535: a traceback
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="wsgi-infer", description="LLM inference server and offline generation")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="print the completion of one prompt")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="Hugging Face directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument(
        "--quantization", choices=QUANTIZATION_METHODS, default="auto", help="packed weights for small batches (CPU)"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    prepare = commands.add_parser(
        "prepare", help="build the kernels and convert the model into the cache ahead of the first start"
    )
    prepare.add_argument(
        "--workers", type=_at_least_one, default=1, help="the workers the server will run (their threads)"
    )
    serve = commands.add_parser("serve", help="run the HTTP server (gunicorn, gevent worker)")
    for command in (prepare, serve):
        command.add_argument(
            "--model",
            action="append",
            help="a model to serve (again for more: the first is the default); sets WSGI_INFER_MODEL (and _MODELS)",
        )
        command.add_argument("--models-dir", help="serve every GGUF file and Hugging Face directory in it")
        command.add_argument("--models-config", help="a TOML file of [models.NAME] tables (docs/models.md)")
    serve.add_argument("--bind", type=_address, default=None, help="HOST:PORT (default 127.0.0.1:8000)")
    serve.add_argument("--workers", type=_at_least_one, default=None)
    serve.add_argument("gunicorn_args", nargs=argparse.REMAINDER, help="further gunicorn flags, after --")
    args = parser.parse_args(argv)
    if args.command == "serve":
        if args.gunicorn_args[:1] == ["--"]:
            args.gunicorn_args = args.gunicorn_args[1:]
        return _serve(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return _prepare(args) if args.command == "prepare" else _generate(args)
    except (ValueError, OSError) as exc:  # ModelLoadError included; a cache that cannot be written
        print(f"wsgi-infer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for it, not a traceback from wherever it came
        print("wsgi-infer: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
