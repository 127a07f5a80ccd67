"""A model whose weights or adapters change between generate calls never gets stale prefix-cache KV.

Each test warms the prefix cache with prompts over two blocks long, changes the model the way a
training loop or an adapter switch would, and checks the patched greedy `generate` against unpatched
HF's on the changed model.
"""

import copy
import gc
import weakref

import pytest
import torch

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.patches.model_state import ModelStateTracker, config_fingerprint
from tests.helpers import VOCAB, hf_greedy, tiny_model

peft = pytest.importorskip("peft")

NEW_TOKENS = 8


def prompts(count: int = 3, seed: int = 0) -> list[list[int]]:
    """Prompts of 40-60 tokens sharing a 36-token prefix: over two full 16-token blocks each."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (36,), generator=g).tolist()
    return [shared + torch.randint(3, VOCAB, (4 + 8 * i,), generator=g).tolist() for i in range(count)]


def patched_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt) :].tolist()


def warm(model, patch: bool = True) -> list[list[int]]:
    """Run the prompts on the patched `model` (patching it first if `patch`) so that their blocks sit
    in the prefix cache; returns the prompts."""
    if patch:
        hfaccel.patch(model, block_size=16, kv_cache_memory=4_000_000)
    ps = prompts()
    for p in ps:
        assert patched_greedy(model, p) == hf_greedy(model, p, NEW_TOKENS)
    assert engine_of(model).stats()["prefix_cache_hit_tokens"] > 0, "the prompts must share a prefix"
    return ps


def engine_of(model):
    return model._hfaccel.engine


def assert_matches_hf(model, ps: list[list[int]], before: list[list[int]] | None = None) -> None:
    """Patched greedy equals HF greedy on every prompt; with `before` (HF's outputs before the change),
    also check that the change did alter some output, so that stale KV could not go unnoticed."""
    refs = [hf_greedy(model, p, NEW_TOKENS) for p in ps]
    if before is not None:
        assert refs != before, "the change must alter the model's outputs for this test to mean anything"
    assert [patched_greedy(model, p) for p in ps] == refs


def hf_all(model, ps):
    return [hf_greedy(model, p, NEW_TOKENS) for p in ps]


def lm_loss(model, ps):
    ids = torch.tensor([ps[0]])
    return model(ids, labels=ids).loss


@pytest.fixture
def llama():
    return tiny_model("llama")


# ------------------------------------------------------------------ weight updates


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sgd_step(family):
    model = tiny_model(family)
    ps = warm(model)
    before = hf_all(model, ps)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    lm_loss(model, ps).backward()
    optimizer.step()
    assert_matches_hf(model, ps, before)


def test_fused_adamw_step(llama):
    ps = warm(llama)
    before = hf_all(llama, ps)
    optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-2, fused=True)
    lm_loss(llama, ps).backward()
    versions = [p._version for p in llama.parameters()]
    optimizer.step()
    assert versions == [p._version for p in llama.parameters()], "a fused step bumps no _version"
    assert_matches_hf(llama, ps, before)


def test_ema_through_data(llama):
    ps = warm(llama)
    before = hf_all(llama, ps)
    other = tiny_model("llama", seed=1)
    with torch.no_grad():
        for p, q in zip(llama.parameters(), other.parameters()):
            p.data.mul_(0.5).add_(q.data, alpha=0.5)
    assert_matches_hf(llama, ps, before)


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict(llama, assign):
    ps = warm(llama)
    before = hf_all(llama, ps)
    llama.load_state_dict(tiny_model("llama", seed=1).state_dict(), assign=assign)
    assert_matches_hf(llama, ps, before)


def test_dtype_round_trip(llama):
    ps = warm(llama)
    before = hf_all(llama, ps)
    llama.to(torch.bfloat16).to(torch.float32)  # same dtype as before, rounded weights
    assert_matches_hf(llama, ps, before)


def test_parameter_replaced_through_data(llama):
    ps = warm(llama)
    before = hf_all(llama, ps)
    for layer in llama.model.layers:
        layer.self_attn.q_proj.weight.data = torch.randn_like(layer.self_attn.q_proj.weight) * 0.2
    assert_matches_hf(llama, ps, before)


# ------------------------------------------------------------------ PEFT LoRA


def lora_config():
    return peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM"
    )


@pytest.fixture
def two_adapters():
    """A LoRA model with adapters "default" (active) and "b", both with non-zero deltas."""
    model = peft.get_peft_model(tiny_model("llama"), lora_config())
    model.add_adapter("b", lora_config())
    return model


def test_peft_model_with_one_adapter_matches_hf(two_adapters):
    warm(two_adapters)


def test_peft_set_adapter(two_adapters):
    ps = warm(two_adapters)
    before = hf_all(two_adapters, ps)
    two_adapters.set_adapter("b")
    assert_matches_hf(two_adapters, ps, before)
    two_adapters.set_adapter("default")
    assert_matches_hf(two_adapters, ps)


def test_peft_disable_adapter(two_adapters):
    ps = warm(two_adapters)
    before = hf_all(two_adapters, ps)
    with two_adapters.disable_adapter():
        assert_matches_hf(two_adapters, ps, before)
    assert_matches_hf(two_adapters, ps)


def test_peft_merge_adapter_and_delete(two_adapters):
    ps = warm(two_adapters)
    before = hf_all(two_adapters, ps)
    two_adapters.merge_adapter()  # base weights edited through .data; the LoRA path turned off
    assert_matches_hf(two_adapters, ps)
    two_adapters.unmerge_adapter()
    two_adapters.set_adapter("b")
    two_adapters.delete_adapter("default")
    assert_matches_hf(two_adapters, ps, before)


def test_merge_and_unload_on_a_patched_base_model():
    base = hfaccel.patch(tiny_model("llama"), block_size=16, kv_cache_memory=4_000_000)
    ps = warm(base, patch=False)  # the base model, before LoRA
    model = peft.get_peft_model(base, lora_config())
    assert_matches_hf(base, ps)  # LoRA layers injected into the patched model
    merged = model.merge_and_unload()
    assert merged is base
    assert_matches_hf(base, ps)


# ------------------------------------------------------------------ config changes


def test_a_sliding_window_changed_in_place_rebuilds_the_engine():
    """Mistral with a window wider than every sequence, warmed, then a window of 8 on the same config
    object: transformers reads it at every forward, so HF's tokens change; the engine is rebuilt for the
    new window (its blocks given back past it) and no KV computed under the old window is served."""
    model = family_model("mistral", sliding_window=4096)
    ps = warm(model)
    before = hf_all(model, ps)
    engine = engine_of(model)
    model.config.sliding_window = 8
    assert_matches_hf(model, ps, before)
    assert engine_of(model) is not engine and engine_of(model).scheduler.kv_window == 8
    hfaccel.unpatch(model)


def test_settings_that_compute_nothing_keep_the_engine_and_its_cache(llama, tmp_path):
    """A training loop toggles ``use_cache`` and the output flags, and saves checkpoints (which writes
    the config's ``dtype``): no rebuild, the prefix cache still hits."""
    ps = warm(llama)
    engine = engine_of(llama)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    llama.config.use_cache = False
    llama.config.output_hidden_states = True
    llama.save_pretrained(tmp_path)
    patched_greedy(llama, ps[0])
    llama.config.use_cache, llama.config.output_hidden_states = True, False
    assert engine_of(llama) is engine and engine.stats()["prefix_cache_hit_tokens"] == hits + 32


def test_a_config_changed_to_what_the_engine_cannot_serve_falls_back_until_it_can():
    """Qwen2 with its sliding layers, then ``use_sliding_window=False`` in place (its layers still hand
    attention their window, while its masks are full: `patch` refuses such a model). The next call goes to
    transformers with a warning naming the reason (an error under strict, and from the engine itself);
    put back, the config is served on the engine again (a new one: asking for the engine under the
    changed config gave the old one up)."""
    model = family_model("qwen2")
    prompt = list(range(5, 17))
    hfaccel.patch(model, kv_cache_memory=4_000_000)
    assert patched_greedy(model, prompt) == hf_greedy(model, prompt, NEW_TOKENS)
    engine = engine_of(model)
    model.config.use_sliding_window = False
    with pytest.warns(UserWarning, match=r"a config changed after hfaccel.patch \(.*sliding_window=8"):
        assert patched_greedy(model, prompt) == hf_greedy(model, prompt, NEW_TOKENS)
    with pytest.raises(ValueError, match=r"config changed after hfaccel.patch: .*sliding_window=8"):
        model._hfaccel.get_engine(model)
    model._hfaccel.strict = True
    with pytest.raises(
        ValueError, match=r"strict=True\) does not serve a config changed after hfaccel.patch"
    ):
        patched_greedy(model, prompt)
    model.config.use_sliding_window = True  # as it was: served again
    assert patched_greedy(model, prompt) == hf_greedy(model, prompt, NEW_TOKENS)
    assert engine_of(model) is not engine and engine_of(model).stats()["generated_tokens"] == NEW_TOKENS
    hfaccel.unpatch(model)


def test_the_engine_forgets_its_prefix_cache_when_the_config_changes(llama):
    """The engine's own check (what a server stepping one engine sees between requests): a config value
    changed in place drops the cached KV, the captured graphs with it; the engine is kept."""
    ps = warm(llama)
    engine = engine_of(llama)
    assert engine.block_manager.num_cached_blocks > 0
    assert not engine.check_model_state()
    llama.config.rms_norm_eps = 1e-2
    assert engine.check_model_state() and engine.block_manager.num_cached_blocks == 0
    assert_matches_hf(llama, ps)


def test_the_patch_time_probe_runs_once_per_config_state(llama, monkeypatch):
    """The probe (a forward of a few tokens) runs again only when the config changes, not per call."""
    from hfaccel.patches import layer_support

    probes = []
    original = layer_support.probe_reason
    monkeypatch.setattr(layer_support, "probe_reason", lambda *a: probes.append(1) or original(*a))
    ps = warm(llama)  # patch probes the model
    patched_greedy(llama, ps[0])
    assert len(probes) == 1
    llama.config.rms_norm_eps = 1e-2
    patched_greedy(llama, ps[0])
    patched_greedy(llama, ps[1])
    assert len(probes) == 2


def test_config_fingerprint_follows_values_not_names():
    config = tiny_model("llama").config
    token = config_fingerprint(config)
    config.rope_parameters = {**config.rope_parameters, "rope_theta": 1234.0}
    assert config_fingerprint(config) != token
    changed = config_fingerprint(config)
    config._name_or_path, config.use_cache, config.output_hidden_states = "elsewhere", False, True
    assert config_fingerprint(config) == changed
    assert config_fingerprint(None) == ()


# ------------------------------------------------------------------ the cache still works


def test_unchanged_model_still_hits_the_cache(llama):
    ps = warm(llama)
    hits = engine_of(llama).stats()["prefix_cache_hit_tokens"]
    patched_greedy(llama, ps[0])
    assert engine_of(llama).stats()["prefix_cache_hit_tokens"] == hits + 32
    with torch.no_grad():  # a forward pass changes nothing
        llama(torch.tensor([ps[1]]))
    patched_greedy(llama, ps[1])
    assert engine_of(llama).stats()["prefix_cache_hit_tokens"] == hits + 64


def test_reset_prefix_cache_and_release(llama):
    hfaccel.reset_prefix_cache(llama)  # unpatched: nothing to do
    ps = warm(llama)
    engine = engine_of(llama)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    hfaccel.reset_prefix_cache(llama)
    assert engine.block_manager.num_cached_blocks == 0
    assert_matches_hf(llama, ps[:1])
    assert engine.stats()["prefix_cache_hit_tokens"] == hits, "nothing cached survives a reset"

    ref = weakref.ref(engine)
    del engine
    hfaccel.release(llama)
    gc.collect()
    assert llama._hfaccel.engine is None and ref() is None, "release drops the engine and its KV cache"
    assert_matches_hf(llama, ps)
    assert engine_of(llama) is not None
    hfaccel.release(llama)
    hfaccel.release(tiny_model("llama"))  # unpatched: nothing to do


# ------------------------------------------------------------------ the tracker itself


def test_tracker_token_changes_only_with_the_model(two_adapters):
    token = ModelStateTracker(two_adapters).token
    first = token()
    assert token() == first and hash(first) == hash(token())
    with torch.no_grad():
        two_adapters(torch.tensor([[5, 6, 7]]))
    assert token() == first, "a forward pass changes nothing"
    changes = {
        "set_adapter": lambda: two_adapters.set_adapter("b"),
        "disable": lambda: two_adapters.base_model.disable_adapter_layers(),
        "enable": lambda: two_adapters.base_model.enable_adapter_layers(),
        "add_adapter": lambda: two_adapters.add_adapter("c", lora_config()),
        "delete_adapter": lambda: two_adapters.delete_adapter("c"),
        "edit through .data": lambda: next(two_adapters.parameters()).data.add_(1.0),
        "train/eval": lambda: two_adapters.train(not two_adapters.training),
    }
    previous = first
    for name, change in changes.items():
        change()
        now = token()
        assert now != previous, f"{name} not seen"
        previous = now


def test_tracker_counts_optimizer_steps(llama):
    token = ModelStateTracker(llama).token
    first = token()
    optimizer = torch.optim.AdamW(llama.parameters(), lr=1e-2, fused=True)
    optimizer.step()  # no gradients: the weights stay, but a step is a step
    assert token() != first


def test_weights_change_while_requests_run(llama):
    """Another thread trains between two engine steps: the running request finishes on the KV it has,
    never shares it, and the next admission sees the new weights."""
    from hfaccel.config import EngineConfig
    from hfaccel.engine.engine import Engine
    from hfaccel.engine.request import StoppingParams

    engine = Engine(
        llama, EngineConfig(block_size=16, kv_cache_memory=4_000_000), ModelStateTracker(llama).token
    )
    prompt = prompts()[0]
    stopping = StoppingParams(max_new_tokens=NEW_TOKENS)
    running = engine.add_request(prompt, stopping)
    engine.step()
    engine.step()  # prefilled (its 2 full blocks registered), decoding
    assert engine.block_manager.num_cached_blocks == 2
    with torch.no_grad():
        for p in llama.parameters():
            p.mul_(1.1)
    engine.run([later := engine.make_request(prompt, stopping)])
    assert running.is_finished and later.num_cached_prompt_tokens == 0, "old-weight blocks never served"
    assert later.output_token_ids == hf_greedy(llama, prompt, NEW_TOKENS)
    again = engine.make_request(prompt, stopping)
    engine.run([again])
    assert again.num_cached_prompt_tokens == 32, "blocks computed by the new weights are shared again"
    assert again.output_token_ids == later.output_token_ids


def test_tracker_keeps_no_replaced_weight_alive(llama):
    tracker = ModelStateTracker(llama)
    first = tracker.token()
    old = weakref.ref(llama.lm_head.weight)
    llama.load_state_dict(tiny_model("llama", seed=1).state_dict(), assign=True)
    gc.collect()
    assert old() is None, "the tracker must not pin a replaced weight between calls"
    assert tracker.token() != first


class Wrapped(torch.Tensor):
    """A wrapper tensor subclass in the style of torchao's quantized weights: its values live in an inner
    tensor (`__tensor_flatten__`) and it implements few ops (no ``as_strided``)."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner):
        self.inner = inner

    def __tensor_flatten__(self):
        return ["inner"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.as_strided.default:
            raise NotImplementedError("Wrapped implements no as_strided")
        unwrap = torch.utils._pytree.tree_map_only
        args, kwargs = unwrap(Wrapped, lambda w: w.inner, (args, kwargs or {}))
        return func(*args, **kwargs)


def test_tracker_fingerprints_a_tensor_subclass_by_its_inner_tensors():
    module = torch.nn.Linear(8, 8)
    module.register_buffer("quantized", Wrapped(torch.randn(8, 8)))
    tracker = ModelStateTracker(module)
    first = tracker.token()  # no op the subclass lacks is called
    assert tracker.token() == first
    with torch.no_grad():
        module.quantized.inner.mul_(2.0)  # its values change in place
    assert tracker.token() != first


def test_a_torchao_int8_weight_only_model_gives_hfs_tokens_on_the_engine():
    quantization = pytest.importorskip("torchao.quantization")
    model = tiny_model("llama", layers=2)
    quantization.quantize_(model, quantization.Int8WeightOnlyConfig())
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    completions = hfaccel.generate(model, prompts, max_new_tokens=8, progress=False)
    assert [c.token_ids for c in completions] == [hf_greedy(model, p, 8) for p in prompts]


# ------------------------------------------------------------------ changes made and undone mid-call


def _while_running(model, at_calls, change):
    """A logits processor that calls `change(k)` at its k-th call, for k in `at_calls`: a stand-in for
    another thread changing the model while requests run (deterministic, between steps)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class During(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            During.calls += 1
            if During.calls in at_calls:
                change(During.calls)
            return scores

    return LogitsProcessorList([During()])


def _long_prompt_after_a_window(model, change, prompt_len=160):
    """A short request samples (its processor makes the change at its 2nd call, undoes it at its 4th)
    while a long prompt is prefilled in 32-token chunks, its blocks registered as they fill; the model
    ends as it was. Then the long prompt again, which the prefix cache serves: HF's tokens?"""
    g = torch.Generator().manual_seed(3)
    long = torch.randint(3, VOCAB, (prompt_len,), generator=g).tolist()
    expected = hf_greedy(model, long, NEW_TOKENS)
    hfaccel.patch(model, max_num_batched_tokens=32, block_size=16, kv_cache_memory=4_000_000)
    try:
        processors = _while_running(model, (2, 4), change)
        hfaccel.generate(
            model, [[5, 6, 7], long], max_new_tokens=30, do_sample=False, logits_processor=processors,
            progress=False,
        )  # fmt: skip
        assert hf_greedy(model, long, NEW_TOKENS) == expected, "the model must end as it was"
        # (Before every step read the sentinel, the blocks prefilled in the window were served here.)
        again = hfaccel.generate(model, [long], max_new_tokens=NEW_TOKENS, progress=False)[0].token_ids
        assert again == expected
    finally:
        hfaccel.unpatch(model)


def test_weights_swapped_and_swapped_back_mid_call_leave_no_stale_kv():
    model, other = tiny_model("llama"), tiny_model("llama", seed=7)
    pairs = list(zip(model.parameters(), other.parameters()))

    def swap(_):
        for p, q in pairs:
            p.data, q.data = q.data, p.data

    _long_prompt_after_a_window(model, swap)


def test_an_adapter_disabled_and_enabled_mid_call_leaves_no_stale_kv(two_adapters):
    """PEFT's disable_adapter() around a reference pass, in another thread while requests run."""

    def toggle(k):
        (
            two_adapters.base_model.disable_adapter_layers
            if k == 2
            else two_adapters.base_model.enable_adapter_layers
        )()

    _long_prompt_after_a_window(two_adapters, toggle)


@pytest.mark.parametrize("how", ["activation", "class"])
def test_a_module_without_tensors_swapped_in_forgets_the_prefix_cache(llama, how):
    """A module swapped in that holds no tensor (an activation), or a module's class changed, moves no
    parameter: the KV cached before is not served (the token lists each module's identity and class)."""
    ps = warm(llama)
    before = hf_all(llama, ps)
    mlp = llama.model.layers[0].mlp
    if how == "activation":
        mlp.act_fn = torch.nn.ReLU()
    else:

        class Doubled(type(mlp)):
            def forward(self, x):
                return 2.0 * super().forward(x)

        mlp.__class__ = Doubled
    assert_matches_hf(llama, ps, before)


def test_a_packed_hook_added_or_removed_forgets_the_prefix_cache(llama):
    """A forward hook marked ``hfaccel_packed`` is served by the engine: adding or removing one changes
    what the layers compute, so the KV cached without it (or with it) is not served."""
    ps = warm(llama)
    before = hf_all(llama, ps)

    def steer(module, args, output):
        return output * -3.0 + 5.0

    steer.hfaccel_packed = True
    handle = llama.model.layers[0].register_forward_hook(steer)
    assert_matches_hf(llama, ps, before)
    handle.remove()
    assert_matches_hf(llama, ps)


def test_a_global_packed_hook_added_or_removed_forgets_the_prefix_cache(llama):
    """The same for a global forward hook (torch's ``register_module_forward_hook``): every module's
    forward runs it, so its handle is part of the model's state."""
    from torch.nn.modules.module import register_module_forward_hook

    ps = warm(llama)
    before = hf_all(llama, ps)

    def steer(module, args, output):
        return output * -3.0 + 5.0 if module is llama.model.layers[0].mlp else output

    steer.hfaccel_packed = True
    handle = register_module_forward_hook(steer)
    try:
        assert_matches_hf(llama, ps, before)
    finally:
        handle.remove()
    assert_matches_hf(llama, ps)


def test_a_library_global_hook_around_every_call_keeps_the_prefix_cache(llama):
    """torch's ModuleTracker (FlopCounterMode's) registers global hooks anew around each call: they change
    no value, so the prompts' blocks are still reused."""
    from torch.utils.module_tracker import ModuleTracker

    ps = warm(llama)
    engine = engine_of(llama)
    hits = engine.stats()["prefix_cache_hit_tokens"]
    for _ in range(2):
        with ModuleTracker():
            assert patched_greedy(llama, ps[0]) == hf_greedy(llama, ps[0], NEW_TOKENS)
    assert engine.stats()["prefix_cache_hit_tokens"] >= hits + 2 * 32


@pytest.mark.parametrize("how", ["graft", "deep copy", "config only"])
def test_a_layer_swapped_in_with_a_config_of_its_own_runs_the_engines_attention(llama, how):
    """A layer grafted from another instance of the architecture, or a deep copy of an attention module,
    holds a config object the patch never saw: the attention switch finds the model's configs afresh
    when its structure changes (it ran transformers' own attention on the packed step: other tokens)."""
    ps = warm(llama)
    before = None if how == "config only" else hf_all(llama, ps)
    if how == "graft":
        llama.model.layers[1] = tiny_model("llama", seed=11).model.layers[1]
    elif how == "config only":  # no tensor changes: the layer's outputs are HF's as before
        llama.model.layers[1].self_attn.config = copy.deepcopy(llama.config)
    else:
        llama.model.layers[1].self_attn = copy.deepcopy(llama.model.layers[1].self_attn)
        with torch.no_grad():
            llama.model.layers[1].self_attn.o_proj.weight.mul_(-2.0)
    assert llama.model.layers[1].self_attn.config is not llama.config
    assert_matches_hf(llama, ps, before)


def test_a_model_drawing_dropout_shares_no_prefix():
    """In train mode with LoRA dropout, every row computes its KV under its own dropout draws, as in
    transformers: the rows of one prompt, seeded alike, are transformers' rows (a shared or cached prefix
    would give them one draw), nothing is shared or registered meanwhile, and eval mode shares again."""
    config = peft.LoraConfig(
        r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.1,
        init_lora_weights=False, task_type="CAUSAL_LM",
    )  # fmt: skip
    model = peft.get_peft_model(tiny_model("llama"), config).eval()
    ps = warm(model)
    engine = engine_of(model)
    model.train()
    rows = torch.tensor([ps[0]] * 4)

    def seeded(generate) -> torch.Tensor:
        torch.manual_seed(7)
        with torch.no_grad():
            return generate(rows, max_new_tokens=NEW_TOKENS, do_sample=False)

    expected = seeded(lambda *args, **kwargs: type(model).generate(model, *args, **kwargs))
    assert len({tuple(row) for row in expected.tolist()}) > 1, "the dropout must change the rows"
    hits = engine.stats()["prefix_cache_hit_tokens"]
    assert torch.equal(seeded(model.generate), expected)
    assert torch.equal(seeded(model.generate), expected)  # nothing of the first call was registered
    assert engine.stats()["prefix_cache_hit_tokens"] == hits
    model.eval()
    assert_matches_hf(model, ps)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits
    model.train()  # beams fork one prompt computation, where transformers' beams each draw their own
    with pytest.warns(UserWarning, match="beam search on a model drawing dropout"):
        model.generate(rows[:1], max_new_tokens=3, num_beams=2, do_sample=False)
