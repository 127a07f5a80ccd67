"""The public API: patch / unpatch / generate."""

import importlib
import warnings

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

import hfaccel
from hfaccel.config import EngineConfig
from tests.helpers import EOS, assert_same_or_near_tie, hf_greedy, tiny_model, varied_prompts


def test_public_names():
    assert sorted(hfaccel.__all__) == [
        "Completion",
        "EngineConfig",
        "LoopClosed",
        "RequestError",
        "StreamEvent",
        "agenerate",
        "astream",
        "check",
        "engine_state",
        "generate",
        "group_by_prompt",
        "patch",
        "plot_cost_model",
        "plot_run",
        "release",
        "reset_prefix_cache",
        "serve",
        "stream",
        "unpatch",
    ]
    assert callable(hfaccel.serve) and hfaccel.serve.__module__ == "hfaccel.server.server"  # loaded when used
    for name in hfaccel.__all__:  # each lazy name is its home's object (the names are listed once there)
        home = hfaccel._HOMES.get(name, "hfaccel.server")
        assert getattr(hfaccel, name) is getattr(importlib.import_module(home), name), name
    api = importlib.import_module("hfaccel.api")
    assert {n for n, home in hfaccel._HOMES.items() if home == "hfaccel.api"} <= set(api.__all__)


def test_patch_is_idempotent_and_unpatch_restores_exactly():
    model = tiny_model()
    original_attn = model.config._attn_implementation
    assert "generate" not in model.__dict__
    assert hfaccel.patch(model) is model
    bound = model.generate
    assert hfaccel.patch(model) is model and model.generate is bound
    hfaccel.patch(model, block_size=32, strict=True)
    hfaccel.patch(model)  # keeps what was set
    assert model._hfaccel.config.block_size == 32 and model._hfaccel.strict
    hfaccel.unpatch(model)
    assert "generate" not in model.__dict__ and not hasattr(model, "_hfaccel")
    assert model.generate.__func__ is type(model).generate
    assert model.config._attn_implementation == original_attn
    hfaccel.unpatch(model)  # a second unpatch is a no-op
    ids = torch.tensor([[5, 6, 7]])  # a bound generate kept from before is transformers' now
    assert torch.equal(bound(ids, max_new_tokens=3), type(model).generate(model, ids, max_new_tokens=3))


def test_patch_rejects_bad_config_and_non_models():
    model = tiny_model()
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        hfaccel.patch(model, block_size=0)
    assert not hasattr(model, "_hfaccel")
    with pytest.raises(ValueError, match="expects a transformers causal-LM model"):
        hfaccel.patch(torch.nn.Linear(2, 2))


def test_generate_in_prompt_order_with_per_prompt_configs():
    model = tiny_model()
    prompts = varied_prompts(16)
    lengths = [1 + (i * 7) % 13 for i in range(16)]
    configs = [GenerationConfig(max_new_tokens=n, do_sample=False) for n in lengths]
    completions = hfaccel.generate(model, prompts, generation_config=configs, progress=False)
    assert not hasattr(model, "_hfaccel"), "an unpatched model is restored after the call"
    for prompt, n, c in zip(prompts, lengths, completions):
        ref = hf_greedy(model, prompt, n)
        assert c.prompt_token_ids == prompt
        assert_same_or_near_tie(model, prompt, c.token_ids, ref)
        assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
        assert c.text is None
        assert c.metrics["ttft_s"] > 0 and c.metrics["e2e_s"] >= c.metrics["ttft_s"]


def test_generate_on_a_patched_model_keeps_it_patched_and_its_config():
    model = hfaccel.patch(tiny_model(), EngineConfig(block_size=4, kv_cache_memory=1_000_000))
    out = hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=3, progress=False)
    assert len(out[0].token_ids) <= 3 and model._hfaccel.engine.config.block_size == 4


def test_call_level_errors_raise_before_anything_runs():
    model = tiny_model()
    assert hfaccel.generate(model, []) == []
    with pytest.raises(ValueError, match="prompts is a dict"):
        hfaccel.generate(model, {"input_ids": [[5, 6]]}, progress=False)
    with pytest.raises(ValueError, match="generation_config has 1 entries for 2 prompts"):
        hfaccel.generate(model, [[5], [6]], generation_config=[GenerationConfig()], progress=False)
    with pytest.raises(ValueError, match="errors must be 'raise' or 'return'"):
        hfaccel.generate(model, [[5]], errors="ignore")
    assert not hasattr(model, "_hfaccel")


