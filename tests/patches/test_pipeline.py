"""Text-generation pipelines over many inputs run as one continuous batch, whatever their batch_size."""

import pytest
from transformers import TextGenerationPipeline, pipeline

import hfaccel
from tests.helpers import tiny_model, tiny_tokenizer

MAX_NEW = 24


def chats(count=16):
    return [[{"role": "user", "content": f"question {i}: " + "why? " * (i % 5)}] for i in range(count)]


def test_default_batch_size_runs_the_list_as_one_batch():
    """With the default batch_size of 1 the items still share the engine's steps: most of them run in
    one step together (one at a time, transformers' way, would give steps of one sequence). Counted by
    the widest step, not the number of steps: how fast the workers hand their calls in decides the
    latter, and a faster step left some more steps to the first items alone."""
    tokenizer = tiny_tokenizer()
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    engine = model._hfaccel.get_engine(model)
    kwargs = {"max_new_tokens": MAX_NEW, "do_sample": False}

    batched = pipe(chats(), batch_size=16, **kwargs)
    engine.step_stats.clear()
    default = pipe(chats(), **kwargs)
    assert default == batched
    assert max(stats.num_seqs for stats in engine.step_stats) >= 12
    single = [pipe(chat, **kwargs) for chat in chats(3)]  # one input at a time: the plain path
    assert single == default[:3]
    assert model._hfaccel.loop.wait_idle(5) and engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("fall_back", [False, True])
def test_a_sampled_pipeline_is_reproducible_under_manual_seed(fall_back):
    """The items' generate calls run in worker threads: their seeds come from one base drawn in the
    calling thread, so which worker draws first does not decide which prompt gets which stream. Under
    autocast every item's call falls back to transformers, and draws from its item's seed too
    (`seeded_calls`), not from the global generator the workers race for."""
    import warnings
    from contextlib import nullcontext

    import torch

    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    pipe = pipeline("text-generation", model=model, tokenizer=tiny_tokenizer())
    texts = ["Hello world", "ab", "The quick brown fox", "x", "Lorem ipsum dolor sit amet"] * 2
    runs = []
    for _ in range(3):
        torch.manual_seed(123)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if fall_back else nullcontext()
        with autocast, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runs.append([out[0]["generated_text"] for out in pipe(texts, max_new_tokens=8, do_sample=True)])
    assert all(run == runs[0] for run in runs)
    assert len(set(runs[0])) > 5  # the repeated prompts were sampled apart


def test_an_unpatched_models_pipeline_is_left_alone():
    tokenizer = tiny_tokenizer()
    patched = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)  # installs the class-wide wrapper
    plain = tiny_model()
    kwargs = {"max_new_tokens": 6, "do_sample": False}
    ours = pipeline("text-generation", model=patched, tokenizer=tokenizer)(chats(4), **kwargs)
    theirs = pipeline("text-generation", model=plain, tokenizer=tokenizer)(chats(4), **kwargs)
    assert ours == theirs
    assert TextGenerationPipeline.get_iterator.__wrapped__ is not None
    assert "_hfaccel" not in plain.__dict__


def test_a_generator_input_streams_through_a_bounded_window():
    tokenizer = tiny_tokenizer()
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000, max_num_seqs=4)  # window of 8 calls
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    kwargs = {"max_new_tokens": 4, "do_sample": False}
    expected = pipe(chats(20), **kwargs)
    lazily = list(pipe((chat for chat in chats(20)), **kwargs))
    assert lazily == expected


def test_a_shared_streamer_or_stateful_processor_sees_the_items_one_after_another():
    """A streamer, or the user's own processor, passed to a pipeline over a list is called item after
    item in transformers (prompt, tokens, end; then the next item): the items then run one at a time, and
    both see exactly transformers' calls (they interleaved across the concurrent items before)."""
    from transformers import LogitsProcessor
    from transformers.generation.streamers import BaseStreamer

    class Recorder(BaseStreamer):
        def __init__(self) -> None:
            self.calls: list[object] = []

        def put(self, value) -> None:
            self.calls.append(value.tolist())

        def end(self) -> None:
            self.calls.append("end")

    class Lengths(LogitsProcessor):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def __call__(self, input_ids, scores):
            self.lengths.append(input_ids.shape[-1])
            return scores

    tokenizer = tiny_tokenizer()
    seen = []
    for model in (tiny_model(), hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)):
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        streamer, lengths = Recorder(), Lengths()
        texts = pipe(chats(4), max_new_tokens=5, do_sample=False, streamer=streamer)
        pipe(chats(4), max_new_tokens=5, do_sample=False, logits_processor=[lengths])
        seen.append((texts, streamer.calls, lengths.lengths))
    assert seen[0] == seen[1]
    assert seen[0][1].count("end") == 4


@pytest.mark.slow
def test_smollm2_pipeline_default_batch_size_shares_steps(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    from hfaccel.bench.workloads import QUESTIONS

    inputs = [[{"role": "user", "content": q}] for q in QUESTIONS[:16]]
    hfaccel.patch(model)
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        engine = model._hfaccel.get_engine(model)
        before = engine.num_steps
        batched = pipe(inputs, batch_size=16, max_new_tokens=12, do_sample=False)
        batched_steps = engine.num_steps - before
        before = engine.num_steps
        default = pipe(inputs, max_new_tokens=12, do_sample=False)
        default_steps = engine.num_steps - before
        assert default == batched
        assert default_steps <= 1.5 * batched_steps, (default_steps, batched_steps)
    finally:
        hfaccel.unpatch(model)


def test_autocast_around_a_pipeline_or_a_call_gives_transformers_tokens():
    """``torch.autocast`` is thread-local: the pipeline's workers run under the caller's, and a call made
    under it goes to transformers (the engine's steps run outside it), with a warning: the scores are
    HF's bfloat16 ones (they were float32, silently)."""
    import torch

    tokenizer = tiny_tokenizer()
    reference = tiny_model()
    model = hfaccel.patch(tiny_model(), kv_cache_memory=4_000_000)
    kwargs = {"max_new_tokens": 6, "do_sample": False, "return_dict_in_generate": True, "output_scores": True}
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference.generate(ids, **kwargs)
        with pytest.warns(UserWarning, match=r"torch.autocast\('cpu', torch.bfloat16\) around the call"):
            out = model.generate(ids, **kwargs)
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        piped = pipe(["Hello there", "Count: a b c", "xyz"], **kwargs)
        plain = pipeline("text-generation", model=reference, tokenizer=tokenizer)
        expected_piped = plain(["Hello there", "Count: a b c", "xyz"], **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, expected.scores))
    for ours, theirs in zip(piped, expected_piped):
        assert torch.equal(torch.tensor(ours[0]["scores"]), torch.tensor(theirs[0]["scores"]))
