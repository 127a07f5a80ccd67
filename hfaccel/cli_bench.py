"""`python -m hfaccel bench`: its options and the runner that loads SmolLM2 once for the suites that
share it (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import importlib

from hfaccel.cli_types import (
    DTYPES,
    _count,
    _names_from,
    _positive_float,
    _positive_int,
    _positive_ints,
    _positive_numbers,
    dtype_named,
)

SUITES = (
    "offline", "prefix", "chunked", "batching", "concurrency", "speculative", "rollouts", "step", "start",
    "kernels", "tp", "goodput", "host", "coverage", "serve", "quant", "burst", "kvcache", "compile",
    "threads", "windows", "floor",
)  # fmt: skip


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The ``bench`` command and its options, on the CLI's subcommand parsers."""
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
        "thread, OpenMP pools kept vs given back), windows (sliding layers' own block pool), floor (the demo's "
        "workload against the matmul floor, with the defaults)",
    )
    bench.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="model dtype (default bfloat16)")
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
        type=_count,
        default=3,
        help="step: alternated end-to-end runs of each mode (0: none)",
    )
    bench.add_argument(
        "--spec-new-tokens", type=_positive_int, default=96, help="speculative: new tokens per request"
    )
    bench.add_argument(
        "--rates", type=_positive_numbers, default="1,2,4,8", help="goodput: arrival rates (requests/s)"
    )
    bench.add_argument(
        "--goodput-requests", type=_positive_int, default=20, help="goodput: requests per rate"
    )
    bench.add_argument("--tpot-target-ms", type=_positive_float, default=250.0, help="goodput: TPOT target")
    bench.add_argument("--ttft-target-ms", type=_positive_float, default=2000.0, help="goodput: TTFT target")
    bench.add_argument(
        "--goodput-systems",
        type=_names_from(("defaults", "best fixed", "adaptive", "hf")),
        default="defaults,best fixed,adaptive,hf",
        help="goodput: systems to compare",
    )
    bench.add_argument(
        "--goodput-repeats",
        type=_positive_int,
        default=1,
        help="goodput: sweeps, the systems' order reversed each time",
    )
    bench.add_argument("--goodput-plot", default=None, help="goodput: save goodput vs rate to this PNG")
    bench.add_argument(
        "--host-share",
        action="store_true",
        help="goodput: also the host's share of a step, async scheduling off/on",
    )


def run_bench(args: argparse.Namespace) -> None:
    """Load SmolLM2 once and run the requested benchmark suites on it."""
    import torch

    from hfaccel.bench.offline import run_offline_benchmark
    from hfaccel.bench.serving import run_serving_benchmarks
    from hfaccel.default_model import load_default_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    suites = args.suite or [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown or not suites:  # (main turns a ValueError into its one-line error, exit code 2)
        raise ValueError(f"unknown suite(s) {unknown or suites!r}; choose from {', '.join(SUITES)}")
    dtype = dtype_named(args.dtype)
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
        "floor": ("workload_floor", "run_floor_benchmark"),  # SmolLM2 float32, the demo's workload
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
            batch_sizes=args.step_batches,
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
            systems=args.systems,
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
            clients=args.callers,
            per_client=args.requests_per_caller,
            max_tokens=args.concurrency_new_tokens,
        )
    if "concurrency" in suites:
        from hfaccel.bench.concurrency import run_concurrency_benchmark

        run_concurrency_benchmark(
            model,
            tokenizer,
            callers=args.callers,
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
            batches=args.spec_batches,
        )
    if "goodput" in suites:
        from hfaccel.bench.goodput import run_goodput_benchmark

        run_goodput_benchmark(
            model,
            dtype,
            rates=args.rates,
            num_requests=args.goodput_requests,
            tpot_target_ms=args.tpot_target_ms,
            ttft_target_ms=args.ttft_target_ms,
            systems=args.goodput_systems,
            repeats=args.goodput_repeats,
            plot_path=args.goodput_plot,
        )
        if args.host_share:
            from hfaccel.bench.goodput import run_host_share

            run_host_share(model)
    if "rollouts" in suites:
        from hfaccel.bench.rollouts import run_rollout_benchmarks

        run_rollout_benchmarks(model, tokenizer)
