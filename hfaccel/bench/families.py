"""The family matrix (`python -m hfaccel bench coverage --families`): one row per decoder-only family
transformers ships, from a tiny random config (transformers' model testers' sizes: hidden 64, 4
layers, 4 query / 2 KV heads, vocabulary 256), with weights large enough that every layer moves the
argmax (N(0, 0.08); attention sinks N(0, 2)). Each row: refused at `patch` (with the reason), or served,
with how many of its prompts gave HF's greedy tokens. Windows and chunks are 8 positions and prompts up
to 40 tokens, with chunked prefill (16 tokens a step), so sequences outgrow them."""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

SMALL = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "sliding_window": 8,
    "attention_chunk_size": 8,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Multi-head latent attention (DeepSeek-V2/V3): keys of 16 + 8 (rotary) dims, values of 16, K and V expanded
# to every head as in the real models (transformers' eager attention repeats them otherwise), MoE.
_LATENT = {
    "num_key_value_heads": 4,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
}
# Each family's own names and needs beyond SMALL (a family takes the SMALL keys its config has).
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"use_sliding_window": True, "layer_types": ["full_attention"] + ["sliding_attention"] * 3},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"attn_logit_softcapping": 0.3},
    "gemma3_text": {},
    "phi": {},
    "phi3": {},
    "olmo": {},
    "olmo2": {},
    "granite": {},
    "cohere": {},
    "cohere2": {},
    "starcoder2": {},
    "stablelm": {},
    "gpt2": {"n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 512},
    "gpt_neox": {},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 64},
    "mixtral": {"num_local_experts": 4},
    "qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    # its config keeps no window unless use_sliding_window (set after init here, so said again)
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "sliding_window": None,
    },
    "glm4": {},
    "smollm3": {},
    "exaone4": {},
    "gpt_oss": {"num_local_experts": 4},
    "llama4_text": {"num_local_experts": 2, "intermediate_size_mlp": 64},
    "jamba": {"num_experts": 2, "attn_layer_period": 2, "attn_layer_offset": 1},
    "qwen3_next": {
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "num_experts_per_tok": 2,
        "shared_expert_intermediate_size": 32,
        "linear_conv_kernel_dim": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
    },
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "full_attention"]},
    "falcon_h1": {
        "mamba_d_head": 16,
        "mamba_n_heads": 8,
        "mamba_d_ssm": 128,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    "minimax": {"num_local_experts": 2},
    "bamba": {
        "attn_layer_indices": [1, 3],
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    "granitemoehybrid": {
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_local_experts": 4,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "mamba_chunk_size": 16,
    },
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp"],
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 16,
        "n_routed_experts": 4,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 32,
    },
    "kimi_linear": {
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
        "linear_head_dim": 16,
        "linear_num_heads": 4,
        "num_experts": 4,
        "num_experts_per_token": 2,
        "moe_intermediate_size": 32,
        "num_key_value_heads": 4,
    },
    "zamba2": {
        "layers_block_type": ["linear_attention", "hybrid", "linear_attention", "hybrid"],
        "hybrid_layer_ids": [1, 3],
        "attention_hidden_size": 128,  # derived at init from the default hidden size: set again
        "attention_head_dim": 32,
        "n_mamba_heads": 8,
        "mamba_headdim": 16,
        "mamba_d_state": 16,
        "chunk_size": 16,
    },
    "olmo_hybrid": {},
    "mamba": {},
    "falcon_mamba": {},
    "mamba2": {"num_heads": 4, "head_dim": 32, "n_groups": 1, "state_size": 16},
    "deepseek_v3": {**_LATENT, "n_group": 1, "topk_group": 1},
    "deepseek_v2": _LATENT,
    "gptj": {"n_embd": 64, "n_layer": 4, "n_head": 4, "rotary_dim": 8, "n_positions": 512},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
    "bloom": {"n_layer": 4, "n_head": 4},
}
PROMPT_LENGTHS = (3, 9, 17, 26, 40)
NEW_TOKENS = 12


