"""A step-time model learned online from the engine's own steps.

    step time ~= c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * kv_tokens

`c0` is the fixed cost of a step (the model's per-layer Python and kernel launches, the host's share),
`c1` what each decoding sequence adds (its LM-head row, its share of the weight reads), `c2` what each
prefill token adds (the matmuls), `c3` what each token of context attended to adds (the KV reads). The
coefficients are fitted by non-negative least squares over a sliding window of recent steps and refitted
every few steps, so the model follows the machine (another job taking cores, a warmed-up compile). Two
windows are kept, steps with prefill tokens and pure-decode steps, so a long stretch of one kind never
erases what was learnt about the other.

On a CPU a one-row step is a matrix-vector product, far cheaper per row than the matrix products of
every larger step (SmolLM2 float32 on 2 AVX2 cores, 2026-11-26: 85 ms for one sequence, 140-180 ms for
2 to 7), and a line through both prices each added sequence at the one-to-two jump, so a batch never
grows under a target. So the line is fitted to the steps of more than one row once there are enough of
them, and pure-decode steps are also kept in a table by batch size: `predict_decode` answers a batch
size seen often enough from its own recent steps, any other from the line. A line fitted before any
step of several rows knows nothing of what a row costs; the scheduler's batch check therefore grows
the batch to at most twice the largest size seen (`largest_decode_seen`), so each doubling is measured
before the next.

The scheduler asks it what a candidate step would cost (`predict`, `predict_decode`) to keep each step
under the TPOT target; `python -m hfaccel bench goodput` and `hfaccel.plot_cost_model` show how well it
fits.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

FEATURES = ("decode_seqs", "prefill_tokens", "kv_tokens")
# Pure-decode steps kept per batch size, and how many a size needs before its own median is used.
TABLE_WINDOW = 32
TABLE_MIN_SAMPLES = 4


@dataclass(frozen=True)
class CostFit:
    """One fit: coefficients in seconds (intercept, per decoding sequence, per prefill token, per KV token)."""

    coefficients: tuple[float, float, float, float]
    num_samples: int
    r2: float  # coefficient of determination on the inliers (1: perfect, 0: no better than the mean)
    rmse_s: float  # root mean squared error on the inliers, seconds
    num_outliers: int = 0  # steps left out of the final fit (a step stalled by another process, say)
    # Mean excess of every windowed step (outliers included) over the robust fit: stalls are rare but
    # they count in a mean time per output token, so predictions add it back (0 on a quiet machine).
    bias_s: float = 0.0

    def predict(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float:
        c0, c1, c2, c3 = self.coefficients
        return self.bias_s + c0 + c1 * decode_seqs + c2 * prefill_tokens + c3 * kv_tokens

    def as_dict(self) -> dict[str, float]:
        c0, c1, c2, c3 = self.coefficients
        return {
            "intercept_s": c0,
            "per_decode_seq_s": c1,
            "per_prefill_token_s": c2,
            "per_kv_token_s": c3,
            "num_samples": self.num_samples,
            "r2": self.r2,
            "rmse_s": self.rmse_s,
            "num_outliers": self.num_outliers,
            "bias_s": self.bias_s,
        }


def nnls(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best of the unconstrained least-squares
    solutions on every subset of columns whose coefficients are all >= 0 (exact: the NNLS optimum is the
    least-squares solution on its own support). Columns are scaled first for conditioning."""
    n, k = features.shape
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    scaled = features / scale
    best, best_error = np.zeros(k), float(np.sum(target**2))
    for size in range(1, k + 1):
        for subset in itertools.combinations(range(k), size):
            columns = list(subset)
            solution, *_ = np.linalg.lstsq(scaled[:, columns], target, rcond=None)
            if np.any(solution < 0):
                continue
            error = float(np.sum((scaled[:, columns] @ solution - target) ** 2))
            if error < best_error - 1e-18:
                best = np.zeros(k)
                best[columns] = solution
                best_error = error
    return best / scale


