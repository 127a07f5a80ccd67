"""The family matrix (bench/families.py): every decoder-only family transformers ships is served with
HF's greedy tokens or refused at `patch` with its reason; none is silently wrong or crashes."""

from __future__ import annotations

from transformers import DynamicCache

from hfaccel.bench.families import FAMILIES, run_families, table
from hfaccel.patches.models import CHECKED_MODEL_TYPES


def test_every_family_is_served_exactly_or_refused_with_its_reason(capsys):
    rows = run_families()
    assert [r.model_type for r in rows] == list(FAMILIES)
    wrong = [r for r in rows if r.status == "served" and r.equal != r.prompts]
    errors = [r for r in rows if r.status == "error"]
    assert not wrong and not errors, (wrong, errors)
    assert all(r.detail for r in rows if r.status == "refused")  # each refusal says why
    served = {r.model_type for r in rows if r.status == "served"}
    # windows, chunks, soft-capping, sinks and latent attention among them
    assert {"mistral", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "deepseek_v3"} <= served
    assert {"minimax", "zamba2", "falcon", "bloom"}.isdisjoint(served)
    if hasattr(
        DynamicCache, "get_conv_state"
    ):  # recurrent layers too, through transformers' state API (5.2x)
        assert {
            "jamba",
            "qwen3_next",
            "lfm2",
            "falcon_h1",
            "bamba",
            "mamba",
            "mamba2",
            "falcon_mamba",
        } <= served
        assert len(served) >= 42
        # `patch` warns for a family outside this set: it must be exactly what the matrix checks
        assert served == CHECKED_MODEL_TYPES
    else:
        assert len(served) >= 29 and served <= CHECKED_MODEL_TYPES
    assert "| llama | served | 5/5 prompts |" in table(rows)
