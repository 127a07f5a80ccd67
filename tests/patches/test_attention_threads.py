"""Plain forward calls beside generation: other threads see the model exactly as it was."""

import copy
import pickle
import threading

import torch

import hfaccel
from hfaccel.patches.attention import engine_attention, restore_attention
from tests.helpers import hf_greedy, left_padded, tiny_model, varied_prompts


def test_plain_forward_in_another_thread_while_the_engine_steps():
    model = tiny_model("llama")
    ids, mask = left_padded(varied_prompts(3, seed=5))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    own_attention = model.config._attn_implementation
    prompts = varied_prompts(6, seed=6)
    references = [hf_greedy(model, p, 8) for p in prompts]
    hfaccel.patch(model, block_size=8, kv_cache_memory=4_000_000)
    errors, outputs = [], []
    forwards_done = threading.Event()
    steps_during = []

    def plain_forwards():
        try:
            for _ in range(200):
                with torch.no_grad():
                    logits = model(input_ids=ids, attention_mask=mask).logits
                torch.testing.assert_close(logits, expected, rtol=0, atol=0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            forwards_done.set()

    def generation():
        try:
            while not forwards_done.is_set():
                completions = hfaccel.generate(model, prompts, max_new_tokens=8, progress=False)
                outputs.append([c.token_ids for c in completions])
                steps_during.append(model._hfaccel.engine.num_steps)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=plain_forwards), threading.Thread(target=generation)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
    finally:
        hfaccel.unpatch(model)
    assert not errors, errors[0]
    assert len(outputs) >= 1 and steps_during[0] > 0, "the engine never stepped while the forwards ran"
    assert all(out == references for out in outputs)
    assert model.config._attn_implementation == own_attention


def test_the_switch_is_per_thread_and_leaves_the_config_as_it_was():
    model = tiny_model("llama")
    config = model.config
    own = config._attn_implementation
    seen = {}
    with engine_attention(model):
        assert config._attn_implementation == "hfaccel"
        thread = threading.Thread(target=lambda: seen.setdefault("other", config._attn_implementation))
        thread.start()
        thread.join()
        assert type(config).__name__ == "LlamaConfig"
    assert seen["other"] == own and config._attn_implementation == own
    assert config._attn_implementation_internal == own
    # The config object is untouched: its type, copies, pickles and its own setter behave as before.
    assert type(config) is type(tiny_model("llama").config)
    assert pickle.loads(pickle.dumps(config)) == config == copy.deepcopy(config)
    model.set_attn_implementation("eager")
    with engine_attention(model):
        assert config._attn_implementation == "hfaccel"
    assert config._attn_implementation == "eager"
    restore_attention(model)
    assert config._attn_implementation == "eager"


def test_an_unrelated_config_is_not_switched():
    model, other = tiny_model("llama"), tiny_model("qwen2")
    with engine_attention(model):
        assert other.config._attn_implementation != "hfaccel"
