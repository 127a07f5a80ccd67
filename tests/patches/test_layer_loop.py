"""`layer_loop`: what a pipeline stage computes around its layers, checked against the model's own forward
at patch (one process: the check needs no process group); the eager step's lean forward, checked against
the model's forward before it serves, and never used where it would skip something of the user's."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

import hfaccel
from hfaccel.bench.families import family_model
from hfaccel.patches import layer_loop
from tests.helpers import FAMILIES, MOE_FAMILIES, hf, tiny_model

# The model-level scales a stage applies, set away from 1 so that leaving one out shows.
SCALED = {
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "cohere": {"logit_scale": 0.0625},
    "gemma2": {"final_logit_softcapping": 3.0},
    "llama": {},
}


@pytest.mark.parametrize("model_type", list(SCALED))
def test_stages_compute_the_models_own_forward(model_type):
    assert layer_loop.unsupported_reason(family_model(model_type, **SCALED[model_type])) is None


@pytest.mark.parametrize(
    ("model_type", "part", "message"),
    [
        ("granite", "embedding_multiplier", "first layer's input other than from the token embeddings"),
        ("granite", "logits_scaling", "logits other than from its final norm and LM head"),
        ("cohere", "logit_scale", "logits other than from its final norm and LM head"),
    ],
)
def test_a_scale_a_stage_left_out_is_found(model_type, part, message, monkeypatch):
    model = family_model(model_type, **SCALED[model_type])
    init = layer_loop.AroundLayers.__init__

    def forgetful(self, model):
        init(self, model)
        setattr(self, part, None)

    monkeypatch.setattr(layer_loop.AroundLayers, "__init__", forgetful)
    assert message in layer_loop.unsupported_reason(model)


def test_a_rotary_embedding_that_wants_the_layer_type_is_refused_before_any_process_group():
    model = family_model("gemma3_text")
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 is not possible: .*layer_type"):
        hfaccel.patch(model, pipeline_parallel_size=2)
    assert getattr(model, "_hfaccel", None) is None


IDS = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5], [3, 4, 5, 3, 4]])
KWARGS = {"max_new_tokens": 6, "do_sample": False}


def _lean(model):
    return model._hfaccel.get_engine(model).runner.executor._lean


@pytest.mark.parametrize("family", [*FAMILIES, *MOE_FAMILIES])
def test_the_lean_forward_serves_once_it_computed_the_models_own_logits(family, monkeypatch):
    model = tiny_model(family, seed=4)
    expected = hf(model, input_ids=IDS, **KWARGS)
    hfaccel.patch(model, progress=False)
    try:
        assert _lean(model).verified is None  # not checked before a decode step
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is True
        calls = []
        call = layer_loop.LeanForward.__call__
        monkeypatch.setattr(layer_loop.LeanForward, "__call__", lambda *a: calls.append(1) or call(*a))
        assert torch.equal(model.generate(IDS, **KWARGS), expected)  # served by it now
        # every step: the prompts are cached but their last tokens, recomputed as one-token steps
        assert len(calls) == KWARGS["max_new_tokens"]
    finally:
        hfaccel.unpatch(model)


class BiasedLlama(LlamaForCausalLM):
    """A family whose top-level forward does more than its layers: it favours token 5."""

    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits[..., 5] += 3.0
        return output


def test_a_model_whose_forward_differs_keeps_its_own_forward():
    source = tiny_model("llama", seed=4)
    model = BiasedLlama(source.config).eval()
    model.load_state_dict(source.state_dict())
    expected = hf(model, input_ids=IDS, **KWARGS)
    assert (expected[:, 5:] == 5).any() and not (expected[:, 5:] == 5).all()  # the bias shows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unchecked family
        hfaccel.patch(model, progress=False)
    try:
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is False
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
    finally:
        hfaccel.unpatch(model)


@pytest.mark.parametrize("field", ["embedding_multiplier", "raising halfway"])
def test_a_check_that_fails_leaves_the_models_own_kv_in_the_cache(field, monkeypatch):
    """A Llama config holding a field its forward ignores (the lean forward scales by it), and a lean
    forward that also raises halfway: the check's first step ran both forwards, and every later step
    reads the K/V of that step's token as the model's forward stored them, not as the lean one did."""
    model = tiny_model("llama", seed=4)
    expected = hf(model, input_ids=IDS, **KWARGS)
    setattr(model.config, "embedding_multiplier" if field == "raising halfway" else field, 12.0)
    if field == "raising halfway":
        call = layer_loop.LeanForward.__call__

        def halfway(self, *args):  # its layers store K/V, then it fails
            self.base.norm.forward = None
            try:
                return call(self, *args)
            finally:
                del self.base.norm.forward

        monkeypatch.setattr(layer_loop.LeanForward, "__call__", halfway)
    hfaccel.patch(model, progress=False)
    try:
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is False
    finally:
        hfaccel.unpatch(model)


def test_a_users_hook_inside_the_model_sees_each_step_once():
    """A hook marked ``hfaccel_packed`` on a decoder layer (activation capture) while no check was made:
    none is made (it would run the step's layers twice), so the hook sees each engine step once; once
    the hook is removed the check is made."""
    model = tiny_model("llama", seed=4)
    seen = []

    def capture(module, args, output):
        seen.append(output.shape[1])

    capture.hfaccel_packed = True
    handle = model.model.layers[0].register_forward_hook(capture)
    hfaccel.patch(model, progress=False)
    try:
        engine = model._hfaccel.get_engine(model)
        expected = hf(model, input_ids=IDS, **KWARGS)
        seen.clear()
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert len(seen) == len(engine.step_stats) and _lean(model).verified is False
        handle.remove()
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert _lean(model).verified is True
    finally:
        hfaccel.unpatch(model)


class Counted(torch.nn.Module):
    """A module of the user's own class that keeps state: the rows of each call."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.seen = inner, []

    def forward(self, x):
        self.seen.append(x.shape[1])
        return self.inner(x)


def test_a_module_of_the_users_own_class_sees_each_step_once():
    """No check runs its forward twice: a model holding a module of a class the user wrote is not
    checked (its forward may keep state: a counter, captured activations), so it keeps its forward."""
    model = tiny_model("llama", seed=4)
    counted = model.model.layers[1].mlp = Counted(model.model.layers[1].mlp)
    hfaccel.patch(model, progress=False)
    try:
        expected = hf(model, input_ids=IDS, **KWARGS)
        counted.seen.clear()
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        assert len(counted.seen) == len(model._hfaccel.get_engine(model).step_stats)
        assert _lean(model).verified is False
    finally:
        hfaccel.unpatch(model)


class SkipLayersAt(LogitsProcessor):
    """Early exit in the middle of a call: from its `at`-th step, the model runs one layer."""

    def __init__(self, model, at):
        self.model, self.at, self.calls = model, at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            self.model.config.num_hidden_layers = 1
        return scores


def test_a_layer_count_changed_during_a_call_is_seen_at_the_next_step():
    """transformers' decoders run ``layers[: config.num_hidden_layers]``, read at every forward."""
    outputs = []
    for patched in (True, False):
        model = tiny_model("llama", seed=0)
        hfaccel.patch(model, progress=False)
        try:
            model.generate(IDS[:1], **KWARGS)  # a first call: checked
            ask = {"max_new_tokens": 10, "do_sample": False}
            processors = LogitsProcessorList([SkipLayersAt(model, 3)])
            if patched:
                outputs.append(model.generate(IDS[:1], logits_processor=processors, **ask))
            else:
                outputs.append(hf(model, input_ids=IDS[:1], logits_processor=processors, **ask))
        finally:
            hfaccel.unpatch(model)
    assert torch.equal(*outputs)


def test_a_packed_hook_on_the_top_level_model_is_never_skipped():
    """A hook marked ``hfaccel_packed`` on the model itself keeps the call on the engine, and runs on
    every step: those steps take the model's forward."""
    model = tiny_model("llama", seed=4)

    def favour_five(module, args, output):
        output.logits[..., 5] += 3.0
        return output

    favour_five.hfaccel_packed = True
    hfaccel.patch(model, progress=False)
    try:
        model.generate(IDS, **KWARGS)
        assert _lean(model).verified is True  # checked before the hook came
        handle = model.register_forward_hook(favour_five)
        expected = hf(model, input_ids=IDS, **KWARGS)
        assert (expected[:, 5:] == 5).any()
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
        handle.remove()
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
    finally:
        hfaccel.unpatch(model)


def test_a_change_of_the_models_modules_checks_it_again_and_one_of_values_does_not(monkeypatch):
    checks = []
    judge = layer_loop.LeanForward.judge

    def counted(self, *args):
        judge(self, *args)
        checks.append(self.verified)

    monkeypatch.setattr(layer_loop.LeanForward, "judge", counted)
    model = tiny_model("llama", seed=4)
    hfaccel.patch(model, progress=False)
    try:
        model.generate(IDS, **KWARGS)
        model.generate(IDS, **KWARGS)
        assert checks == [True]
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)  # values only (an optimizer step): no check needed
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
        assert checks == [True]
        model.model.norm = type(model.model.norm)(64).eval()  # a module replaced: checked again
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
        assert checks == [True, True]
        model.generate(IDS, **KWARGS)
        assert checks == [True, True]
    finally:
        hfaccel.unpatch(model)


