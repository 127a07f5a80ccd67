"""Many LoRA adapters in one continuous batch: each request's tokens get its own adapter's delta.

The oracle is PEFT's own mixed-adapter batch, ``generate(adapter_names=[...])`` on the unpatched model in
eval mode. The patched model is made with ``strict=True``, so any fallback to HF raises instead of
passing silently.
"""

import threading
import warnings

import pytest
import torch

import hfaccel
from hfaccel.patches import lora
from tests.helpers import VOCAB, tiny_model

peft = pytest.importorskip("peft")

NEW_TOKENS = 10
ADAPTERS = {  # different ranks and target modules
    "math": dict(r=2, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
    "code": dict(r=4, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"]),
    "chat": dict(r=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def lora_config(r: int, target_modules: list[str], **extra) -> "peft.LoraConfig":
    return peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=target_modules,
        init_lora_weights=False,  # non-zero deltas
        task_type="CAUSAL_LM",
        **extra,
    )


def lora_model(family: str = "llama"):
    """A PEFT model holding the three adapters of `ADAPTERS` ("math" active), in eval mode."""
    names = list(ADAPTERS)
    model = peft.get_peft_model(tiny_model(family), lora_config(**ADAPTERS[names[0]]), adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, lora_config(**ADAPTERS[name]))
    return model.eval()


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 39+ tokens sharing a 36-token prefix (two full 16-token blocks)."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, VOCAB, (36,), generator=g).tolist()
    return [shared + torch.randint(3, VOCAB, (3 + 2 * i,), generator=g).tolist() for i in range(count)]


def left_padded(ps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, ps))
    ids = torch.zeros(len(ps), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(ps):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


def peft_mixed(model, ps: list[list[int]], names: list[str], **kwargs) -> list[list[int]]:
    """PEFT's own mixed-adapter greedy generate (unpatched); new tokens per row, padding stripped."""
    ids, mask = left_padded(ps)
    generate = model._hfaccel.original_generate if "_hfaccel" in model.__dict__ else model.generate
    with torch.no_grad():
        out = generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            adapter_names=names,
            pad_token_id=0,
            **kwargs,
        )
    return [row[ids.shape[1] :].tolist() for row in out]


def patched_mixed(model, ps: list[list[int]], names: list[str]) -> list[list[int]]:
    """The (patched) model's own `generate` with `adapter_names` on the left-padded batch; new tokens
    per row, as `peft_mixed` gives them."""
    ids, mask = left_padded(ps)
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, adapter_names=names
    )
    return [row[ids.shape[1] :].tolist() for row in out]


def two_prompts_greedy() -> dict:
    """`generate` keywords: two left-padded prompts, 6 greedy tokens."""
    ids, mask = left_padded(prompts(2))
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "max_new_tokens": 6,
        "do_sample": False,
        "pad_token_id": 0,
    }


def patch_strict(model):
    return hfaccel.patch(model, strict=True, block_size=16, kv_cache_memory=8_000_000)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_mixed_batch_matches_peft(family):
    model = lora_model(family)
    names = ["math", "code", "chat", "__base__", "math", "code", "chat", "math", "__base__"]
    ps = prompts(len(names))
    ref = peft_mixed(model, ps, names)
    assert len({tuple(r) for r in ref}) > 4, (
        "the adapters must change the outputs for the test to mean anything"
    )
    patch_strict(model)
    ids, mask = left_padded(ps)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
        mixed = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            adapter_names=names,
        )
    assert [row[ids.shape[1] :].tolist() for row in mixed] == ref
    active = [row[ids.shape[1] :].tolist() for row in out]
    assert active == peft_mixed(model, ps, ["math"] * len(ps)), "without adapter_names: the active adapter"

    # Prefix sharing: the mixed call's requests share their two prompt blocks within an adapter only.
    engine = model._hfaccel.engine
    stats = engine.stats()
    counts = {n: names.count(n) for n in set(names)}
    first_call_hits = 32 * (len(ps) - 1)  # one adapter ("math" active, no salt): all share
    assert stats["prefix_cache_hit_tokens"] == first_call_hits + 32 * sum(c - 1 for c in counts.values())