BAD = [
    ([], {}, "the prompt is empty"),
    ("hello", {}, "a string prompt needs tokenizer="),
    ([5] * 600, {}, r"max_model_len"),
    ([5, 6], {"max_new_tokens": -1}, "max_new_tokens"),
    ([5, 6], {"do_sample": True, "temperature": -0.5}, "temperature must be a strictly positive float"),
    ([5, 6], {"do_sample": True, "top_p": -0.5}, r"top_p must be >= 0"),
    ([5, 6], {"do_sample": True, "temperature": "0.5"}, r"temperature must be a number, got '0.5' \(str\)"),
    ([5, 6], {"do_sample": True, "top_k": 2.5}, r"top_k must be an integer, got 2.5 \(float\)"),
    ([5, 6], {"num_beams": 0}, "num_beams must be >= 1, got 0"),
    ([5, 6], {"do_sample": True, "top_k": -3}, "top_k must be >= 0"),
    ([5, 6], {"do_sample": True, "num_return_sequences": -1}, "num_return_sequences must be >= 1"),
]


@pytest.mark.parametrize(("prompt", "kwargs", "message"), BAD, ids=[b[2][:30] for b in BAD])
def test_a_bad_request_fails_alone_and_the_others_complete(prompt, kwargs, message):
    model = tiny_model()
    good = [[5, 6, 7], [9, 10]]
    bad_config = GenerationConfig(max_new_tokens=4)
    for name, value in kwargs.items():  # set after construction: GenerationConfig() refuses some at once
        setattr(bad_config, name, value)
    configs = [GenerationConfig(max_new_tokens=4), bad_config, GenerationConfig(max_new_tokens=4)]
    with pytest.raises(
        hfaccel.RequestError, match=r"1 of 3 requests refused.*prompts\[1\]: .*" + message
    ) as info:
        hfaccel.generate(model, [good[0], prompt, good[1]], generation_config=configs, progress=False)
    assert isinstance(info.value, ValueError)
    results = info.value.completions
    assert results[1].finish_reason == "error" and results[1].token_ids == []
    assert results[0].token_ids == hf_greedy(model, good[0], 4)
    assert results[2].token_ids == hf_greedy(model, good[1], 4)
    returned = hfaccel.generate(
        model, [good[0], prompt, good[1]], generation_config=configs, progress=False, errors="return"
    )
    assert [c.finish_reason == "error" for c in returned] == [False, True, False]
    assert not hasattr(model, "_hfaccel")


def test_a_sampling_setting_a_greedy_call_does_not_read_may_be_any_number_as_in_transformers():
    """HF reads top_k only when sampling: a greedy call with top_k=2.5 runs, with HF's tokens (a string
    there is refused, named: HF's own validation fails on one with a bare TypeError)."""
    model = tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own: top_k is set but do_sample is not
        completion = hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=4, top_k=2.5, progress=False)[0]
        assert completion.token_ids == hf_greedy(model, [5, 6, 7], 4)
        with pytest.raises(ValueError, match=r"top_k must be a number, got '5' \(str\)"):
            hfaccel.generate(model, [[5, 6, 7]], max_new_tokens=4, top_k="5", progress=False)


@pytest.mark.parametrize("top_p", [1.5, float("nan")])
def test_a_top_p_of_one_or_more_filters_nothing_as_in_transformers(top_p):
    """transformers builds no top-p warper unless top_p < 1: 1.5 (or NaN) samples as 1.0 does."""
    model = tiny_model()
    prompts = varied_prompts(2, seed=4)
    kwargs = {"max_new_tokens": 8, "do_sample": True, "seed": 11, "progress": False}
    expected = [c.token_ids for c in hfaccel.generate(model, prompts, top_p=1.0, **kwargs)]
    assert [c.token_ids for c in hfaccel.generate(model, prompts, top_p=top_p, **kwargs)] == expected


def test_stream_yields_every_token_of_every_request():
    model = tiny_model()
    prompts = varied_prompts(5, seed=9)
    events = list(hfaccel.stream(model, prompts, max_new_tokens=6))
    for index, prompt in enumerate(prompts):
        tokens = [e.token_id for e in events if e.index == index]
        assert tokens == hf_greedy(model, prompt, 6)
        finals = [e for e in events if e.index == index and e.finished]
        assert len(finals) == 1 and finals[0].token_id == tokens[-1]
    assert len({e.index for e in events[:5]}) > 1, "requests interleave: one batch, not one after another"


