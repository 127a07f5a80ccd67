"""`bench quant`'s quality measures: agreement up to the first difference, and perplexity."""

from __future__ import annotations

import math

import torch

from hfaccel.bench.quant import _agreement, torch_perplexity
from tests.helpers import tiny_model


def test_agreement_is_the_share_before_the_first_difference():
    reference = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert _agreement(reference, reference) == 1.0
    assert _agreement([[1, 2, 9, 4], [0, 6, 7, 8]], reference) == (0.5 + 0.0) / 2


def test_perplexity_is_the_exp_of_the_mean_next_token_loss():
    model = tiny_model()
    ids = [3, 17, 42, 8, 99, 5]
    logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = -torch.log_softmax(logits, -1)[torch.arange(5), torch.tensor(ids[1:])].mean()
    assert math.isclose(torch_perplexity(model, ids), math.exp(nll.item()), rel_tol=1e-5)


def test_engine_perplexity_equals_the_models_own_with_a_float_cache_and_sees_an_int8_one():
    """Through the engine (chunks of 4 over the paged cache, every position's logits): a float32 cache
    gives the model's own perplexity, an int8 cache a slightly different one (its K/V are rounded)."""
    from hfaccel.bench.quant import engine_perplexity

    model = tiny_model()
    ids = torch.randint(3, 90, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    exact = torch_perplexity(model, ids)
    assert math.isclose(engine_perplexity(model, ids, "float32", chunk=4), exact, rel_tol=1e-5)
    int8 = engine_perplexity(model, ids, "int8", chunk=4)
    assert int8 != exact and math.isclose(int8, exact, rel_tol=0.02)