def test_hfaccel_generate_adapter_per_prompt():
    model = patch_strict(lora_model())
    ps = prompts(6, seed=1)
    adapters = ["chat", None, "__base__", "code", "chat", None]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        done = hfaccel.generate(model, ps, adapter=adapters, max_new_tokens=NEW_TOKENS, progress=False)
    expected_names = [a if a is not None else "math" for a in adapters]  # None: the active adapter
    assert [c.token_ids for c in done] == peft_mixed(model, ps, expected_names)
    # Cached prompt tokens: within one adapter (the second "chat", the second None) only.
    assert [c.metrics["num_cached_prompt_tokens"] for c in done] == [0, 0, 0, 0, 32, 32]

    # One name for every prompt, and a later call of another adapter finds nothing cached.
    again = hfaccel.generate(model, ps[:2], adapter="code", max_new_tokens=NEW_TOKENS, progress=False)
    assert [c.token_ids for c in again] == peft_mixed(model, ps[:2], ["code", "code"])
    assert [c.metrics["num_cached_prompt_tokens"] for c in again] == [32, 32], "code's own blocks are found"
    other = hfaccel.generate(model, ps[:1], adapter="math", max_new_tokens=NEW_TOKENS, progress=False)
    assert other[0].metrics["num_cached_prompt_tokens"] == 0, "math was never run with a salt"

    events = list(hfaccel.stream(model, ps[:2], adapter=["chat", "code"], max_new_tokens=NEW_TOKENS))
    streamed = [[e.token_id for e in events if e.index == i] for i in range(2)]
    assert streamed == peft_mixed(model, ps[:2], ["chat", "code"])


def test_prompt_logprobs_are_those_of_the_prompts_adapter():
    model = patch_strict(lora_model())
    ps = prompts(3, seed=2)
    names = ["code", "__base__", None]  # None: the active adapter ("math")
    done = hfaccel.generate(model, ps, adapter=names, max_new_tokens=2, prompt_logprobs=0, progress=False)
    for prompt, name, completion in zip(ps, names, done):
        with torch.no_grad():
            extra = {} if name is None else {"adapter_names": [name]}
            logits = model(input_ids=torch.tensor([prompt]), **extra).logits[0]
        expected = torch.log_softmax(logits.float(), -1)[torch.arange(len(prompt) - 1), prompt[1:]]
        got = torch.tensor([completion.prompt_logprobs[j][prompt[j]] for j in range(1, len(prompt))])
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=f"adapter {name}")


def test_adapter_names_may_come_as_an_array():
    import numpy as np

    model = patch_strict(lora_model())
    ps = prompts(2, seed=3)
    listed = hfaccel.generate(model, ps, adapter=["code", "chat"], max_new_tokens=3, progress=False)
    arrayed = hfaccel.generate(
        model, ps, adapter=np.array(["code", "chat"]), max_new_tokens=3, progress=False
    )
    assert [c.token_ids for c in arrayed] == [c.token_ids for c in listed]


def test_block_keys_are_salted_by_adapter():
    model = patch_strict(lora_model())
    p = prompts(1)[0]
    hfaccel.generate(model, [p, p, p], adapter=["math", "code", None], max_new_tokens=2, progress=False)
    manager = model._hfaccel.engine.block_manager
    roots = {key[0] for key in manager._cached if key[1] == tuple(p[:16])}
    assert len(roots) == 3, "the same first block, cached once per adapter"


def test_num_return_sequences_and_sampling_with_adapters():
    model = patch_strict(lora_model())
    ps = prompts(2, seed=2)
    ids, mask = left_padded(ps)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=True,
        top_k=1,  # sampling from the top token only: greedy, which HF refuses with several sequences
        num_return_sequences=2,
        adapter_names=["code", "__base__"],
    )
    rows = [row[ids.shape[1] :].tolist() for row in out]
    ref = peft_mixed(model, ps, ["code", "__base__"])
    assert rows == [ref[0], ref[0], ref[1], ref[1]]
    sampled = hfaccel.generate(
        model, ps, adapter=["code", "chat"], do_sample=True, max_new_tokens=NEW_TOKENS, seed=7, progress=False
    )
    alone = [
        hfaccel.generate(model, [p], adapter=a, do_sample=True, max_new_tokens=NEW_TOKENS, seed=7 + i)[0]
        for i, (p, a) in enumerate(zip(ps, ["code", "chat"]))
    ]
    assert [c.token_ids for c in sampled] == [c.token_ids for c in alone], "a request's samples are its own"