def test_closing_a_stream_early_cancels_the_rest():
    model = hfaccel.patch(tiny_model(), kv_cache_memory=1_000_000)
    iterator = hfaccel.stream(model, varied_prompts(4), max_new_tokens=50, min_new_tokens=50)
    next(iterator)
    iterator.close()
    engine = model._hfaccel.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_a_prompt_that_falls_back_gets_what_hf_generate_gives_by_default():
    # guidance_scale is served by HF only: the call falls back with a warning. With no length given, HF's
    # own default applies (the prepared config's max_length=20 passed on would have cut it to 20 total).
    import copy

    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    prompt = list(range(5, 20))
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), guidance_scale=1.5)[0, len(prompt) :].tolist()
    hfaccel.patch(model)
    with pytest.warns(UserWarning, match="falls back"):
        (completion,) = hfaccel.generate(model, [prompt], guidance_scale=1.5, progress=False)
    assert completion.token_ids == expected and len(expected) == 20


def test_fallen_back_copies_lose_hf_padding_and_say_they_stopped():
    # HF pads copies that a stop string ended before the longest one: a completion holds no pad ids.
    import copy
    import warnings

    from tests.helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_model("llama")
    reference = copy.deepcopy(model)
    kwargs = dict(
        max_new_tokens=12, do_sample=True, num_return_sequences=4, stop_strings=["e", "a", "o", "i"]
    )
    ids = tokenizer("Hello world").input_ids
    torch.manual_seed(1)
    with torch.no_grad():
        rows = reference.generate(torch.tensor([ids]), tokenizer=tokenizer, guidance_scale=1.5, **kwargs)
    hfaccel.patch(model)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        completions = hfaccel.generate(
            model, [ids], tokenizer=tokenizer, guidance_scale=1.5, progress=False, **kwargs
        )
    longest = rows.shape[1] - len(ids)
    padded = 0
    for row, completion in zip(rows, completions):
        new = row[len(ids) :].tolist()
        while new and new[-1] == model.generation_config.pad_token_id:
            new.pop()
            padded += 1
        assert completion.token_ids == new
        assert completion.finish_reason == ("stop" if len(new) < longest else completion.finish_reason)
    assert padded, "no copy stopped early: the case shows nothing"


def test_fallen_back_rows_keep_their_own_tokens():
    """HF pads only a copy that stopped before the longest one: one row's last tokens equal to the pad id
    are its own (they were dropped as padding), and with pad id = EOS a copy a stop string ended is
    padded with EOS, which is not a token it generated (it was kept as one)."""
    from transformers import GenerationConfig

    from hfaccel.api.planning import unpadded_copies
    from tests.helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = GenerationConfig(eos_token_id=2, pad_token_id=9)
    assert unpadded_copies(torch.tensor([[5, 6, 7, 9, 9]]), 3, config, None) == [([9, 9], "length")]
    ids = tokenizer("xyab").input_ids
    config = GenerationConfig(eos_token_id=2, pad_token_id=2, stop_strings=["b"])
    rows = torch.tensor([ids + [2, 2], ids[:2] + [3, 3, 3, 3]])  # prompt "xy"; "ab", then EOS padding
    assert unpadded_copies(rows, 2, config, tokenizer)[0] == (ids[2:], "stop")


