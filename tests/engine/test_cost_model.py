"""The step-time model: exact non-negative least squares, recovery of known coefficients from noisy
synthetic steps, sliding windows, and a reasonable fit on a real run."""

import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hfaccel import EngineConfig
from hfaccel.engine.cost_model import StepCostModel, nnls
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams

TRUE = (0.020, 0.0015, 0.0004, 2e-6)  # 20 ms + 1.5 ms/decode + 0.4 ms/prefill token + 2 us/KV token


def synthetic_steps(model, count, noise, seed=0, coefficients=TRUE):
    rng = random.Random(seed)
    c0, c1, c2, c3 = coefficients
    for _ in range(count):
        decodes = rng.randint(0, 48)
        prefill = rng.choice([0, 0, rng.randint(1, 512)])
        kv = decodes * rng.randint(20, 600) + prefill + rng.randint(0, 200)
        seconds = (c0 + c1 * decodes + c2 * prefill + c3 * kv) * (1 + rng.gauss(0, noise))
        model.observe(decodes, prefill, kv, seconds)


def test_known_coefficients_are_recovered_from_noisy_steps():
    model = StepCostModel(window=400)
    synthetic_steps(model, 800, noise=0.03)
    fit = model.fit(force=True)
    for got, want in zip(fit.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.15)
    assert fit.r2 > 0.95 and model.num_samples > 600  # two windows of at most 400
    # The line is fitted to the steps of more than one row (one-row steps are the table's).
    assert fit.num_samples == sum(1 for d, p, _, _ in model.samples() if d + p > 1)
    assert model.predict(10, 100, 3000) == pytest.approx(fit.predict(10, 100, 3000))


def test_a_stalled_step_does_not_move_the_model():
    model = StepCostModel()
    synthetic_steps(model, 200, noise=0.02)
    for _ in range(6):  # another process took the core for half a second
        model.observe(8, 0, 2000, 0.5)
    fit = model.fit(force=True)
    assert fit.num_outliers >= 6
    assert fit.bias_s == pytest.approx(6 * 0.45 / 206, rel=0.3)  # the stalls still count in the mean
    for got, want in zip(fit.coefficients, TRUE):
        assert got == pytest.approx(want, rel=0.2)


def test_coefficients_are_never_negative():
    model = StepCostModel()
    synthetic_steps(model, 300, noise=0.02, coefficients=(0.02, 0.001, 0.0003, -5e-6))
    fit = model.fit(force=True)
    assert all(c >= 0 for c in fit.coefficients)


def test_nnls_is_exact_on_the_active_set():
    rng = np.random.default_rng(0)
    x = rng.random((50, 4))
    y = x @ np.array([1.0, 0.0, 2.0, 0.5])
    assert np.allclose(nnls(x, y), [1.0, 0.0, 2.0, 0.5], atol=1e-9)


def test_a_long_decode_stretch_keeps_what_was_learnt_about_prefill():
    model = StepCostModel(window=64)
    synthetic_steps(model, 200, noise=0.01)
    c2 = model.fit(force=True).coefficients[2]
    rng = random.Random(1)
    for _ in range(500):  # only decodes now: the prefill window keeps its samples
        d = rng.randint(1, 40)
        model.observe(d, 0, d * 300, TRUE[0] + TRUE[1] * d + TRUE[3] * d * 300)
    assert model.fit(force=True).coefficients[2] == pytest.approx(c2, rel=0.2)


def test_nothing_is_predicted_before_enough_steps():
    model = StepCostModel(min_samples=12)
    synthetic_steps(model, 11, noise=0.0)
    assert model.predict(1, 0, 10) is None and model.fit() is None and "warming up" in repr(model)
    synthetic_steps(model, 1, noise=0.0)
    assert model.predict(1, 0, 10) is not None and "R2=" in repr(model)


def test_a_real_run_fits_its_own_steps():
    """A short run of a small model whose prompt tokens cost enough to stand above the noise of a shared
    machine (one torch thread: fewer stalls at thread barriers when other processes hold the cores)."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine(
            model, EngineConfig(block_size=16, kv_cache_memory=32_000_000, max_num_batched_tokens=512)
        )
        rng = random.Random(0)
        requests = [
            engine.make_request(
                [rng.randrange(3, 250) for _ in range(rng.choice([2, 40, 300, 600]))],
                StoppingParams(max_new_tokens=rng.randint(4, 24)),
            )
            for _ in range(32)
        ]
        engine.run(requests)
    finally:
        torch.set_num_threads(threads)
    cost = engine.cost_model()
    fit = cost.fit(force=True)
    assert fit is not None and cost.num_samples == engine.num_steps - 1
    assert fit.coefficients[2] > 0  # prompt tokens cost something
    assert fit.r2 > 0.6, cost
    stats = engine.step_stats[-1]
    assert stats.num_kv_tokens >= stats.num_seqs and 0 < stats.run_s <= stats.duration_s
    parts = stats.schedule_s + stats.pack_s + stats.run_s + stats.sample_s + stats.update_s
    assert parts == pytest.approx(stats.duration_s, rel=1e-6)