class Negated(torch.nn.Module):
    """A wrapper around a decoder that changes its output (attributes read through to the decoder)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)

    def forward(self, *args, **kwargs):
        output = self.inner(*args, **kwargs)
        output.last_hidden_state = -output.last_hidden_state
        return output


def _edit_multiplier(model):
    model.model.embedding_multiplier = 3.0  # what GraniteModel.forward reads (copied from the config)


def _edit_logit_scale(model):
    model.logit_scale = -1.0  # what CohereForCausalLM.forward reads


def _swap_decoder_class(model):
    class NegatedModel(type(model.model)):  # the same module, its class's forward replaced
        def forward(self, *args, **kwargs):
            output = super().forward(*args, **kwargs)
            output.last_hidden_state = -output.last_hidden_state
            return output

    model.model.__class__ = NegatedModel


def _wrap_decoder(model):
    model.model = Negated(model.model)


class Opaque(torch.nn.Module):
    """A wrapper around a decoder that forwards no attribute (no ``layers``, ``config``, ``norm``)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        output = self.inner(*args, **kwargs)
        output.last_hidden_state = -output.last_hidden_state
        return output


def _wrap_decoder_opaquely(model):
    model.model = Opaque(model.model)


def _patch_class_forward(model, monkeypatch):
    forward = type(model).forward

    def biased(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        output.logits[..., 5] += 3.0
        return output

    monkeypatch.setattr(type(model), "forward", biased)


EDITS = {
    "granite decoder's multiplier": ("granite", _edit_multiplier),
    "decoder class swapped": ("llama", _swap_decoder_class),
    "cohere model's logit scale": ("cohere", _edit_logit_scale),
    "decoder wrapped": ("llama", _wrap_decoder),
    "decoder wrapped opaquely": ("llama", _wrap_decoder_opaquely),
    "class forward patched": ("llama", _patch_class_forward),
}
OWN_SCALES = {
    "granite": {"embedding_multiplier": 12.0, "logits_scaling": 8.0},
    "cohere": {"logit_scale": 0.0625},
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edit_the_model_watch_cannot_see_makes_the_next_step_check_again(edit, monkeypatch):
    """Module attributes, config fields, a wrapped decoder and a patched class forward change no
    tensor, so the engine's model watch misses them: the lean forward notices them itself."""
    family, change = EDITS[edit]
    model = family_model(family, **OWN_SCALES.get(family, {}))
    hfaccel.patch(model, progress=False)
    try:
        assert torch.equal(model.generate(IDS, **KWARGS), hf(model, input_ids=IDS, **KWARGS))
        assert _lean(model).verified is True
        if change is _patch_class_forward:
            change(model, monkeypatch)
        else:
            change(model)
        expected = hf(model, input_ids=IDS, **KWARGS)
        assert torch.equal(model.generate(IDS, **KWARGS), expected)
    finally:
        hfaccel.unpatch(model)


def _bucketed_engine(model, **config):
    """An engine whose eager decode steps are padded to a bucket of 4 (what the runner keeps after a CUDA
    graph capture failed under ``compile="off"``: its buckets, no graphs)."""
    from hfaccel import EngineConfig
    from hfaccel.engine.engine import Engine

    engine = Engine(model, EngineConfig(block_size=8, kv_cache_memory=4_000_000, **config))
    engine.runner.decode_buckets = (4,)
    return engine


def test_a_padded_step_gives_each_request_its_own_row():
    """A step padded to a bucket, with a one-token prompt chunk that is not sampled ahead of a sampled
    token: the sampled row is gathered (every row's logits only when every token is sampled, unpadded)."""
    from hfaccel.engine.request import StoppingParams
    from tests.helpers import hf_greedy

    model = tiny_model("llama", seed=4)
    first, second = [5, 6, 7, 8, 9, 10, 11, 12], [20]
    engine = _bucketed_engine(model, long_prefill_token_threshold=1)
    stop = StoppingParams(max_new_tokens=4)
    engine.runner.decode_buckets = ()
    engine.run([engine.make_request([3, 4, 5], stop)])  # an unpadded step checks the lean forward
    engine.runner.decode_buckets = (4,)
    a = engine.make_request(first, stop)
    engine.add(a)
    engine.step()
    engine.step()
    c = engine.make_request(second, stop)  # packed behind the first one's unsampled one-token chunk
    engine.add(c)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.executor._lean.verified is True
    assert [a.output_token_ids, c.output_token_ids] == [hf_greedy(model, p, 4) for p in (first, second)]


def test_a_first_check_on_a_padded_step_passes():
    from hfaccel.engine.request import StoppingParams

    engine = _bucketed_engine(tiny_model("llama", seed=4))
    engine.run([engine.make_request(p, StoppingParams(max_new_tokens=4)) for p in ([5], [8])])
    assert engine.executor._lean.verified is True
