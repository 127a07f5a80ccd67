"""The family matrix (bench/families.py): every decoder-only family transformers ships is served with
HF's greedy tokens or refused at `patch` with its reason; none is silently wrong or crashes."""

from __future__ import annotations

from hfaccel.bench.families import FAMILIES, run_families, table


def test_every_family_is_served_exactly_or_refused_with_its_reason(capsys):
    rows = run_families()
    assert [r.model_type for r in rows] == list(FAMILIES)
    wrong = [r for r in rows if r.status == "served" and r.equal != r.prompts]
    errors = [r for r in rows if r.status == "error"]
    assert not wrong and not errors, (wrong, errors)
    assert all(r.detail for r in rows if r.status == "refused")  # each refusal says why
    served = {r.model_type for r in rows if r.status == "served"}
    assert len(served) >= 29  # 30 on transformers 5.24 (GPT-J routes attention through the interface there)
    # windows, chunks, soft-capping, sinks and latent attention among them; recurrent layers refused
    assert {"mistral", "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "deepseek_v3"} <= served
    assert {"jamba", "mamba2", "falcon", "bloom"}.isdisjoint(served)
    assert "| llama | served | 5/5 prompts |" in table(rows)
