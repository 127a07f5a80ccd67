"""`python -m hfaccel doctor`: what this machine can run, and a correctness check of every backend.

For each attention backend: can it run here (and if not, why), then random paged cases (decode,
prefill with a cached prefix, a mixed step, a padded step) against the torch reference, and a 16-token
greedy generate on a tiny random Llama compared with the torch backend's tokens. On a CPU, Triton runs
under its interpreter (correct, slow: a check, not a speed), and FlashInfer is skipped with its reason.
"""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "triton", "flashinfer")


@dataclass
class BackendReport:
    """One backend's line in the doctor's table."""

    name: str
    status: str  # "ok", "FAIL", "skipped"
    kernel_error: float | None = None
    generate_match: bool | None = None
    detail: str = ""


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """Versions and devices, as plain strings."""
    from hfaccel.kernels.cpu_features import cpu_isa, fast_dtype

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"),
        "device": torch.cuda.get_device_name() if cuda else "cpu (no CUDA device)",
        "cuda": torch.version.cuda or "none",
        "cpu isa": cpu_isa(),
        # What patch(model, weights="auto") casts a float32 model to on this machine's first device.
        "fast dtype": str(fast_dtype("cuda" if cuda else "cpu")).removeprefix("torch."),
    }


def _random_case(device: torch.device, dtype: torch.dtype, seqs: list[tuple[int, int]], pad: int, seed: int):
    """A paged step of `seqs` (cached context, new tokens) with random blocks; inputs for `forward`."""
    from hfaccel.kernels.metadata import StepLayout

    g = torch.Generator().manual_seed(seed)
    block, hq, hkv, d, num_blocks = 16, 8, 2, 64, 64
    free = torch.randperm(num_blocks, generator=g).tolist()
    seqs = sorted(seqs, key=lambda s: s[1] != 1)
    tables, slots, qlens, lens = [], [], [], []
    for before, new in seqs:
        total = before + new
        blocks = [free.pop() for _ in range(-(-total // block))]
        tables.append(blocks)
        slots += [blocks[p // block] * block + p % block for p in range(before, total)]
        qlens.append(new)
        lens.append(total)
    layout = StepLayout(qlens, lens, tables, slots, sum(1 for q in qlens if q == 1))
    k_ctx = torch.randn(num_blocks, block, hkv, d, generator=g).to(dtype)
    v_ctx = torch.randn(num_blocks, block, hkv, d, generator=g).to(dtype)
    t = len(slots) + pad
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    to = {"device": device}
    return layout, q.to(**to), k.to(**to), v.to(**to), k_ctx.to(**to), v_ctx.to(**to), num_blocks, pad


def _run_case(backend, case, pad_seqs: int) -> torch.Tensor:
    layout, q, k, v, k_ctx, v_ctx, num_blocks, pad = case
    shape = backend.kv_cache_shape(num_blocks, 16, 2, 64)
    k_cache = torch.zeros(shape, dtype=k_ctx.dtype, device=k_ctx.device)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:num_blocks] = k_ctx
    v_cache[:num_blocks] = v_ctx
    builder = backend.make_builder(16, 256, 8, 16, q.device, num_blocks=num_blocks)
    configure = getattr(builder, "configure", None)
    if configure is not None:
        configure(8, 2, 64, k_ctx.dtype, 64**-0.5)
    b = layout.num_seqs
    meta = builder.build(layout, b + pad_seqs if pad else None, layout.num_tokens + pad if pad else None)
    out = backend.forward(q, k, v, (k_cache, v_cache), meta, 64**-0.5)
    return out[: layout.num_tokens].float()


def kernel_error(name: str, device: torch.device, dtype: torch.dtype) -> float:
    """Largest absolute difference from the torch backend over the random paged cases."""
    from hfaccel.kernels import get_backend

    reference, backend = get_backend("torch", device, dtype, 64), get_backend(name, device, dtype, 64)
    cases = [
        ([(17, 1), (40, 1), (0, 1)], 0),  # decodes
        ([(0, 37), (20, 13)], 0),  # a prompt, and a chunk continuing a cached prefix
        ([(5, 1), (0, 21), (33, 1), (16, 9)], 0),  # mixed
        ([(9, 1), (31, 1)], 2),  # a decode step padded to a bucket of 4
    ]
    worst = 0.0
    for seed, (seqs, pad) in enumerate(cases):
        case = _random_case(device, dtype, seqs, pad, seed)
        ours = _run_case(backend, case, pad)
        ref = _run_case(reference, case, pad)
        worst = max(worst, float((ours - ref).abs().max()))
    return worst


def generate_matches(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """A 16-token greedy generate on a tiny random Llama: `name`'s tokens equal the torch backend's
    (the torch backend's equal unpatched HF ``generate``'s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import hfaccel

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(device=device, dtype=dtype)
    prompts = [[5, 9, 14, 3], list(range(10, 60)), [7]]
    runs = []
    if name == "torch":
        with torch.inference_mode():
            runs.append(
                [
                    model.generate(
                        torch.tensor([p], device=device),
                        max_new_tokens=16,
                        do_sample=False,
                        min_new_tokens=16,
                    )[0, len(p) :].tolist()
                    for p in prompts
                ]
            )
    for backend in {"torch", name}:
        hfaccel.patch(model, backend=backend, kv_cache_memory=32 * 2**20)
        completions = hfaccel.generate(model, prompts, max_new_tokens=16, min_new_tokens=16, progress=False)
        runs.append([c.token_ids for c in completions])
        hfaccel.unpatch(model)
    reference, ours = runs
    return all(
        first_difference_is_a_near_tie(model, prompt, mine, theirs, TOLERANCE[dtype])
        for prompt, mine, theirs in zip(prompts, ours, reference)
    )


TOLERANCE = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def first_difference_is_a_near_tie(
    model, prompt: list[int], ours: list[int], ref: list[int], gap: float
) -> bool:
    """Whether greedy tokens `ours` agree with `ref`: equal, or first different where the model's own top
    two logits (eager HF forward on the reference's prefix) lie within `gap`, which a kernel's rounding
    may flip (a random tiny model's logits are close together, in float16 above all)."""
    if ours == ref:
        return True
    at = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    if at is None:  # one is a prefix of the other: a length differs
        return False
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + ref[:at]], device=device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1]) <= gap


def check_backend(name: str, device: torch.device) -> BackendReport:
    """Availability, kernel error and generate parity of one backend on `device`."""
    from hfaccel.kernels import unavailable_reason

    dtype = torch.float32 if device.type == "cpu" else torch.float16
    reason = unavailable_reason(name, device, dtype, 64)
    if reason is not None:
        return BackendReport(name, "skipped", detail=reason)
    try:
        error = kernel_error(name, device, dtype)
        match = generate_matches(name, device, dtype)
    except Exception as exc:  # report, don't crash: the doctor's job is to say what is wrong
        return BackendReport(name, "FAIL", detail=f"{type(exc).__name__}: {exc}")
    ok = error <= TOLERANCE[dtype] and match
    detail = {"torch": "the reference (greedy compared with unpatched HF generate)"}.get(name, "")
    if name == "triton" and device.type == "cpu":
        detail = "under the interpreter: a correctness check, not a speed"
    return BackendReport(name, "ok" if ok else "FAIL", error, match, detail)


def auto_limits_line(device: torch.device) -> str:
    """What ``max_num_seqs`` / ``max_num_batched_tokens`` left as None (auto) resolve to here, for the
    default model (SmolLM2-135M: 30 layers, 3 KV heads of 64) with the default ``kv_cache_memory``."""
    from hfaccel.config import EngineConfig
    from hfaccel.engine.limits import free_memory_bytes, resolve_limits

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    per_token = 2 * 30 * 3 * 64 * torch.empty((), dtype=dtype).element_size()
    fraction = EngineConfig().kv_cache_memory
    limits = resolve_limits(
        None,
        None,
        kv_budget_bytes=int(fraction * free_memory_bytes(device)),
        kv_bytes_per_token=per_token,
        max_model_len=8192,
        device=device,
        block_size=EngineConfig().block_size,
    )
    name = str(dtype).removeprefix("torch.")
    return f"auto batch limits (SmolLM2-135M, {name}): {limits.describe()} [{limits.reason}]"


def run_doctor() -> list[BackendReport]:
    """Print the environment and the backend table; return the reports."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print("hfaccel doctor")
    for key, value in environment().items():
        print(f"  {key:<13} {value}")
    reports = [check_backend(name, device) for name in BACKENDS]
    print(f"\n  {'backend':<11} {'status':<8} {'max |err| vs torch':>18} {'greedy == ref':>15}  notes")
    for r in reports:
        err = "-" if r.kernel_error is None else f"{r.kernel_error:.1e}"
        match = "-" if r.generate_match is None else ("yes" if r.generate_match else "NO")
        print(f"  {r.name:<11} {r.status:<8} {err:>18} {match:>15}  {r.detail}")
    from hfaccel.kernels import get_backend

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    print(f"\n  backend='auto' picks: {get_backend('auto', device, dtype, 64).name} on {device.type}")
    print(f"  {auto_limits_line(device)}")
    return reports