@dataclass
class FamilyRow:
    model_type: str
    status: str  # "served", "refused", or "error" (the tiny model could not be built or run)
    detail: str = ""
    equal: int = 0
    prompts: int = 0


def family_model(model_type: str, **changes: Any) -> Any:
    """A tiny random model of `model_type`: its default config with SMALL's values where it has them, its
    `FAMILIES` entry, and `changes` on top (a value of None unsets a SMALL one)."""
    import transformers

    extra = {**FAMILIES.get(model_type, {}), **changes}
    config = transformers.AutoConfig.for_model(model_type)
    for key, value in {**SMALL, **extra}.items():
        if key in extra or hasattr(config, key):
            with contextlib.suppress(AttributeError, ValueError):  # a derived property
                setattr(config, key, value)
    torch.manual_seed(0)
    # transformers' eager attention: its reference (sdpa ignores Gemma 2's soft-capping on 5.17)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.08)
            if name.endswith(".sinks"):
                parameter.normal_(0.0, 2.0)
    return model


def run_family(model_type: str) -> FamilyRow:
    import hfaccel

    try:
        model = family_model(model_type)
    except Exception as error:  # noqa: BLE001 - a config these sizes do not build: reported
        return FamilyRow(model_type, "error", f"tiny model not built: {type(error).__name__}: {error}"[:160])
    report = hfaccel.check(model)
    if not report.served:
        return FamilyRow(model_type, "refused", str(report.reason).split(": ", 1)[-1][:160])
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hfaccel.patch(
                model, strict=True, max_num_batched_tokens=16, max_num_seqs=4, kv_cache_memory=64_000_000
            )
            try:
                completions = hfaccel.generate(model, prompts, max_new_tokens=NEW_TOKENS, progress=False)
            finally:
                hfaccel.unpatch(model)
            expected = [
                model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                    0, len(p) :
                ].tolist()
                for p in prompts
            ]
    except Exception as error:  # noqa: BLE001 - served but failed: that is the finding
        return FamilyRow(model_type, "error", f"{type(error).__name__}: {error}"[:160])
    equal = sum(
        c.token_ids == e[: len(c.token_ids)] and len(c.token_ids) == len(e)
        for c, e in zip(completions, expected)
    )
    from hfaccel.patches.layer_support import attention_shape, has_recurrent_layers

    shape = attention_shape(model)
    extras = ["recurrent state"] if has_recurrent_layers(model) else []
    if shape is not None and shape.value_head_dim < shape.head_dim:
        extras.append("latent attention (values padded)")
    needs = ", ".join([*report.needs, *extras])
    return FamilyRow(model_type, "served", needs, equal, len(prompts))


def run_families(out_dir: str | None = None, families: tuple[str, ...] | None = None) -> list[FamilyRow]:
    """Every family's row, printed as a table (and written to ``out_dir/families.md``)."""
    rows = []
    for model_type in families or tuple(FAMILIES):
        start = time.perf_counter()
        row = run_family(model_type)
        rows.append(row)
        result = f"{row.equal}/{row.prompts} equal to HF" if row.status == "served" else row.status
        print(
            f"  {model_type:<14} {result:<18} {row.detail[:90]}  ({time.perf_counter() - start:.1f} s)",
            flush=True,
        )
    served = [r for r in rows if r.status == "served" and r.equal == r.prompts]
    print(f"  served with HF's greedy tokens on every prompt: {len(served)} of {len(rows)} families")
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "families.md"), "w") as out:
            out.write(table(rows))
    return rows


def table(rows: list[FamilyRow]) -> str:
    lines = ["| family | on the engine | HF's greedy tokens | needs / reason |", "|---|---|---|---|"]
    for r in rows:
        tokens = f"{r.equal}/{r.prompts} prompts" if r.status == "served" else "-"
        lines.append(f"| {r.model_type} | {r.status} | {tokens} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