def test_a_sampled_prompt_that_falls_back_is_reproducible_under_its_seed():
    """The seed of `hfaccel.generate` seeds transformers' generate when a prompt falls back (it drew
    from the global generator, whatever it held), and the caller's random state is left as it was."""
    import warnings

    model = hfaccel.patch(tiny_model("llama"))
    kwargs = dict(max_new_tokens=6, do_sample=True, guidance_scale=1.5, progress=False)
    runs = []
    for global_seed in (0, 1):
        expected_next = torch.rand((), generator=torch.Generator().manual_seed(global_seed))
        torch.manual_seed(global_seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append(hfaccel.generate(model, [[5, 6, 7]], seed=123, **kwargs)[0].token_ids)
        assert torch.rand(()) == expected_next  # the caller's random state, untouched
    assert runs[0] == runs[1]


def test_check_says_what_of_a_model_the_engine_serves_before_it_runs():
    from hfaccel.bench.families import family_model

    model = tiny_model("llama")
    report = hfaccel.check(model)
    assert getattr(model, "_hfaccel", None) is None and "generate" not in model.__dict__  # nothing patched
    assert report.served and report.reason is None and report.layers == {"full_attention": 2}
    assert report.needs == [] and report.backend == "torch" and report.backends["torch"] is None
    assert "served on the engine: 2 full_attention" in str(report)
    assert "KV memory: grows with the sequence" in str(report)
    assert "every layer slides" in hfaccel.check(family_model("mistral")).kv_memory
    mixed = ["sliding_attention", "full_attention", "sliding_attention"]
    pooled = hfaccel.check(family_model("gemma3_text", num_hidden_layers=3, layer_types=mixed)).kv_memory
    assert pooled.startswith("the 2 sliding layers' bounded by their window (8 positions), in a pool")
    sinks = hfaccel.check(family_model("gpt_oss"))
    assert sinks.served and sinks.needs == ["attention_sinks", "sliding_window"]
    assert sinks.backends["triton"] == "the triton backend does not serve attention sinks"
    refused = hfaccel.check(family_model("minimax"))  # lightning attention: no state to hand it
    assert not refused.served and "linear-attention" in refused.reason
    assert "refused at patch" in str(refused)
    recurrent = hfaccel.check(family_model("mamba2"))
    if hasattr(DynamicCache, "get_conv_state"):  # 5.21 on: Mamba's state through the linear-attention API
        assert recurrent.served
        assert "attention: none (every layer is recurrent)" in str(recurrent)
        state = "a fixed-size state per sequence in the 4 recurrent layers"
        assert recurrent.kv_memory == f"none (no layer attends): {state}"
    else:
        assert "cache API" in recurrent.reason


def test_streamed_deltas_never_show_half_a_character(smollm2):
    """A character whose UTF-8 bytes span tokens (SmolLM2's byte-level BPE splits each of these Japanese
    characters in two) decodes to U+FFFD until its last token comes: such text is held back, never sent,
    and the deltas join to the whole text."""
    from types import SimpleNamespace

    from hfaccel.api.streaming import StreamEvents

    _, tokenizer = smollm2
    text = "おはよう、日本"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert "\ufffd" in tokenizer.decode(ids[:1]), "the first character must span tokens"
    events = StreamEvents(SimpleNamespace(plans=[], prompt_indexes=[0]), tokenizer)
    deltas = [events._event(0, token, k == len(ids) - 1, None).text for k, token in enumerate(ids)]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert deltas[0] == "" and deltas[1] == "お"


class _Broken:
    """A logits processor that returns what no processor should, on the rows of one prompt."""

    def __init__(self, result):
        self.result = result

    def __call__(self, input_ids, scores):
        return self.result(scores)


@pytest.mark.parametrize(
    "result",
    [
        lambda scores: scores[:, :10],
        lambda scores: None,
        lambda scores: scores.tolist(),
        lambda scores: 1 / 0,
    ],
    ids=["narrowed", "None", "a list", "raises"],
)
def test_a_processor_that_fails_fails_its_own_call_while_concurrent_callers_complete(result):
    """Another caller's bad processor output failed every request of the step (its shape checked only
    where the scores were written back); with errors="return" the call's other prompts come back too."""
    import threading

    from transformers import LogitsProcessorList

    model = hfaccel.patch(tiny_model())
    prompts = varied_prompts(4, seed=4)
    results, errors = {}, {}

    def good(index):
        results[index] = hfaccel.generate(model, [prompts[index]], max_new_tokens=8, progress=False)

    try:
        threads = [threading.Thread(target=good, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        processors = LogitsProcessorList([_Broken(result)])
        try:
            hfaccel.generate(
                model, [prompts[3]], max_new_tokens=8, progress=False, logits_processor=processors
            )
        except Exception as error:
            errors["bad"] = error
        for thread in threads:
            thread.join(60)
        assert "bad" in errors
        for index in range(3):
            assert results[index][0].token_ids == hf_greedy(model, prompts[index], 8)
        returned = hfaccel.generate(
            model, prompts[:2], max_new_tokens=8, progress=False, errors="return", logits_processor=processors
        )
        assert [c.finish_reason for c in returned] == ["error", "error"] and returned[0].error
        assert model._hfaccel.loop.wait_idle(5) and model._hfaccel.engine.block_manager.num_used_blocks == 0
    finally:
        hfaccel.unpatch(model)


def test_errors_return_gives_back_the_prompts_whose_own_processor_raised_beside_the_others():
    from transformers import LogitsProcessorList

    model = tiny_model()
    prompts = varied_prompts(3, seed=5)

    def only_on(prompt):
        def processor(input_ids, scores):
            if input_ids[0, : len(prompt)].tolist() == prompt:
                raise ValueError("boom")
            return scores

        return processor

    completions = hfaccel.generate(
        model, prompts, max_new_tokens=6, progress=False, errors="return",
        logits_processor=LogitsProcessorList([only_on(prompts[1])]),
    )  # fmt: skip
    assert [c.finish_reason == "error" for c in completions] == [False, True, False]
    assert "boom" in completions[1].error
    assert completions[0].token_ids == hf_greedy(model, prompts[0], 6)
    assert completions[2].token_ids == hf_greedy(model, prompts[2], 6)


def test_sampling_from_nan_scores_raises_as_transformers_does():
    from transformers import LogitsProcessorList

    model = tiny_model()

    def nan_after_two(input_ids, scores):
        return scores.fill_(float("nan")) if input_ids.shape[1] > 5 else scores

    kwargs = {
        "max_new_tokens": 6,
        "do_sample": True,
        "logits_processor": LogitsProcessorList([nan_after_two]),
    }
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        model.generate(torch.tensor([[5, 6, 7, 8]]), **kwargs)  # transformers' own
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        hfaccel.generate(model, [[5, 6, 7, 8]], progress=False, **kwargs)


def test_errors_return_still_raises_a_fault_of_the_step():
    """errors="return" is for a request's own failures; a failed forward (here injected) fails the step's
    requests and the call raises, as with errors="raise"."""
    model = hfaccel.patch(tiny_model())
    engine = model._hfaccel.get_engine(model)
    run, calls = engine.runner.run, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("an injected device fault")
        return run(*args, **kwargs)

    engine.runner.run = failing
    try:
        with pytest.raises(RuntimeError, match="an injected device fault"):
            hfaccel.generate(model, varied_prompts(3), max_new_tokens=5, progress=False, errors="return")
    finally:
        engine.runner.run = run
        hfaccel.unpatch(model)


def test_a_failed_requests_outputs_stop_at_its_last_token_and_a_flat_row_is_taken():
    """The step a request fails in records nothing for it (its logprobs had one entry too many); a
    processor that returns the row flat (``[V]`` for a batch of one) is read as transformers' greedy
    search reads it."""
    from transformers import LogitsProcessorList

    model = tiny_model()

    def nan_after_two(input_ids, scores):
        return scores.fill_(float("nan")) if input_ids.shape[1] > 5 else scores

    failed = hfaccel.generate(
        model, [[5, 6, 7, 8]], max_new_tokens=6, do_sample=True, logprobs=True, progress=False, errors="return",
        logits_processor=LogitsProcessorList([nan_after_two]),
    )[0]  # fmt: skip
    assert failed.finish_reason == "error" and len(failed.logprobs) == len(failed.token_ids) == 2

    def flat(input_ids, scores):
        return scores[0]

    ids = torch.tensor([[5, 6, 7, 8]])
    expected = model.generate(
        ids, max_new_tokens=5, do_sample=False, logits_processor=LogitsProcessorList([flat])
    )
    hfaccel.patch(model)
    try:
        out = model.generate(
            ids, max_new_tokens=5, do_sample=False, logits_processor=LogitsProcessorList([flat])
        )
        assert torch.equal(out, expected)
    finally:
        hfaccel.unpatch(model)


def test_speculative_verification_of_nan_scores_raises_too():
    from transformers import LogitsProcessorList

    model = hfaccel.patch(tiny_model(), speculative="ngram", num_speculative_tokens=3)

    def nan_late(input_ids, scores):
        return scores.fill_(float("nan")) if input_ids.shape[1] > 14 else scores

    try:
        with pytest.raises(
            RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"
        ):
            hfaccel.generate(
                model, [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]], max_new_tokens=12, do_sample=True, progress=False,
                logits_processor=LogitsProcessorList([nan_late]),
            )  # fmt: skip
    finally:
        hfaccel.unpatch(model)


def test_a_call_warns_about_transformers_default_length_once_not_per_prompt():
    """transformers warns about its default max_length (naming each prompt's) for every prompt it
    prepares; a call of many prompts says it once, as one generate call does."""
    import warnings

    model = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hfaccel.generate(model, [[5, 6], [7, 8, 9], [10], [11, 12, 13, 14]], progress=False)
    assert len([w for w in caught if "model-agnostic default `max_length`" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as caught:  # a prompt with its own length does not count
        warnings.simplefilter("always")
        configs = [GenerationConfig(max_new_tokens=3), GenerationConfig()]
        hfaccel.generate(model, [[5, 6], [7, 8, 9]], generation_config=configs, progress=False)
    assert len([w for w in caught if "model-agnostic default `max_length`" in str(w.message)]) == 1
