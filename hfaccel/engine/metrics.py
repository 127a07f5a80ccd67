"""Per-step records and summaries, as plain data."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepStats:
    """What one engine step did."""

    step: int
    start_s: float  # time.perf_counter() when the step began
    duration_s: float
    num_seqs: int
    num_decode_tokens: int
    num_prefill_tokens: int
    kv_blocks_used: int
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache by this step's admissions
    num_preemptions: int  # requests preempted while scheduling this step

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0-100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(values: Iterable[float]) -> dict[str, float | None]:
    """Mean, median, p90 and p99 of `values`."""
    data = list(values)
    return {
        "mean": sum(data) / len(data) if data else None,
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
    }
