"""hfaccel: paged-KV continuous batching for Hugging Face transformers.

Commands: generate (answer prompts with a local model), serve (an OpenAI-compatible server), demo (what
hfaccel is for, on SmolLM2), doctor (what this machine can run), bench (benchmarks).
`python -m hfaccel COMMAND --help` for each.
Set HFACCEL_DEBUG=1 to see a traceback instead of a one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from hfaccel.cli_bench import add_bench_parser, run_bench
from hfaccel.cli_loading import (
    CommandError,
    check_model_folder,
    check_serving_templates,
    load_model,
    read_templates,
)
from hfaccel.cli_types import (
    DTYPES,
    _host,
    _key,
    _memory,
    _model_len,
    _non_negative_float,
    _origins,
    _port,
    _positive_int,
    _seed,
    dtype_named,
)

_CleanError = CommandError


def _add_device_and_weights(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="auto",
        help="auto (default: CUDA if any, else CPU; CPU for int8/int4), cpu, cuda:N",
    )
    parser.add_argument(
        "--weights",
        choices=("auto", "bfloat16", "float16", "float32", "int8", "int4"),
        help="patch(weights=...): auto, a dtype, or int8/int4 quantized linears (CPU; docs/benchmarks.md)",
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the model folder's own Python code (its config names it), as transformers' option",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m hfaccel` (every command and option has a help line)."""
    from hfaccel import __version__

    parser = argparse.ArgumentParser(
        prog="hfaccel", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"hfaccel {__version__} (torch {_version('torch')}, transformers {_version('transformers')})",
        help="print the versions of hfaccel, torch and transformers, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="answer prompts (arguments, or stdin one per line) with a local model through hfaccel",
        description="Answer prompts with a local Hugging Face model through hfaccel (one continuous batch). "
        "Prompts come from the arguments, or from stdin, one per line. The tokenizer's chat template is "
        "applied when it has one.",
    )
    gen.add_argument(
        "prompts", nargs="*", metavar="PROMPT", help="prompts (default: read stdin, one per line)"
    )
    gen.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="a local Hugging Face model folder (config.json, weights, tokenizer); default: the embedded "
        "SmolLM2-135M-Instruct",
    )
    gen.add_argument("--max-new-tokens", type=_positive_int, default=128, help="most new tokens per answer")
    gen.add_argument(
        "--temperature",
        type=_non_negative_float,
        default=None,
        help="0: greedy; > 0: sample (default: the model's generation config, as transformers does)",
    )
    gen.add_argument("--seed", type=_seed, default=None, help="random seed of sampled answers")
    gen.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="weights dtype (default auto: a folder's checkpoint in its own, as transformers' from_pretrained "
        "and serve load it; the embedded SmolLM2 in float32)",
    )
    gen.add_argument("--no-chat-template", action="store_true", help="send prompts as plain text")
    _add_device_and_weights(gen)

    srv = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server over a local model (/v1/chat/completions, /v1/responses, ...)",
        description="Serve a local Hugging Face model (default: the embedded SmolLM2-135M-Instruct) over "
        "OpenAI's API: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health, /tokenize, "
        "/detokenize, "
        "/metrics. Every client's requests join one continuous batch. Ctrl-C or SIGTERM stops it, letting "
        "requests in flight finish.",
    )
    srv.add_argument("model", nargs="?", metavar="MODEL_DIR", default=None, help="a local model folder")
    srv.add_argument(
        "--host",
        type=_host,
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1: this machine only)",
    )
    srv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    srv.add_argument(
        "--api-key",
        type=_key,
        default=None,
        help="require Authorization: Bearer KEY (default: $HFACCEL_API_KEY)",
    )
    srv.add_argument(
        "--allowed-origins",
        type=_origins,
        default=(),
        help="browser origins that may call the server (CORS), comma-separated, or '*' for any (default none)",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model id clients name (default: the folder)"
    )
    srv.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="weights dtype (default auto: a folder's checkpoint in its own, as transformers' from_pretrained "
        "and serve load it; the embedded SmolLM2 in float32)",
    )
    _add_device_and_weights(srv)
    srv.add_argument("--max-num-seqs", type=_positive_int, default=None, help="most sequences in one step")
    srv.add_argument("--max-model-len", type=_model_len, default=None, help="longest sequence served")
    srv.add_argument(
        "--kv-cache-memory", type=_memory, default=None, help="KV cache bytes, or a fraction of free"
    )
    srv.add_argument(
        "--compile",
        choices=("auto", "off", "decode", "all", "background"),
        help="torch.compile (background: serve eagerly while each batch size compiles)",
    )
    kv_dtypes = ("auto", "float32", "bfloat16", "float16", "int8")
    srv.add_argument("--kv-cache-dtype", choices=kv_dtypes, help="KV cache dtype (default: the model's)")
    srv.add_argument(
        "--max-tokens-limit", type=_positive_int, default=4096, help="most max_tokens a request asks"
    )
    srv.add_argument("--max-n", type=_positive_int, default=16, help="most choices (n) a request asks")
    srv.add_argument("--max-pending", type=_positive_int, default=256, help="requests in flight before 429")
    srv.add_argument(
        "--chat-template",
        default=None,
        help="a chat template (a file, or the template itself) for the tokenizer",
    )
    srv.add_argument(
        "--response-template",
        default=None,
        help="how replies are read into reasoning and tool calls: a JSON file (or JSON) in transformers' "
        "response_template format (default: the tokenizer's, else transformers serve's for the model type)",
    )
    srv.add_argument(
        "--max-prompt-tokens", type=_positive_int, default=None, help="longest prompt (default: context)"
    )

    demo = sub.add_parser(
        "demo",
        help="a mixed chat workload on SmolLM2: HF static batches vs hfaccel, outputs compared, speed-up",
        description="24 chat prompts (a third share a long system prompt) with 16-128 new tokens each, "
        "through HF generate in static padded batches and through hfaccel.generate; checks that every "
        "request's tokens are the same and prints the speed-up.",
    )
    demo.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="float32",
        help="float32 (default: the parity check needs exact arithmetic), or auto: the fast dtype of this CPU",
    )
    demo.add_argument("--num-prompts", type=_positive_int, default=24, help="number of chat prompts")
    demo.add_argument("--max-new-tokens", type=_positive_int, default=128, help="longest output of a request")
    demo.add_argument("--batch-size", type=_positive_int, default=8, help="HF static batch size")
    demo.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        help="shard the model over N processes: torchrun --nproc-per-node N -m hfaccel demo --tensor-parallel-size N",
    )

    doctor = sub.add_parser(
        "doctor",
        help="what this machine can run, and a correctness check of every attention backend",
        description="What this machine can run (devices, backends, dtypes), and a correctness check of every "
        "attention backend against the torch reference. With --model: what of that model runs on the engine.",
    )
    doctor.add_argument(
        "--model", metavar="PATH", default=None, help="also check a local model folder (hfaccel.check)"
    )

    add_bench_parser(sub)
    return parser