def test_peft_errors_are_raised_as_peft_raises_them():
    model = patch_strict(lora_model())
    ids, mask = left_padded(prompts(2))
    with pytest.raises(ValueError, match="non-existing adapter"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, adapter_names=["math", "nope"])
    with pytest.raises(ValueError, match="Length of `adapter_names`"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, adapter_names=["math"])
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, adapter_names=["math", "code"])
    model.eval()
    with pytest.raises(hfaccel.RequestError, match="non-existing adapter"):
        hfaccel.generate(model, prompts(1), adapter="nope", max_new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="one per prompt"):
        hfaccel.generate(model, prompts(2), adapter=["math"], max_new_tokens=2, progress=False)


def test_unbatched_lora_kinds_fall_back_with_one_warning():
    """LoRA on the embeddings: PEFT's mixed batch serves it, the engine does not (one warning, PEFT's
    output). DoRA: PEFT itself refuses adapter_names; the call falls back and PEFT raises."""
    model = lora_model()
    model.add_adapter("emb", lora_config(4, ["embed_tokens", "q_proj"]))
    model.add_adapter("dora", lora_config(4, ["q_proj", "v_proj"], use_dora=True))
    model.eval()
    ps = prompts(2)
    ref = peft_mixed(model, ps, ["emb", "math"])
    hfaccel.patch(model, block_size=16, kv_cache_memory=8_000_000)
    ids, mask = left_padded(ps)
    with pytest.warns(UserWarning, match="Embedding layer"):
        assert patched_mixed(model, ps, ["emb", "math"]) == ref
    # Adapters the engine batches still run on it in the same model.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        assert patched_mixed(model, ps, ["code", "chat"]) == peft_mixed(model, ps, ["code", "chat"])
    with pytest.warns(UserWarning, match="DoRA"), pytest.raises(ValueError, match="DoRA"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, adapter_names=["dora", "math"])
    # (Nothing runs after this on the model: PEFT leaves its adapter_names hooks registered when its
    # generate raises, which breaks its own next forward as much as ours.)


@pytest.mark.parametrize(
    ("active", "names"),
    [
        (dict(target_modules=["embed_tokens", "q_proj"]), ["other", "__base__", "other", "__base__"]),
        # (PEFT raises naming "other" here: its lm_head wrapper holds the active adapter only)
        (
            dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
            ["active", "__base__", "active", "__base__"],
        ),
    ],
)
def test_an_active_adapter_the_engine_does_not_route_is_not_applied_to_other_rows(active, names):
    """The active adapter has LoRA on the embeddings (or its own lm_head copy), which PEFT's own forward
    applies to every token it runs: rows naming another adapter or "__base__" get none of it in PEFT's
    mixed batch, so such calls go to PEFT (they were served with the active adapter's part on every row)."""
    model = peft.get_peft_model(tiny_model(), lora_config(4, **active), adapter_name="active").eval()
    model.add_adapter("other", lora_config(4, ["q_proj", "v_proj"]))
    model.eval()
    ps = prompts(4)
    expected = peft_mixed(model, ps, names)
    hfaccel.patch(model, block_size=16, kv_cache_memory=8_000_000)
    ids, mask = left_padded(ps)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with pytest.warns(UserWarning, match="Embedding layer|modules_to_save of adapter 'active'"):
        out = model.generate(adapter_names=names, **kwargs)
    assert [row[ids.shape[1] :].tolist() for row in out] == expected
    # Naming the active adapter alone goes to PEFT too: it holds it (PEFT's mixed batch refuses some such
    # layers, DoRA on the embeddings or LoRA on parameters, where the engine would have served them).
    assert lora.unsupported_reason(model, ["active"] * 4) is not None
    per_prompt = hfaccel.generate(model, ps, adapter="__base__", max_new_tokens=NEW_TOKENS, do_sample=False)
    assert [c.token_ids for c in per_prompt] == peft_mixed(model, ps, ["__base__"] * 4)


