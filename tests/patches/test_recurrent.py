"""Recurrent and convolutional token mixers (Mamba, gated delta nets, short convolutions) on the engine:
each sequence keeps its own state row, so hybrid models give HF's tokens in chunked prefill, batched
decode and after preemption; a mixer whose state lives anywhere else is refused at `patch`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from hfaccel.patches.layer_support import state_bytes_per_sequence
from hfaccel.patches.recurrent import recurrent_mixers, split_by_sequence
from tests.helpers import assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts

state_api = pytest.mark.skipif(
    not hasattr(DynamicCache, "get_conv_state"),
    reason="this transformers keeps recurrent state in model-specific caches: hybrids are refused "
    "(test_layer_support.py::test_hybrids_are_refused_where_transformers_has_no_state_api)",
)
# Weights N(0, 0.08) (the family matrix's): every mixer moves the argmax.
HYBRIDS = (
    "jamba",  # Mamba layers beside attention ones, MoE
    "qwen3_next",  # gated delta net (conv and recurrent state) beside gated attention
    "lfm2",  # short convolutions (conv state only)
    "falcon_h1",  # attention and Mamba 2 side by side in every layer
    "nemotron_h",  # Mamba 2, attention, MLP-only and MoE-only layers
)


@state_api
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_hybrid_families_give_hf_tokens(model_type):
    """Prompts of 1-43 tokens under a budget of 16 tokens a step: starts in one call, later chunks
    continued from the state, decodes batched; every slot comes back."""
    model = family_model(model_type)
    prompts = varied_prompts(8, seed=3)
    hfaccel.patch(model, strict=True, max_num_batched_tokens=16, max_num_seqs=4)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
        engine = model._hfaccel.get_engine(model)
        assert engine.block_manager.num_free_state_slots == 4
        assert not engine.config.enable_prefix_caching
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 12))


@state_api
@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "falcon_mamba"])
def test_purely_recurrent_models_give_hf_tokens_and_keep_no_kv(model_type):
    """No layer calls attention: every sequence is its state rows alone. The paged cache has no blocks
    in any layer (its blocks only count tokens), any max_model_len is taken (the config declares no
    context), and chunked prefill, batched decode and sampling with a seed match HF."""
    model = family_model(model_type)
    prompts = varied_prompts(8, seed=5)
    hfaccel.patch(model, strict=True, max_num_batched_tokens=16, max_num_seqs=4, max_model_len=100_000)
    try:
        completions = hfaccel.generate(model, prompts, max_new_tokens=12, progress=False)
        engine = model._hfaccel.get_engine(model)
        assert engine.max_model_len == 100_000
        assert all(k.shape[0] <= 1 and v.shape[0] <= 1 for k, v in engine.runner.kv_caches)  # no blocks
        assert engine.limits.reason.startswith("no layer keeps K/V")
        assert engine.block_manager.num_free_state_slots == 4
        engine.block_manager.check([])
    finally:
        hfaccel.unpatch(model)
    for prompt, completion in zip(prompts, completions):
        assert_same_or_near_tie(model, prompt, completion.token_ids, hf_greedy(model, prompt, 12))


@state_api
def test_a_purely_recurrent_models_blocks_count_tokens_within_a_bound():
    """Its blocks cost no memory but the block manager's bookkeeping: they count at most COUNTED_TOKENS
    tokens across sequences (or one max_model_len), and a longer max_model_len is refused at patch,
    naming it, instead of failing the first generate (a probe saw a MemoryError at 2**31)."""
    from hfaccel.engine.limits import COUNTED_TOKENS

    model = family_model("mamba")
    engine = Engine(model, EngineConfig(max_model_len=COUNTED_TOKENS, max_num_seqs=64))
    assert engine.num_blocks == COUNTED_TOKENS // engine.config.block_size  # not 64 full-length seats
    assert Engine(model, EngineConfig(max_num_seqs=4)).num_blocks == 4 * 32768 // 16  # the default length
    with pytest.raises(ValueError, match=rf"max_model_len \(2147483648\) exceeds {COUNTED_TOKENS}"):
        hfaccel.patch(model, max_model_len=2**31)
    assert not hasattr(model, "_hfaccel")


@state_api
def test_a_hybrid_keeps_kv_in_its_attention_layers_only():
    """Jamba's recurrent layers hold a state, not K/V: the budget buys blocks for the attention layers
    alone (twice the tokens here, where half the layers attend), and the recurrent layers' caches have
    none."""
    from hfaccel.patches.models import kv_bytes_per_token

    model = family_model("jamba")
    attending = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert 0 < len(attending) < model.config.num_hidden_layers
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    row = 2 * model.config.num_key_value_heads * head_dim * 4  # K and V, float32
    hfaccel.patch(model, strict=True, max_num_seqs=4)
    try:
        assert kv_bytes_per_token(model, torch.float32) == len(attending) * row
        hfaccel.generate(model, [[3, 4, 5]], max_new_tokens=2, progress=False)
        engine = model._hfaccel.get_engine(model)
        blocks = [k.shape[0] for k, _ in engine.runner.kv_caches]
    finally:
        hfaccel.unpatch(model)
    assert all((b > 1) == (i in attending) for i, b in enumerate(blocks)), blocks


@state_api
def test_a_preempted_hybrid_sequence_starts_its_state_again():
    model = family_model("jamba")
    prompts = varied_prompts(6, seed=4)[2:6]
    expected = [hf_greedy(model, p, 24, min_new_tokens=24) for p in prompts]
    # Room for about two of the four requests at their full length: the newest ones are preempted. The
    # budget holds the four seats' recurrent state beside the K/V.
    block_bytes = 2 * 2 * 2 * 16 * 4 * 8  # K and V, 2 attention layers of 4, 2 KV heads, dim 16, float32
    state = 4 * state_bytes_per_sequence(model)
    config = EngineConfig(
        block_size=8, kv_cache_memory=20 * block_bytes + state, max_num_seqs=4, max_num_batched_tokens=32
    )
    engine = Engine(model, config)
    requests = [engine.make_request(p, StoppingParams(24, 24)) for p in prompts]
    engine.run(requests)
    assert engine.scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == expected
    engine.block_manager.check([])
    assert engine.block_manager.num_free_state_slots == engine.config.max_num_seqs
    assert engine.num_blocks == 20 and engine.limits.state_bytes == state


@state_api
def test_the_recurrent_state_of_every_seat_is_budgeted_beside_the_kv():
    """A state row is held whole from a sequence's first token for each of max_num_seqs seats: the
    budget pays for them first (the probe measured one sequence's bytes), the automatic max_num_seqs
    counts them, and a budget that cannot hold them is refused at patch, naming both settings."""
    model = family_model("mamba")
    per_seq = state_bytes_per_sequence(model)
    # 4 layers of Mamba: an SSM state [d_inner, d_state] and a conv state [d_inner, d_conv], float32
    d_inner, config = model.config.intermediate_size, model.config
    assert per_seq == config.num_hidden_layers * d_inner * (config.state_size + config.conv_kernel) * 4
    engine = Engine(model, EngineConfig(kv_cache_memory=10 * per_seq + 1))
    assert engine.config.max_num_seqs == 10 and engine.limits.state_bytes == 10 * per_seq
    engine.run([engine.make_request([3, 4, 5], StoppingParams(4))])
    states = recurrent_mixers(model)[0][1].forward.args[2]  # the SlotStates the wrapped mixers share
    assert sum(t.numel() * t.element_size() for t in states.tensors.values()) == 10 * per_seq
    with pytest.raises(
        ValueError, match=r"recurrent state of max_num_seqs=8 sequences .*raise kv_cache_memory"
    ):
        hfaccel.patch(model, kv_cache_memory=7 * per_seq, max_num_seqs=8)
    assert not hasattr(model, "_hfaccel")


@state_api
def test_what_cannot_resume_a_recurrent_state_falls_back_or_is_refused():
    model = family_model("lfm2")
    ids = torch.tensor([varied_prompts(3, seed=3)[2]])
    with pytest.raises(ValueError, match="speculative: a model with recurrent layers"):
        hfaccel.patch(model, speculative="ngram")
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="beam search with recurrent layers"):
            beams = model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False)
        with pytest.warns(UserWarning, match="a cache given or returned, with recurrent layers"):
            out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        with pytest.warns(UserWarning, match="assisted decoding with recurrent layers"):
            model.generate(ids, max_new_tokens=4, do_sample=False, prompt_lookup_num_tokens=2)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(beams, model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False))
    assert out.past_key_values is not None


@state_api
def test_a_cache_hf_returns_for_embeddings_whatever_use_cache_says_falls_back():
    """HF returns a cache for `inputs_embeds` even with use_cache=False: on a recurrent model that call
    goes to transformers with the reason (it crashed reading K/V the recurrent layers do not keep), and a
    direct K/V read of such an engine says why."""
    model = family_model("mamba")
    ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
    embeds = model.get_input_embeddings()(ids).detach()
    kwargs = dict(inputs_embeds=embeds, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
    expected = model.generate(use_cache=False, **kwargs)
    hfaccel.patch(model, max_num_seqs=4)
    try:
        with pytest.warns(UserWarning, match="a cache given or returned, with recurrent layers"):
            out = model.generate(use_cache=False, **kwargs)
        engine = model._hfaccel.get_engine(model)
        with pytest.raises(ValueError, match="recurrent layers: they keep a state, not K/V"):
            engine.runner.gather_kv([0], 4)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out.sequences, expected.sequences)


@state_api
def test_a_draft_model_with_recurrent_layers_is_refused():
    """A draft's mixers would run without a state of their own (each draft seeing only its chunk)."""
    with pytest.raises(ValueError, match="speculative: a draft model with recurrent layers"):
        Engine(tiny_model("llama"), EngineConfig(speculative=family_model("mamba")))


@state_api
def test_automatic_seats_leave_kv_room_for_one_sequence_of_max_model_len():
    """Each seat's state comes out of the budget first: the automatic max_num_seqs stops where the K/V
    left would no longer hold one max_model_len sequence (a budget patch accepts is then served)."""
    from hfaccel.patches.models import kv_bytes_per_token

    model = family_model("jamba", max_position_embeddings=2048)
    per_token, state = kv_bytes_per_token(model, torch.float32), state_bytes_per_sequence(model)
    # Sequences of a typical 512 tokens would give 3 seats; their state would leave K/V for 2032 tokens.
    budget = 2048 * per_token + 2 * state + 100
    hfaccel.patch(model, kv_cache_memory=budget)
    try:
        prompt = [3 + i % 200 for i in range(2044)]
        (completion,) = hfaccel.generate(model, [prompt], max_new_tokens=2, progress=False)
        engine = model._hfaccel.get_engine(model)
    finally:
        hfaccel.unpatch(model)
    assert completion.finish_reason == "length" and len(completion.token_ids) == 2
    assert engine.config.max_num_seqs == 2 and engine.num_blocks * engine.config.block_size >= 2048


class RunningSum(torch.nn.Module):
    """A token mixer with a convolution that keeps its state in itself, not in the cache it is handed."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.conv = torch.nn.Conv1d(64, 64, 2, groups=64)
        self.up = torch.nn.Linear(64, 64)

    def forward(self, hidden_states, cache=None, **kwargs):
        return self.up(hidden_states.cumsum(1))


@state_api
def test_a_mixer_that_keeps_its_state_elsewhere_is_refused():
    model = tiny_model("llama", layers=2)
    model.model.layers[1].mlp = RunningSum(1)  # a token mixer where the MLP was
    with pytest.raises(
        ValueError,
        match=r"model.layers.1.mlp \(RunningSum\) gives other outputs .* \(by up to .*, tolerance ",
    ):
        hfaccel.patch(model)


@state_api
def test_unpatch_gives_the_mixers_their_own_forward_back():
    model = family_model("lfm2")
    mixers = [m for m in model.modules() if any(isinstance(c, torch.nn.Conv1d) for c in m.children())]
    hfaccel.patch(model)
    hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=2, progress=False)
    assert all("forward" in m.__dict__ for m in mixers)
    hfaccel.unpatch(model)
    assert all("forward" not in m.__dict__ for m in mixers)


@state_api
def test_a_released_engine_lets_go_of_its_state_rows_and_the_next_one_serves():
    """`hfaccel.release` drops the engine, and with it the state rows its mixer wrappers held (a
    sequence's state per layer for every seat, until the next engine or unpatch); a newer engine's
    wrappers stay where an older engine is released after it was built."""
    import gc
    import weakref

    model = family_model("lfm2")
    prompt = [5, 6, 7, 8]
    expected = hf_greedy(model, prompt, 4)
    hfaccel.patch(model, max_num_seqs=4)
    hfaccel.generate(model, [prompt], max_new_tokens=2, progress=False)
    _, mixer = recurrent_mixers(model)[0]
    states = weakref.ref(mixer.forward.args[2])
    hfaccel.release(model)
    gc.collect()
    assert states() is None and all("forward" not in m.__dict__ for _, m in recurrent_mixers(model))
    out = hfaccel.generate(model, [prompt], max_new_tokens=4, progress=False)[0]
    assert out.token_ids == expected  # a new engine wraps them again
    old = model._hfaccel.engine
    model._hfaccel.engine = None  # a newer engine built while the old one was still held
    hfaccel.generate(model, [prompt], max_new_tokens=1, progress=False)
    newer = mixer.forward.args[2]
    old.executor.release_state_slots()
    assert mixer.forward.args[2] is newer
    hfaccel.unpatch(model)


class _Layout:
    def __init__(self, query_lens, seq_lens, state_slots):
        self.query_lens, self.seq_lens, self.state_slots = query_lens, seq_lens, state_slots


def test_a_step_runs_decodes_together_starts_alone_and_chunks_token_by_token():
    # Decodes of slots 3 and 1, a start of 3 tokens (slot 0), a chunk of 2 continuing slot 2.
    layout = _Layout([1, 1, 3, 2], [9, 5, 3, 7], [3, 1, 0, 2])
    hidden = torch.arange(7.0).view(1, 7, 1)
    calls = []

    def run(rows, slots, previous):
        calls.append((rows.shape[:2], slots.tolist(), previous))
        return rows * 10

    out = split_by_sequence(hidden, layout, run)
    assert torch.equal(out, hidden * 10)
    assert calls == [
        ((2, 1), [3, 1], True),
        ((1, 3), [0], False),
        ((1, 1), [2], True),
        ((1, 1), [2], True),
    ]


@state_api
@pytest.mark.parametrize("model_type", ["jamba", "mistral"])
def test_a_mask_with_holes_falls_back_where_the_layers_count_the_masked_tokens(model_type):
    """transformers' recurrent layers step over a masked token, and its sliding windows count one: a
    mask with a hole goes to transformers on such models (the engine drops masked tokens), with HF's
    tokens."""
    model = family_model(model_type)
    prompt = varied_prompts(3, seed=3)[2][:24]
    mask = torch.ones(1, len(prompt), dtype=torch.long)
    mask[0, 12] = 0
    ids = torch.tensor([prompt])
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    hfaccel.patch(model)
    try:
        with pytest.warns(
            UserWarning, match="an attention mask with holes, with (recurrent layers|sliding windows)"
        ):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    finally:
        hfaccel.unpatch(model)
    assert torch.equal(out, expected)


@state_api
def test_adapters_per_request_on_a_hybrid_go_to_peft_with_the_reason():
    """A recurrent mixer runs per sequence, while per-token LoRA needs the whole packed step: two
    adapters in one call on a hybrid fall back to PEFT's generate, with its tokens."""
    peft = pytest.importorskip("peft")

    def lora(rank):
        targets = ["in_proj", "out_proj", "q_proj", "v_proj"]
        return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)

    model = peft.get_peft_model(family_model("jamba"), lora(2), adapter_name="a")
    model.add_adapter("b", lora(4))
    model.eval()
    prompts = varied_prompts(4, seed=29)[2:]
    names = ["a", "b"]
    expected = [
        model.generate(input_ids=torch.tensor([p]), max_new_tokens=6, do_sample=False, adapter_names=[n])[
            0, len(p) :
        ].tolist()
        for p, n in zip(prompts, names)
    ]
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="adapters per request on a model with recurrent layers"):
            got = hfaccel.generate(model, prompts, adapter=names, max_new_tokens=6, progress=False)
    finally:
        hfaccel.unpatch(model)
    assert [c.token_ids for c in got] == expected
