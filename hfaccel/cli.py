"""`python -m hfaccel demo|bench`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

SUITES = (
    "offline",
    "prefix",
    "chunked",
    "batching",
    "concurrency",
    "speculative",
    "rollouts",
    "step",
    "kernels",
    "tp",
    "goodput",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(prog="hfaccel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="answer chat prompts with SmolLM2 through hfaccel, and compare speed")
    demo.add_argument("--dtype", choices=_DTYPES, default="float32")
    demo.add_argument("--max-new-tokens", type=int, default=64)
    demo.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the model over N processes: torchrun --nproc-per-node N -m hfaccel demo --tensor-parallel-size N",
    )
    sub.add_parser(
        "doctor", help="what this machine can run, and a correctness check of every attention backend"
    )
    bench = sub.add_parser("bench", help="offline throughput vs HF, then the scheduler benchmarks")
    bench.add_argument("suite", nargs="*", help=f"suites to run (default: all): {', '.join(SUITES)}")
    bench.add_argument(
        "--suites",
        default=",".join(SUITES),
        help="comma-separated: offline (vs HF), prefix (caching on/off), chunked (prefill chunking on/off), "
        "batching (static/dynamic/continuous), concurrency (many callers: HF vs hfaccel generate per thread), "
        "speculative (drafts on/off: prompt lookup, draft models), rollouts (GRPO-style sampling vs HF, 4 LoRA "
        "adapters mixed vs one by one, release/rebuild), step (decode step vs HF and the matmul floor), kernels "
        "(attention backends that run natively here), tp (TP=1 with 2 threads vs TP=2 with 1 thread each, 2 "
        "gloo processes), goodput (requests/s meeting TPOT and TTFT targets under Poisson arrivals: fixed "
        "settings vs adaptive scheduling vs HF generate_batch)",
    )
    bench.add_argument("--dtype", choices=_DTYPES, default="bfloat16")
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--min-len", type=int, default=8)
    bench.add_argument("--max-len", type=int, default=256)
    bench.add_argument("--static-batch-size", type=int, default=8)
    bench.add_argument("--systems", default="hf_static,hf_generate_batch,hfaccel")
    bench.add_argument("--json", default=None, help="also write the results to this file")
    bench.add_argument("--callers", default="1,4,16", help="concurrency: numbers of concurrent callers")
    bench.add_argument(
        "--requests-per-caller", type=int, default=4, help="concurrency: requests each caller sends"
    )
    bench.add_argument(
        "--concurrency-new-tokens", type=int, default=32, help="concurrency: new tokens per request"
    )
    bench.add_argument(
        "--spec-methods",
        default="ngram",
        help="speculative: comma-separated draft sources: ngram, self (SmolLM2 as its own draft model: "
        "the draft machinery's overhead), early-exit:N (SmolLM2's first N layers as the draft model)",
    )
    bench.add_argument("--spec-batches", default="1,16", help="speculative: batch sizes")
    bench.add_argument("--spec-new-tokens", type=int, default=96, help="speculative: new tokens per request")
    bench.add_argument("--rates", default="1,2,4,8", help="goodput: arrival rates (requests/s)")
    bench.add_argument("--goodput-requests", type=int, default=20, help="goodput: requests per rate")
    bench.add_argument("--tpot-target-ms", type=float, default=250.0, help="goodput: TPOT target")
    bench.add_argument("--ttft-target-ms", type=float, default=2000.0, help="goodput: TTFT target")
    bench.add_argument(
        "--goodput-systems", default="defaults,best fixed,adaptive,hf", help="goodput: systems to compare"
    )
    args = parser.parse_args(argv)
    if args.command == "doctor":
        from hfaccel.doctor import run_doctor

        if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
            # Triton's interpreter must be on before triton is first imported (importing transformers
            # already imports it): start again with it on, so the Triton kernels can be checked here.
            os.execve(
                sys.executable,
                [sys.executable, "-m", "hfaccel", *sys.argv[1:]],
                {**os.environ, "TRITON_INTERPRET": "1"},
            )

        reports = run_doctor()
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
                dtype=_DTYPES[args.dtype],
                max_new_tokens=args.max_new_tokens,
                tensor_parallel_size=args.tensor_parallel_size,
            )
    else:
        run_bench(args)


def run_bench(args: argparse.Namespace) -> None:
    """Load SmolLM2 once and run the requested benchmark suites on it."""
    from hfaccel.bench.offline import run_offline_benchmark
    from hfaccel.bench.serving import run_serving_benchmarks
    from hfaccel.default_model import load_default_model

    suites = args.suite or [s.strip() for s in args.suites.split(",") if s.strip()]
    unknown = sorted(set(suites) - set(SUITES))
    if unknown:
        raise SystemExit(f"unknown suite(s) {unknown}; choose from {', '.join(SUITES)}")
    dtype = _DTYPES[args.dtype]
    if "tp" in suites:  # its own processes and its own SmolLM2-sized model (divisible heads)
        from hfaccel.bench.parallel import run_parallel_benchmark

        run_parallel_benchmark()
        suites = [s for s in suites if s != "tp"]
        if not suites:
            return
    if "kernels" in suites:
        from hfaccel.bench.kernels import run_kernel_benchmark

        run_kernel_benchmark(torch.float32)
        suites = [s for s in suites if s != "kernels"]
        if not suites:
            return
    if "step" in suites:
        from hfaccel.bench.step import run_step_benchmark

        fp32_model, _ = load_default_model(torch.float32)  # the matmul floor is stated in float32
        run_step_benchmark(fp32_model)
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
        )
    if "rollouts" in suites:
        from hfaccel.bench.rollouts import run_rollout_benchmarks

        run_rollout_benchmarks(model, tokenizer)


if __name__ == "__main__":
    main()