def test_adapter_names_of_another_peft_method_go_to_peft():
    """IA3 (PEFT serves ``adapter_names`` there by applying the adapter to every row): PEFT's result, not
    an error calling its adapter unknown."""
    config = peft.IA3Config(
        target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]
    )
    model = peft.get_peft_model(tiny_model(), config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "ia3_l" in name:
                parameter.normal_(1.0, 0.5)
    ps = prompts(2)
    expected = peft_mixed(model, ps, ["default", "__base__"])
    hfaccel.patch(model, block_size=16, kv_cache_memory=8_000_000)
    with pytest.warns(UserWarning, match="ia3 adapters"):
        assert patched_mixed(model, ps, ["default", "__base__"]) == expected


def test_lora_layers_outside_engine_steps_are_untouched():
    """Plain forwards (another thread while the engine runs mixed adapters, and after) give PEFT's logits,
    and gradients flow as before."""
    model = patch_strict(lora_model())
    x = torch.tensor([prompts(1)[0]])
    with torch.no_grad():
        before = model(x).logits
    stop = threading.Event()
    diffs: list[float] = []

    def forwards() -> None:
        while not stop.is_set():
            with torch.no_grad():
                diffs.append(float((model(x).logits - before).abs().max()))

    thread = threading.Thread(target=forwards)
    thread.start()
    try:
        ps = prompts(6)
        hfaccel.generate(
            model, ps, adapter=["code", "chat", "__base__"] * 2, max_new_tokens=NEW_TOKENS, progress=False
        )
    finally:
        stop.set()
        thread.join()
    assert diffs and max(diffs) == 0.0
    model.train()
    loss = model(x, labels=x).loss
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "lora_A.math" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)


def test_lora_bias_is_served():
    model = lora_model()
    model.add_adapter("biased", lora_config(4, ["q_proj", "v_proj"], lora_bias=True))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B.biased.bias" in n:
                p.normal_(0.0, 0.5)
    model.eval()
    ps = prompts(3)
    names = ["biased", "code", "biased"]
    ref = peft_mixed(model, ps, names)
    assert ref != peft_mixed(model, ps, ["__base__", "code", "__base__"])
    patch_strict(model)
    assert patched_mixed(model, ps, names) == ref


def test_lora_on_the_lm_head_is_served_per_row():
    """The LM head sees only the step's logit rows: its LoRA is grouped by those, not by the packed
    tokens (it raised: "a LoRA layer saw 3 tokens in a step of 132")."""
    model = peft.get_peft_model(tiny_model(), lora_config(4, ["q_proj", "lm_head"]), adapter_name="x")
    model.add_adapter("y", lora_config(2, ["v_proj", "lm_head"]))
    model.eval()
    ps = prompts(4, seed=2)
    names = ["x", "y", "__base__", "y"]
    ref = peft_mixed(model, ps, names)
    assert ref != peft_mixed(model, ps, ["x", "x", "x", "x"])
    patch_strict(model)
    assert patched_mixed(model, ps, names) == ref
    completions = hfaccel.generate(model, ps, adapter=names, max_new_tokens=NEW_TOKENS, progress=False)
    assert [c.token_ids for c in completions] == ref


def test_trainable_tokens_on_the_embeddings_are_served():
    """``LoraConfig(trainable_token_indices=...)`` wraps embed_tokens in PEFT's TrainableTokensWrapper,
    whose vocabulary the engine read through the wrong attribute (an AttributeError at patch)."""
    config = lora_config(4, ["q_proj"], trainable_token_indices=[5, 6, 7])
    model = peft.get_peft_model(tiny_model(), config).eval()
    with torch.no_grad():  # the trained rows differ from the base's
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.normal_(0.0, 1.0)
    ps = [p[:36] + [5, 6, 7] for p in prompts(2, seed=3)]
    ref = peft_mixed(model, ps, ["default", "default"])
    assert ref != peft_mixed(model, ps, ["__base__", "__base__"]), "the trained tokens must matter"
    patch_strict(model)
    ids, mask = left_padded(ps)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert [row[ids.shape[1] :].tolist() for row in out] == ref