def _version(package: str) -> str:
    """An installed package's version, read without importing it (`--version` and `--help` stay quick)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `doctor` starts again with
    try:
        _run(args)
    except (_CleanError, ValueError, OSError) as error:
        if os.environ.get("HFACCEL_DEBUG"):
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        parser.exit(2, f"hfaccel {args.command}: error: {message}\n")
    except KeyboardInterrupt:
        parser.exit(130, "interrupted\n")


def _run(args: argparse.Namespace) -> None:
    import torch  # (here, not at import: `--help` needs none of it)

    if args.command == "doctor":
        from hfaccel.doctor import run_doctor

        if args.model is not None:  # before the backends' report (and its restart), not after it
            check_model_folder(args.model)

        if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
            # Triton's interpreter must be on before triton is first imported (importing transformers
            # already imports it): start again with it on, so the Triton kernels can be checked here.
            os.execve(
                sys.executable,
                [sys.executable, "-m", "hfaccel", *args.argv],
                {**os.environ, "TRITON_INTERPRET": "1"},
            )

        reports = run_doctor()
        if args.model is not None:
            import hfaccel

            model, _ = _load(args.model, torch.float32)
            print()
            print(hfaccel.check(model))
        raise SystemExit(1 if any(r.status == "FAIL" for r in reports) else 0)
    if args.command == "demo":
        from hfaccel.bench.demo import run_demo

        # Under torchrun every rank runs the demo (the same calls); only rank 0 prints.
        quiet = int(os.environ.get("RANK", "0")) != 0
        with (
            open(os.devnull, "w") as sink,
            contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext(),
        ):
            run_demo(
                dtype=_dtype(args.dtype),
                num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                tensor_parallel_size=args.tensor_parallel_size,
            )
    elif args.command == "generate":
        run_generate(args)
    elif args.command == "serve":
        run_serve(args)
    else:
        run_bench(args)


_load = load_model  # a name tests replace
_read_templates = read_templates  # (its old name)


def _dtype(name: str) -> torch.dtype | None:
    """`--dtype`: None for "auto" (the checkpoint's own)."""
    return None if name == "auto" else dtype_named(name)


def run_serve(args: argparse.Namespace) -> None:
    """`hfaccel serve`: the model on disk (or the embedded one) behind the OpenAI-compatible server."""
    try:
        from hfaccel.server import Limits
        from hfaccel.server.server import run_forever
    except ImportError as error:
        raise _CleanError(
            f"hfaccel serve needs the serve extra: pip install 'hfaccel[serve]' ({error})"
        ) from error
    chat_template, response_template = read_templates(args.chat_template, args.response_template)
    model, tokenizer = _load(
        args.model, _dtype(args.dtype), args.weights, args.device, args.trust_remote_code, "MODEL_DIR"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if response_template is not None:
        tokenizer.response_template = response_template
    check_serving_templates(tokenizer, chat_template is not None, response_template is not None)
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model else None)
    engine = {
        key: value
        for key, value in (
            ("max_num_seqs", args.max_num_seqs),
            ("max_model_len", args.max_model_len),
            ("kv_cache_memory", args.kv_cache_memory),
            ("compile", args.compile),
            ("dtype", args.kv_cache_dtype),
        )
        if value is not None
    }
    limits = Limits(
        max_tokens=args.max_tokens_limit,
        max_n=args.max_n,
        max_pending=args.max_pending,
        max_prompt_tokens=args.max_prompt_tokens,
    )
    run_forever(
        model, tokenizer, host=args.host, port=args.port, api_key=args.api_key,
        model_id=name or "SmolLM2-135M-Instruct", limits=limits, allowed_origins=args.allowed_origins,
        **engine,
    )  # fmt: skip


def run_generate(args: argparse.Namespace) -> None:
    """`hfaccel generate`: answer the prompts, in order, each answer after a '> prompt' line when there
    are several."""
    import hfaccel

    prompts = list(args.prompts)
    if not prompts:
        if sys.stdin.isatty():
            raise _CleanError("no prompts: give them as arguments, or on stdin, one per line")
        prompts = [line.strip() for line in sys.stdin if line.strip()]
        if not prompts:
            raise _CleanError("no prompts on stdin (one per line)")
    model, tokenizer = _load(
        args.model, _dtype(args.dtype), args.weights, args.device, args.trust_remote_code
    )
    chat = not args.no_chat_template and getattr(tokenizer, "chat_template", None)
    inputs = [[{"role": "user", "content": p}] for p in prompts] if chat else prompts
    sampling: dict = {}  # unset: the model's generation config decides, as in transformers' generate
    if args.temperature is not None:
        sampling = (
            {"do_sample": True, "temperature": args.temperature}
            if args.temperature > 0
            else {"do_sample": False}
        )
    completions = hfaccel.generate(
        model,
        inputs,
        tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=sys.stderr.isatty(),
        errors="return",  # a refused prompt is named beside the answers of the others
        **sampling,
    )
    refused = []
    for index, (prompt, completion) in enumerate(zip(prompts, completions)):
        if len(prompts) > 1:
            print(f"> {prompt}")
        if completion.finish_reason == "error":
            refused.append(f"prompt {index + 1} ({prompt!r}) refused: {completion.error}")
        else:
            print(completion.text.strip())
        if len(prompts) > 1:
            print()
    if refused:
        raise _CleanError("; ".join(refused))


if __name__ == "__main__":
    main()
