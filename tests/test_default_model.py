"""The real SmolLM2-135M-Instruct: patched generate, hfaccel.generate and pipelines against HF."""

import pytest
import torch
from transformers import pipeline

import hfaccel
from hfaccel.bench.workloads import QUESTIONS
from tests.helpers import assert_same_or_near_tie

pytestmark = pytest.mark.slow
MAX_NEW = 24


def chat_ids(tokenizer, question):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(rendered["input_ids"])


def test_patched_generate_matches_hf_on_chat_prompts(smollm2):
    model, tokenizer = smollm2
    prompts = [chat_ids(tokenizer, q) for q in QUESTIONS]  # 16 prompts, several longer than a block
    prompts.append(prompts[0][:])  # an identical prompt
    prompts.append([tokenizer.bos_token_id or 1])  # a one-token prompt
    generate = type(model).generate
    with torch.no_grad():
        refs = [
            generate(model, torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]
    hfaccel.patch(model)
    try:
        tokenizer.padding_side = "left"
        batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
        out = model.generate(**batch, max_new_tokens=MAX_NEW, do_sample=False)
        width = batch["input_ids"].shape[1]
        completions = hfaccel.generate(
            model, prompts, max_new_tokens=MAX_NEW, tokenizer=tokenizer, progress=False
        )
        for i, (prompt, ref) in enumerate(zip(prompts, refs)):
            assert_same_or_near_tie(model, prompt, out[i, width : width + len(ref)].tolist(), ref, eps=1e-3)
            assert_same_or_near_tie(model, prompt, completions[i].token_ids, ref, eps=1e-3)
        assert "Paris" in completions[0].text
    finally:
        hfaccel.unpatch(model)


def test_pipeline_gives_the_unpatched_greedy_text(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:4]]
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    ref = [pipe(c, max_new_tokens=16, do_sample=False)[0]["generated_text"][-1]["content"] for c in chats]
    hfaccel.patch(model)
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        ours = [
            pipe(c, max_new_tokens=16, do_sample=False)[0]["generated_text"][-1]["content"] for c in chats
        ]
        batched = pipe(chats, max_new_tokens=16, do_sample=False, batch_size=4)
        assert ours == ref
        assert [b[0]["generated_text"][-1]["content"] for b in batched] == ref
        assert model._hfaccel.engine.num_steps > 0, "the pipeline ran on the engine"
    finally:
        hfaccel.unpatch(model)


def test_pipeline_options_match_the_unpatched_pipeline(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    prompts = ["The capital of France is", "My favourite fruit is", "Water boils at"]
    kwargs = {"max_new_tokens": 12, "do_sample": False, "return_full_text": False}
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    ref = pipe(prompts, **kwargs)
    hfaccel.patch(model)
    try:
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
        assert pipe(prompts, **kwargs) == ref
        assert pipe(prompts, batch_size=3, **kwargs) == ref
        full = pipe(prompts[0], max_new_tokens=12, do_sample=False)
        assert full[0]["generated_text"] == prompts[0] + ref[0][0]["generated_text"]
        sampling = {"max_new_tokens": 12, "do_sample": True, "temperature": 0.8, "top_p": 0.9}
        torch.manual_seed(3)
        first = pipe(prompts, batch_size=3, **sampling)
        torch.manual_seed(3)
        assert pipe(prompts, batch_size=3, **sampling) == first
    finally:
        hfaccel.unpatch(model)


def test_stop_strings_and_text_streamer_match_hf(smollm2):
    from threading import Thread

    from transformers import TextIteratorStreamer

    model, tokenizer = smollm2
    ids = torch.tensor([chat_ids(tokenizer, "List three fruits, one per line.")])
    kwargs = {"max_new_tokens": 40, "do_sample": False, "stop_strings": ["\n"], "tokenizer": tokenizer}
    ref = type(model).generate(model, ids, **kwargs)
    hfaccel.patch(model)
    try:
        out = model.generate(ids, **kwargs)
        assert torch.equal(out, ref)
        assert out.shape[1] < ids.shape[1] + 40, "the stop string ended generation early"
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        thread = Thread(
            target=model.generate, kwargs={"inputs": ids, "max_new_tokens": 20, "streamer": streamer}
        )
        thread.start()
        streamed = "".join(streamer)
        thread.join()
        expected = type(model).generate(model, ids, max_new_tokens=20, do_sample=False)
        assert streamed == tokenizer.decode(expected[0, ids.shape[1] :], skip_special_tokens=True)
    finally:
        hfaccel.unpatch(model)


def test_stop_strings_fire_where_hfs_criteria_do_on_characters_split_over_tokens(smollm2):
    """SmolLM2's byte-level tokens split an emoji or a CJK character over several tokens, each decoding
    alone to U+FFFD: the engine's check fires at the token HF's StopStringCriteria fires at."""
    from transformers.generation.stopping_criteria import StopStringCriteria

    from hfaccel.patches.stop_strings import stop_string_check

    _, tokenizer = smollm2
    emoji = "an emoji 🎉, and more"
    cases = [("🎉", emoji), ("は", "Japan は nice"), ("ç", "français"), ("🎉,", emoji)]
    cases += [("你好吗", "我说你好吗?"), ("😀😀", "x😀😀😀y"), ("𝒜b", "a𝒜𝒜b")]
    compared = 0
    for stop, text in cases:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        try:
            hf_criteria = StopStringCriteria(tokenizer, [stop])
        except ValueError:  # transformers 5.17 cannot map this tokenizer's byte tokens to text: it refuses
            continue
        ours = stop_string_check(tokenizer, [stop], in_prompt=True)
        hf_fires = [n for n in range(1, len(ids) + 1) if bool(hf_criteria(torch.tensor([ids[:n]]), None)[0])]
        our_fires = [n for n in range(1, len(ids) + 1) if ours([], ids[:n])]
        if not hf_fires:  # transformers 5.17 misses a stop string made of byte tokens it maps wrongly
            continue
        assert our_fires == hf_fires, (stop, hf_fires, our_fires)
        compared += 1
    assert compared >= 1