def test_prompt_learning_is_refused_at_patch_and_goes_to_peft_over_a_patched_base():
    """Prompt tuning adds learned virtual tokens to every sequence: patching such a PeftModel is refused;
    one made over a patched base puts its own prepare_inputs_for_generation on it, and its calls go to
    transformers' generate, which reads it (the virtual tokens were ignored, silently)."""
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5)
    torch.manual_seed(1)
    tuned = peft.get_peft_model(tiny_model(), config).eval()
    with pytest.raises(ValueError, match=r"PEFT's prompt learning \(adapter 'default'\) adds virtual tokens"):
        hfaccel.patch(tuned)
    base = tiny_model()
    reference = peft.get_peft_model(tiny_model(), config).eval()
    hfaccel.patch(base)
    model = peft.get_peft_model(base, config).eval()
    model.load_state_dict(reference.state_dict())
    kwargs = two_prompts_greedy()
    with pytest.warns(UserWarning, match="prepare_inputs_for_generation replaced on the model"):
        out = model.generate(**kwargs)
    expected = reference.generate(**kwargs)
    assert torch.equal(out, expected) and not torch.equal(expected, tiny_model().generate(**kwargs))
    # PEFT puts the base's own method back after its call (bound, on the instance): the base is served.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(base.generate(**kwargs), tiny_model().generate(**kwargs))
    hfaccel.unpatch(base)


def test_beam_search_with_an_adapter_goes_to_peft_with_the_adapter():
    """The engine's beams take no adapter: a beam prompt naming one falls back (PEFT applies it)."""
    model = lora_model()
    prompt = prompts(1, seed=3)[0]
    with pytest.warns(UserWarning, match="adapter_names with beam search"):
        done = hfaccel.generate(
            model, [prompt], adapter="chat", num_beams=2, max_new_tokens=NEW_TOKENS, progress=False
        )
    model.set_adapter("chat")
    with torch.no_grad():
        expected = type(model).generate(
            model, input_ids=torch.tensor([prompt]), num_beams=2, max_new_tokens=NEW_TOKENS, do_sample=False
        )
    model.set_adapter("math")
    row = expected[0, len(prompt) :].tolist()
    assert row[: len(done[0].token_ids)] == done[0].token_ids and done[0].token_ids


def test_a_peft_model_over_the_patched_base_falls_back_for_adapter_names():
    """TRL's flow with ``peft_config``: the base model patched, then wrapped by PEFT. The PeftModel takes
    ``adapter_names`` out of the call and hands them to its layers through forward hooks, which a packed
    engine step cannot satisfy: the call goes to transformers (with the reason), and later calls are
    served again."""
    base = hfaccel.patch(tiny_model(), kv_cache_memory=8_000_000)
    model = peft.get_peft_model(base, lora_config(**ADAPTERS["math"]), adapter_name="math").eval()
    model.add_adapter("code", lora_config(**ADAPTERS["code"]))
    reference = peft.get_peft_model(tiny_model(), lora_config(**ADAPTERS["math"]), adapter_name="math").eval()
    reference.add_adapter("code", lora_config(**ADAPTERS["code"]))
    reference.load_state_dict(model.state_dict())
    ids, mask = left_padded(prompts(3))
    names = ["math", "code", "__base__"]
    ask = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
    with pytest.warns(UserWarning, match="a PeftModel over the patched base handing them in"):
        out = model.generate(**ask, adapter_names=names)
    assert torch.equal(out, reference.generate(**ask, adapter_names=names))
    assert not any(m._forward_pre_hooks for m in model.modules())  # PEFT removed its hooks
    assert torch.equal(model.generate(**ask), reference.generate(**ask))


def test_an_adapter_call_the_engine_cannot_serve_on_a_patched_base_says_to_patch_the_peft_model():
    """``hfaccel.generate(base, adapter=...)`` over the base model of a PeftModel, where the call must go
    to transformers (LoRA on the embeddings): transformers' own generate takes no adapter_names (its
    message: "model_kwargs are not used"); only the PeftModel's does."""
    model = lora_model()
    model.add_adapter("emb", lora_config(4, ["embed_tokens", "q_proj"]))
    base = hfaccel.patch(model.base_model.model, kv_cache_memory=8_000_000)
    try:
        with pytest.raises(hfaccel.RequestError, match="patch a PeftModel, not its base model"):
            hfaccel.generate(base, prompts(2), adapter=["emb", "math"], max_new_tokens=2, progress=False)
    finally:
        hfaccel.unpatch(base)


ALORA = "alora_invocation_tokens" in getattr(peft.LoraConfig, "__dataclass_fields__", {})


