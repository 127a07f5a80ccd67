"""hfaccel: paged-KV continuous batching for Hugging Face transformers.

Commands: generate (answer prompts with a local model), serve (an OpenAI-compatible server), demo (what
hfaccel is for, on SmolLM2), doctor (what this machine can run), bench (benchmarks).
`python -m hfaccel COMMAND --help` for each.
Set HFACCEL_DEBUG=1 to see a traceback instead of a one-line error.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys

import torch

from hfaccel.cli_loading import CommandError, load_model, read_templates
from hfaccel.cli_types import (
    _key,
    _memory,
    _names_from,
    _non_negative_float,
    _port,
    _positive_int,
    _positive_ints,
    _positive_numbers,
)

SUITES = (
    "offline", "prefix", "chunked", "batching", "concurrency", "speculative", "rollouts", "step", "start",
    "kernels", "tp", "goodput", "host", "coverage", "serve", "quant", "burst", "kvcache", "compile",
    "threads", "windows",
)  # fmt: skip
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        version=f"hfaccel {__version__} (torch {torch.__version__}, transformers {_transformers_version()})",
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
        "--temperature", type=_non_negative_float, default=0.0, help="0: greedy (default); > 0: sample"
    )
    gen.add_argument("--seed", type=int, default=None, help="random seed of sampled answers")
    gen.add_argument(
        "--dtype",
        choices=("auto", *_DTYPES),
        default="float32",
        help="weights dtype (default float32; auto: the checkpoint's own, as from_pretrained's dtype='auto')",
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
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    srv.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    srv.add_argument(
        "--api-key",
        type=_key,
        default=None,
        help="require Authorization: Bearer KEY (default: $HFACCEL_API_KEY)",
    )
    srv.add_argument(
        "--served-model-name", default=None, help="the model id clients name (default: the folder)"
    )
    srv.add_argument(
        "--dtype",
        choices=("auto", *_DTYPES),
        default="float32",
        help="weights dtype (default float32; auto: the checkpoint's own, as from_pretrained's dtype='auto')",
    )
    _add_device_and_weights(srv)
    srv.add_argument("--max-num-seqs", type=_positive_int, default=None, help="most sequences in one step")
    srv.add_argument("--max-model-len", type=_positive_int, default=None, help="longest sequence served")
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
        choices=("auto", *_DTYPES),
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

    bench = sub.add_parser(
        "bench",
        help="offline throughput vs HF, then the scheduler benchmarks",
        description="Benchmarks on SmolLM2; see docs/benchmarks.md.",
    )
    bench.add_argument("suite", nargs="*", help=f"suites to run (default: all): {', '.join(SUITES)}")
    bench.add_argument(
        "--suites",
        default=",".join(SUITES),
        help="comma-separated: offline (vs HF), prefix (caching on/off), chunked (prefill chunking on/off), "
        "batching (static/dynamic/continuous), concurrency (many callers: HF vs hfaccel generate per thread), "
        "speculative (drafts on/off: prompt lookup, draft models), rollouts (GRPO-style sampling vs HF, 4 LoRA "
        "adapters mixed vs one by one, release/rebuild), step (decode step vs HF and the matmul floor, "
        "interleaved; then 8 requests end to end, compiled vs eager), start (cold vs warm start of the compiled "
        "decode step: two fresh processes sharing a new inductor cache), kernels "
        "(attention backends that run natively here), tp (TP=1 with 2 threads vs TP=2 with 1 thread each, 2 "
        "gloo processes), goodput (requests/s meeting TPOT and TTFT targets under Poisson arrivals: fixed "
        "settings vs adaptive scheduling vs HF generate_batch), coverage (which HF generate options run on the engine "
        "and which fall back, on a tiny random Llama: a markdown table and a bar chart), host (the host's share "
        "of a step vs HF's eager step, a tiny model's grid), serve (hfaccel serve vs transformers serve over HTTP), "
        "quant (weight formats vs llama.cpp), burst (40 requests under a TPOT target), kvcache (KV-cache "
        "dtypes), compile (compile modes: first answer and throughput), threads (steps stepped by another "
        "thread, OpenMP pools kept vs given back)",
    )
    bench.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="model dtype (default bfloat16)")
    bench.add_argument("--num-requests", type=_positive_int, default=32, help="offline: number of requests")
    bench.add_argument("--min-len", type=_positive_int, default=8, help="offline: shortest output length")
    bench.add_argument("--max-len", type=_positive_int, default=256, help="offline: longest output length")
    bench.add_argument(
        "--static-batch-size", type=_positive_int, default=8, help="offline: HF static batch size"
    )
    bench.add_argument(
        "--systems",
        type=_names_from(("hf_static", "hf_generate_batch", "hfaccel")),
        default="hf_static,hf_generate_batch,hfaccel",
        help="offline: comma-separated systems to compare (hf_static, hf_generate_batch, hfaccel)",
    )
    bench.add_argument("--json", default=None, help="also write the results to this file")
    bench.add_argument(
        "--coverage-out", default="bench-results", help="coverage: folder for coverage.md and coverage.png"
    )
    bench.add_argument(
        "--families",
        action="store_true",
        help="coverage: the family matrix instead (every decoder-only family: served with HF's tokens, or refused)",
    )
    bench.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="torch CPU threads for the run (default: torch's own choice); 1 is steadier on a shared machine",
    )
    bench.add_argument(
        "--callers", type=_positive_ints, default="1,4,16", help="concurrency: numbers of concurrent callers"
    )
    bench.add_argument(
        "--requests-per-caller", type=_positive_int, default=4, help="concurrency: requests each caller sends"
    )
    bench.add_argument(
        "--concurrency-new-tokens", type=_positive_int, default=32, help="concurrency: new tokens per request"
    )
    bench.add_argument(
        "--spec-methods",
        default="ngram",
        help="speculative: comma-separated draft sources: ngram, self (SmolLM2 as its own draft model: "
        "the draft machinery's overhead), early-exit:N (SmolLM2's first N layers as the draft model)",
    )
    bench.add_argument("--spec-batches", type=_positive_ints, default="1,16", help="speculative: batch sizes")
    bench.add_argument("--step-batches", type=_positive_ints, default="1,8,32", help="step: batch sizes")
    bench.add_argument("--step-rounds", type=_positive_int, default=15, help="step: interleaved rounds")
    bench.add_argument(
        "--step-per-bucket",
        action="store_true",
        help="step: also time per-bucket static graphs (one compile per bucket) beside the dynamic graph",
    )
    bench.add_argument(
        "--step-bf16-kv",
        action="store_true",
        help="step: also time the compiled float32 step over a bfloat16 KV cache (half the KV bytes read)",
    )
    bench.add_argument(
        "--step-e2e-repeats",
        type=int,
        default=3,
        help="step: alternated end-to-end runs of each mode (0: none)",
    )
    bench.add_argument("--spec-new-tokens", type=int, default=96, help="speculative: new tokens per request")
    bench.add_argument(
        "--rates", type=_positive_numbers, default="1,2,4,8", help="goodput: arrival rates (requests/s)"
    )
    bench.add_argument("--goodput-requests", type=int, default=20, help="goodput: requests per rate")
    bench.add_argument("--tpot-target-ms", type=float, default=250.0, help="goodput: TPOT target")
    bench.add_argument("--ttft-target-ms", type=float, default=2000.0, help="goodput: TTFT target")
    bench.add_argument(
        "--goodput-systems",
        type=_names_from(("defaults", "best fixed", "adaptive", "hf")),
        default="defaults,best fixed,adaptive,hf",
        help="goodput: systems to compare",
    )
    bench.add_argument(
        "--goodput-repeats",
        type=int,
        default=1,
        help="goodput: sweeps, the systems' order reversed each time",
    )
    bench.add_argument("--goodput-plot", default=None, help="goodput: save goodput vs rate to this PNG")
    bench.add_argument(
        "--host-share",
        action="store_true",
        help="goodput: also the host's share of a step, async scheduling off/on",
    )
    return parser


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


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
    if args.command == "doctor":
        from hfaccel.doctor import run_doctor

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
                dtype=None if args.dtype == "auto" else _DTYPES[args.dtype],
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
    return None if name == "auto" else _DTYPES[name]


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
        model_id=name or "SmolLM2-135M-Instruct", limits=limits, **engine,
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
    sampling = (
        {"do_sample": True, "temperature": args.temperature} if args.temperature > 0 else {"do_sample": False}
    )
    completions = hfaccel.generate(
        model,
        inputs,
        tokenizer=tokenizer,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=sys.stderr.isatty(),
        **sampling,
    )
    for prompt, completion in zip(prompts, completions):
        if len(prompts) > 1:
            print(f"> {prompt}")
        print(completion.text.strip())
        if len(prompts) > 1:
            print()


def run_bench(args: argparse.Namespace) -> None:
    """Load SmolLM2 once and run the requested benchmark suites on it."""
    from hfaccel.bench.offline import run_offline_benchmark
    from hfaccel.bench.serving import run_serving_benchmarks
    from hfaccel.default_model import load_default_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    suites = args.suite or [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    dtype = _DTYPES[args.dtype]
    if "coverage" in suites:  # a tiny random model of its own, seconds
        from hfaccel.bench.coverage import run_coverage

        if args.families:
            from hfaccel.bench.families import run_families

            run_families(args.coverage_out)
        else:
            run_coverage(args.coverage_out)
        suites = [s for s in suites if s != "coverage"]
        if not suites:
            return
    # Suites that load what they need themselves (their own models, processes or weight formats).
    standalone = {
        "tp": ("parallel", "run_parallel_benchmark"),  # its own processes and SmolLM2-sized model
        "kernels": ("kernels", "run_kernel_benchmark"),
        "burst": ("burst", "run_burst_benchmark"),  # SmolLM2 float32, 40 requests from threads
        "threads": ("thread_steps", "run_thread_steps_benchmark"),  # a process per run, OpenMP pools
        "quant": ("quant", "run_quant_benchmark"),  # SmolLM2 once per weight format, llama.cpp's GGUF
        "kvcache": ("kv_cache", "run_kv_cache_benchmark"),  # SmolLM2 float32, one engine per KV dtype
        "host": ("host", "run_host_benchmark"),  # a tiny random model of its own
        "compile": ("compile_wait", "run_compile_wait_benchmark"),  # a process per compile mode
        "start": ("step", "run_start_benchmark"),
        "windows": ("windows", "run_windows_benchmark"),  # a tiny Gemma 3 of its own, 4,000-token runs
    }
    for suite in [s for s in suites if s in standalone]:
        module, function = standalone[suite]
        getattr(importlib.import_module(f"hfaccel.bench.{module}"), function)()
    suites = [s for s in suites if s not in standalone]
    if not suites:
        return
    if "step" in suites:
        from hfaccel.bench.step import run_end_to_end, run_step_benchmark

        fp32_model, _ = load_default_model(torch.float32)  # the matmul floor is stated in float32
        run_step_benchmark(
            fp32_model,
            batch_sizes=tuple(int(b) for b in args.step_batches.split(",") if b.strip()),
            steps=args.step_rounds,
            per_bucket=args.step_per_bucket,
            bf16_kv=args.step_bf16_kv,
        )
        if args.step_e2e_repeats > 0:
            run_end_to_end(fp32_model, repeats=args.step_e2e_repeats)
        del fp32_model
        suites = [s for s in suites if s != "step"]
        if not suites:
            return
    model, tokenizer = load_default_model(dtype)
    if "offline" in suites:
        run_offline_benchmark(
            model,
            tokenizer,
            num_requests=args.num_requests,
            min_len=args.min_len,
            max_len=args.max_len,
            static_batch_size=args.static_batch_size,
            systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
            json_path=args.json,
        )
    serving = tuple(s for s in suites if s in ("prefix", "chunked", "batching"))
    if serving:
        run_serving_benchmarks(model, serving, dtype)
    if "serve" in suites:
        from hfaccel.bench.serve import run_serve_benchmark

        run_serve_benchmark(
            model,
            tokenizer,
            clients=tuple(int(c) for c in args.callers.split(",") if c.strip()),
            per_client=args.requests_per_caller,
            max_tokens=args.concurrency_new_tokens,
        )
    if "concurrency" in suites:
        from hfaccel.bench.concurrency import run_concurrency_benchmark

        run_concurrency_benchmark(
            model,
            tokenizer,
            callers=tuple(int(c) for c in args.callers.split(",") if c.strip()),
            requests_per_caller=args.requests_per_caller,
            max_new_tokens=args.concurrency_new_tokens,
        )
    if "speculative" in suites:
        from hfaccel.bench.speculative import run_speculative_benchmark

        run_speculative_benchmark(
            model,
            tokenizer,
            new_tokens=args.spec_new_tokens,
            methods=tuple(m.strip() for m in args.spec_methods.split(",") if m.strip()),
            batches=tuple(int(b) for b in args.spec_batches.split(",") if b.strip()),
        )
    if "goodput" in suites:
        from hfaccel.bench.goodput import run_goodput_benchmark

        run_goodput_benchmark(
            model,
            dtype,
            rates=tuple(float(r) for r in args.rates.split(",") if r.strip()),
            num_requests=args.goodput_requests,
            tpot_target_ms=args.tpot_target_ms,
            ttft_target_ms=args.ttft_target_ms,
            systems=tuple(s.strip() for s in args.goodput_systems.split(",") if s.strip()),
            repeats=args.goodput_repeats,
            plot_path=args.goodput_plot,
        )
        if args.host_share:
            from hfaccel.bench.goodput import run_host_share

            run_host_share(model)
    if "rollouts" in suites:
        from hfaccel.bench.rollouts import run_rollout_benchmarks

        run_rollout_benchmarks(model, tokenizer)


if __name__ == "__main__":
    main()
