"""`bench serve`: one chat workload through ``transformers serve --continuous-batching`` and through
``hfaccel serve`` on the same model folder, one server at a time (two cores: never side by side in
time), with 1, 4 and 16 concurrent streaming clients of the real `openai` client. Requests/s, TTFT and
TPOT p50 / p99, and hfaccel's ratio to transformers at each concurrency."""

from __future__ import annotations

import asyncio
import copy
import http.client
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hfaccel.bench.machine import cpu_description
from hfaccel.bench.workloads import QUESTIONS
from hfaccel.engine.metrics import percentile


@dataclass
class ServeResult:
    system: str
    clients: int
    seconds: float
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def requests_per_s(self) -> float:
        return len(self.ttft) / self.seconds if self.seconds else 0.0


def server_command(system: str, folder: str, port: int, dtype: str) -> list[str]:
    if system == "transformers":
        cli = os.path.join(os.path.dirname(sys.executable), "transformers")
        options = ["--continuous-batching", "--dtype", dtype, "--port", str(port), "--host", "127.0.0.1"]
        return [cli, "serve", folder, *options]
    options = ["--dtype", dtype, "--port", str(port), "--served-model-name", folder]
    return [sys.executable, "-m", "hfaccel", "serve", folder, *options]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(port: int, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("the server did not become healthy in time")


async def drive(
    port: int, model_id: str, clients: int, per_client: int, max_tokens: int, system: str
) -> ServeResult:
    """`clients` concurrent clients, each streaming `per_client` chat requests one after another."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    result = ServeResult(system, clients, 0.0)

    async def one(index: int) -> None:
        for r in range(per_client):
            question = QUESTIONS[(index * per_client + r) % len(QUESTIONS)]
            start, first, count = time.perf_counter(), None, 0
            try:
                stream = await client.chat.completions.create(
                    model=model_id, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                    temperature=0, stream=True,
                )  # fmt: skip
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        first = first or time.perf_counter()
                        count += 1
            except Exception as error:  # noqa: BLE001 - a failed request is reported, not fatal
                result.errors.append(f"{type(error).__name__}: {error}")
                continue
            end = time.perf_counter()
            result.ttft.append((first or end) - start)
            if first is not None and count > 1:
                result.tpot.append((end - first) / (count - 1))
            result.tokens += count

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    result.seconds = time.perf_counter() - start
    await client.close()
    return result


def run_serve_benchmark(
    model: Any,
    tokenizer: Any,
    clients: tuple[int, ...] = (1, 4, 16),
    per_client: int = 4,
    max_tokens: int = 64,
    systems: tuple[str, ...] = ("transformers", "hfaccel"),
) -> list[ServeResult]:
    """Save `model` to a folder, serve it with each system in turn, and drive each concurrency."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    # Both servers load the saved folder on their default device (CUDA when there is one).
    gpu = f"; GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    print(
        f"bench serve: {cpu_description()}{gpu}; {dtype}; {per_client} requests per client, "
        f"max_tokens={max_tokens}"
    )
    folder = tempfile.mkdtemp(prefix="hfaccel-serve-bench-")
    results: list[ServeResult] = []
    try:
        save_plain(model, tokenizer, folder)
        for system in systems:
            port = free_port()
            log = open(os.path.join(folder, f"{system}.log"), "w")  # noqa: SIM115 - closed below
            command = server_command(system, folder, port, dtype)
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                wait_healthy(port, process)
                for count in clients:  # warm-up: the first steps, and each batch size's compile
                    asyncio.run(drive(port, folder, count, 1, 16, system))
                for count in clients:
                    result = asyncio.run(drive(port, folder, count, per_client, max_tokens, system))
                    results.append(result)
                    print(_line(result), flush=True)
            except Exception:
                log.flush()
                with open(log.name) as written:  # what the server said before it failed
                    print(f"  {system} server log (last lines):", *written.readlines()[-15:], sep="\n    ")
                raise
            finally:
                process.terminate()
                process.wait(60)
                log.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _print_ratios(results)
    return results


def save_plain(model: Any, tokenizer: Any, folder: str) -> None:
    """Save the model as plain safetensors (the embedded SmolLM2 comes from a GGUF file, which
    transformers does not save back)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _line(result: ServeResult) -> str:
    def ms(values: list[float], q: float) -> str:
        value = percentile(values, q)
        return "-" if value is None else f"{value * 1000:.0f}"

    errors = f"  errors {len(result.errors)} ({result.errors[0][:80]})" if result.errors else ""
    return (
        f"  {result.system:<12} clients {result.clients:>3}: {result.requests_per_s:6.2f} req/s, "
        f"{result.tokens / result.seconds:7.1f} tok/s, TTFT p50 {ms(result.ttft, 50)} p99 {ms(result.ttft, 99)} ms, "
        f"TPOT p50 {ms(result.tpot, 50)} p99 {ms(result.tpot, 99)} ms{errors}"
    )


def _print_ratios(results: list[ServeResult]) -> None:
    by = {(r.system, r.clients): r for r in results}
    for (system, clients), ours in by.items():
        theirs = by.get(("transformers", clients))
        if system != "hfaccel" or theirs is None or not theirs.requests_per_s:
            continue
        ttft = percentile(ours.ttft, 99), percentile(theirs.ttft, 99)
        p99 = f", p99 TTFT {ttft[0] / ttft[1]:.2f}x theirs" if ttft[0] and ttft[1] else ""
        speed = ours.requests_per_s / theirs.requests_per_s
        print(f"  hfaccel / transformers at {clients} clients: {speed:.2f}x req/s{p99}")