@pytest.mark.skipif(not ALORA, reason="this PEFT has no aLoRA")
def test_an_active_alora_adapter_goes_to_peft_with_its_reason():
    """An aLoRA adapter turns on at each row's invocation tokens, offsets PEFT's generate finds per row:
    a patched PeftModel with one active gave other tokens silently (the engine's steps carry no rows)."""
    invoke = [77, 78, 79]
    config = lora_config(4, ["q_proj", "v_proj", "o_proj", "up_proj"], alora_invocation_tokens=invoke)
    model = peft.get_peft_model(tiny_model(), config).eval()
    prompts = torch.tensor(
        [[5, 17, 99, 123, 45, 200, 31, *invoke, 11, 12], [8, 9, 10, 40, 41, 42, 43, *invoke, 13, 14]]
    )
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        expected = model.generate(input_ids=prompts, **kwargs)
    hfaccel.patch(model)
    try:
        with pytest.warns(UserWarning, match="the aLoRA adapter 'default'"):
            assert torch.equal(model.generate(input_ids=prompts, **kwargs), expected)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.skipif(not ALORA, reason="this PEFT has no aLoRA")
def test_peft_over_a_patched_base_with_alora_goes_to_peft_and_leaves_the_base_usable():
    """TRL's order (patch the base, then PEFT wraps it): PEFT's generate hands each LoRA layer the rows'
    aLoRA offsets through a pre-hook, which a packed step broke (an IndexError, and PEFT left its hooks
    on the layers, so the base failed after)."""
    invoke = [77, 78, 79]
    base = tiny_model()
    prompts = torch.tensor([[5, 17, 99, 123, *invoke, 11, 12], [8, 9, 10, 40, *invoke, 13, 14]])
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    config = lora_config(4, ["q_proj", "v_proj"], alora_invocation_tokens=invoke)
    reference = peft.get_peft_model(tiny_model(), config).eval()
    hfaccel.patch(base)
    try:
        model = peft.get_peft_model(base, config).eval()
        model.load_state_dict(reference.state_dict())
        with torch.no_grad():
            expected = reference.generate(input_ids=prompts, **kwargs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert torch.equal(model.generate(input_ids=prompts, **kwargs), expected)
            base.generate(input_ids=prompts, **kwargs)  # still served after
    finally:
        hfaccel.unpatch(base)


def test_a_patched_peft_tuner_serves_the_peft_models_calls_and_its_own():
    """Patching ``peft_model.base_model`` (the LoraModel): PEFT's generate puts its pass-through
    prepare_inputs_for_generation on it for the call (LoRA adds no tokens) and the wrapped model's back
    after it; both prepare what the model's own would, so both calls are served, with PEFT's tokens."""
    model = lora_model()
    kwargs = two_prompts_greedy()
    expected = model.generate(**kwargs)
    tuner = model.base_model
    hfaccel.patch(tuner, block_size=16, kv_cache_memory=8_000_000)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback
            assert torch.equal(model.generate(**kwargs), expected)
            engine = tuner._hfaccel.get_engine(tuner)
            steps = engine.num_generated_tokens
            assert steps > 0
            assert torch.equal(tuner.generate(**kwargs), expected)
            assert engine.num_generated_tokens > steps
    finally:
        hfaccel.unpatch(tuner)


def test_a_users_prepare_inputs_on_the_model_a_patched_tuner_wraps_falls_back():
    """PEFT's generate on a tuner runs the wrapped model's generate, which calls the wrapped model's own
    ``prepare_inputs_for_generation``: a user's there is honoured (the call goes to transformers)."""
    import types

    def first_token_only(self, input_ids, **kwargs):
        inputs = type(self).prepare_inputs_for_generation(self, input_ids, **kwargs)
        inputs["input_ids"] = inputs["input_ids"][:, :1].expand_as(inputs["input_ids"]).contiguous()
        return inputs

    model = lora_model()
    inner = model.base_model.model
    inner.prepare_inputs_for_generation = types.MethodType(first_token_only, inner)
    kwargs = two_prompts_greedy()
    expected = model.generate(**kwargs)
    tuner = model.base_model
    hfaccel.patch(tuner, block_size=16, kv_cache_memory=8_000_000)
    try:
        with pytest.warns(UserWarning, match="prepare_inputs_for_generation replaced"):
            assert torch.equal(model.generate(**kwargs), expected)
    finally:
        hfaccel.unpatch(tuner)