class StepCostModel:
    """Fits step time on the engine's recent steps (see the module docstring).

    `observe` records one step; the fit is redone at most every `refit_every` new steps, on demand.
    `predict` returns None until `min_samples` steps have been seen: the scheduler then applies no
    time-based limit.
    """

    def __init__(self, window: int = 256, min_samples: int = 12, refit_every: int = 8) -> None:
        self.window = window
        self.min_samples = min_samples
        self.refit_every = refit_every
        self._prefill: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._decode: deque[tuple[float, float, float, float]] = deque(maxlen=window)
        self._fit: CostFit | None = None
        self._since_fit = 0
        self.num_observed = 0
        self._decode_table: dict[int, deque[tuple[float, float]]] = {}  # seqs -> (kv_tokens, seconds)

    def observe(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float, seconds: float) -> None:
        sample = (float(decode_seqs), float(prefill_tokens), float(kv_tokens), float(seconds))
        (self._prefill if prefill_tokens else self._decode).append(sample)
        if not prefill_tokens and decode_seqs >= 1:
            rows = self._decode_table.setdefault(int(decode_seqs), deque(maxlen=TABLE_WINDOW))
            rows.append((float(kv_tokens), float(seconds)))
        self._since_fit += 1
        self.num_observed += 1

    def observe_step(self, stats: Any) -> None:
        """Record an engine `StepStats`."""
        self.observe(stats.num_decode_tokens, stats.num_prefill_tokens, stats.num_kv_tokens, stats.duration_s)

    @property
    def num_samples(self) -> int:
        return len(self._prefill) + len(self._decode)

    @property
    def ready(self) -> bool:
        return self.num_samples >= self.min_samples

    def fit(self, force: bool = False) -> CostFit | None:
        """The current fit (refitted if `refit_every` steps arrived since the last one, or `force`)."""
        if not self.ready:
            return None
        if self._fit is None or force or self._since_fit >= self.refit_every:
            self._fit = self._refit()
            self._since_fit = 0
        return self._fit

    def _refit(self) -> CostFit:
        """NNLS, then once more without the outliers: steps whose residual is more than 4 robust standard
        deviations (1.4826 x the median absolute residual) from the fit. On a shared machine a step now
        and then stalls for a time slice of another process; one such step must not move the model."""
        data = np.array([*self._prefill, *self._decode], dtype=np.float64)
        multi_row = data[:, 0] + data[:, 1] > 1
        if multi_row.sum() >= self.min_samples:  # the line leaves one-row steps to the table
            data = data[multi_row]
        features = np.column_stack([np.ones(len(data)), data[:, :3]])
        target = data[:, 3]
        all_features, all_target = features, target
        coefficients = nnls(features, target)
        residual = target - features @ coefficients
        spread = 1.4826 * float(np.median(np.abs(residual)))
        keep = np.abs(residual) <= 4 * spread if spread > 0 else np.ones(len(data), dtype=bool)
        if keep.sum() >= max(4, len(data) // 2) and not keep.all():
            features, target = features[keep], target[keep]
            coefficients = nnls(features, target)
            residual = target - features @ coefficients
        total = float(np.sum((target - target.mean()) ** 2))
        r2 = 1.0 - float(np.sum(residual**2)) / total if total > 0 else 1.0
        rmse = float(np.sqrt(np.mean(residual**2)))
        bias = max(0.0, float(np.mean(all_target - all_features @ coefficients)))
        c0, c1, c2, c3 = (float(c) for c in coefficients)
        return CostFit((c0, c1, c2, c3), len(data), r2, rmse, len(data) - len(target), bias)

    def predict(self, decode_seqs: float, prefill_tokens: float, kv_tokens: float) -> float | None:
        """Predicted seconds of a step, or None before the model has seen enough steps."""
        fit = self.fit()
        return None if fit is None else fit.predict(decode_seqs, prefill_tokens, kv_tokens)

    def predict_decode(self, decode_seqs: int, kv_tokens: float) -> float | None:
        """Predicted seconds of a pure-decode step of `decode_seqs` sequences over `kv_tokens` of
        context: the median of that batch size's recent steps (moved by the line's price of the context
        difference) once it has `TABLE_MIN_SAMPLES`, else the line's. None before the model is ready."""
        fit = self.fit()
        if fit is None:
            return None
        rows = self._decode_table.get(int(decode_seqs))
        if rows is None or len(rows) < TABLE_MIN_SAMPLES:
            return fit.predict(decode_seqs, 0, kv_tokens)
        kv = float(np.median([k for k, _ in rows]))
        return float(np.median([t for _, t in rows])) + fit.coefficients[3] * (kv_tokens - kv)

    @property
    def largest_decode_seen(self) -> int:
        """The largest batch size of a pure-decode step in the table (0 before any)."""
        return max(self._decode_table, default=0)

    def decode_table(self) -> dict[int, float]:
        """Median seconds of the recent pure-decode steps by batch size (sizes with enough steps)."""
        return {
            n: float(np.median([t for _, t in rows]))
            for n, rows in sorted(self._decode_table.items())
            if len(rows) >= TABLE_MIN_SAMPLES
        }

    @property
    def coefficients(self) -> dict[str, float] | None:
        fit = self.fit()
        return None if fit is None else fit.as_dict()

    def samples(self) -> list[tuple[float, float, float, float]]:
        """The windowed samples (decode_seqs, prefill_tokens, kv_tokens, seconds), prefill steps first."""
        return [*self._prefill, *self._decode]

    def __repr__(self) -> str:
        fit = self.fit()
        if fit is None:
            return f"StepCostModel(warming up: {self.num_samples}/{self.min_samples} steps)"
        c0, c1, c2, c3 = fit.coefficients
        return (
            f"StepCostModel({(c0 + fit.bias_s) * 1e3:.2f} ms + {c1 * 1e3:.3f} ms/decode "
            f"+ {c2 * 1e3:.4f} ms/prefill token + {c3 * 1e6:.3f} us/KV token; R2={fit.r2:.3f}, {fit.num_samples} steps)"
        )


class RatioCalibration:
    """Online correction of an estimate by the ratio observed / predicted of its recent outcomes.

    The scheduler's TTFT estimate (`Scheduler.estimate_ttft`) is built from the step-time model and a
    picture of the queue (how many steps until a seat is free, how many prompt tokens each step takes);
    that picture is an approximation, and on a shared machine it can be off by a factor. Each request
    that was estimated at arrival and later produced its first token adds its ratio; a request that
    waited past its deadline without starting adds the lower bound it proved (it would have taken at
    least that long). `factor` is the `quantile` of the last `window` ratios (1.0 until `min_samples`
    have been seen), kept within `bounds`; the scheduler multiplies the time still ahead by it.
    """

    def __init__(
        self,
        window: int = 32,
        min_samples: int = 4,
        quantile: float = 0.5,
        bounds: tuple[float, float] = (0.05, 20.0),
    ) -> None:
        self.window = window
        self.min_samples = min_samples
        self.quantile = quantile
        self.bounds = bounds
        self._ratios: deque[float] = deque(maxlen=window)
        self.num_observed = 0

    def observe(self, predicted_s: float, observed_s: float) -> None:
        if predicted_s <= 0 or observed_s < 0:
            return
        self._ratios.append(observed_s / predicted_s)
        self.num_observed += 1

    @property
    def factor(self) -> float:
        if len(self._ratios) < self.min_samples:
            return 1.0
        ordered = sorted(self._ratios)
        value = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        low, high = self.bounds
        return min(high, max(low, value))

    def ratios(self) -> list[float]:
        return list(self._ratios)

    def __repr__(self) -> str:
        return f"RatioCalibration(factor={self.factor:.3f}, {len(self._ratios)} of the last {self.window})"
