"""Per-step records and summaries, as plain data."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)  # 100,000 kept per engine: 20 MB, 46 MB with a __dict__ each
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
    # What the step-time model (`engine/cost_model.py`) regresses on, and where the host's time went.
    num_kv_tokens: int = 0  # KV tokens attended to: the sum of the step's context lengths
    num_waiting: int = 0  # requests waiting (not admitted) when the step began: the queue depth
    schedule_s: float = 0.0  # Scheduler.schedule
    pack_s: float = 0.0  # pack_step: host lists of ids, positions, slots
    run_s: float = 0.0  # ModelRunner.run: buffers, metadata, the forward
    sample_s: float = 0.0  # sampling (and verifying drafts)
    update_s: float = 0.0  # Scheduler.update, drafting, bookkeeping
    overlapped_s: float = 0.0  # host work done while the forward ran (asynchronous scheduling)
    # Blocks in use in the sliding layers' own pool (`window_blocks`: a model with full and sliding
    # layers); `kv_blocks_used` counts the full layers' pool then.
    kv_window_blocks_used: int = 0

    @property
    def num_decode_seqs(self) -> int:
        """Sequences decoding one token (the decode path of the step)."""
        return self.num_decode_tokens

    @property
    def host_s(self) -> float:
        """The step's time outside the model forward (scheduling, packing, sampling, bookkeeping)."""
        return max(0.0, self.duration_s - self.run_s)

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
