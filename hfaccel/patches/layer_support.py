"""What of a model's layers the engine implements: the guard `patch` runs, from the model itself.

An engine step runs every decoder layer once over a packed batch of many sequences, with attention
replaced by paged causal attention over each sequence's own KV blocks (within the layer's sliding
window, where it has one: the kernels take it per layer), and each recurrent or convolutional token
mixer run per sequence on its own state row (`patches/recurrent.py`). Anything else a layer does across
tokens would mix the sequences of a batch or differ from HF, so a model with such a layer is refused
at `patch`, with the reason, instead of giving wrong tokens. Three checks, none of them a list of
families:

1. the config's ``layer_types``: ``full_attention``, ``sliding_attention`` and ``chunked_attention``
   (with an ``attention_chunk_size``; the kernels take each layer's chunk, `attention.layer_chunk`);
   ``mlp`` and ``moe`` (no token mixing); the recurrent kinds (``linear_attention``, ``mamba``,
   ``hybrid``, ``conv``) where the model has recurrent mixers for the probe to check. Any other
   type is refused;
2. the recurrent mixers (the modules owning a ``torch.nn.Conv1d``, the causal convolution over the
   sequence of Mamba, Mamba 2, gated delta nets and short convolutions; transformers' ``Conv1D``,
   GPT-2's projection, is a linear layer): each needs a ``layer_idx`` and a cache argument, and
   transformers' linear-attention cache API to be handed its state through (transformers 5.21 on;
   5.17 to 5.20 keep it in model-specific caches);
3. one forward of a few tokens with the attention function recording what it is handed: every decoder
   layer without a recurrent mixer or a token-wise type calls it exactly once, with K and V shapes one
   paged cache holds (every layer the same KV heads and head dims; Q as wide as K, V no wider:
   multi-head latent attention's narrower values are padded), and no argument the kernels do not
   implement (a non-causal call, sinks other than one logit per query head; soft-capping ``softcap``
   and attention sinks ``s_aux`` are served), from a module whose ``is_causal`` is not False (BERT's
   layers without ``is_decoder``, Gemma 3's ``use_bidirectional_attention``: bidirectional, though no
   keyword says so), with no mask but a causal one (transformers builds none for the engine's
   attention, so a mask there is the layer's own: Doge's learned bias), and each layer's
   ``sliding_window`` the one its mask
   uses (the config's window on its sliding layers, none on the others: the kernels attend within the
   window they are handed, so a layer whose mask slides without saying so would be served full). What
   the layers ask beyond causal attention (windows, chunks, soft-capping, sinks) is recorded too
   (`attention_needs`): the engine picks a backend that serves it. A layer that never calls it (RWKV,
   MiniMax's lightning attention) mixes tokens some other way. Each recurrent mixer's call in that
   forward is replayed per sequence from its state (`recurrent.round_trip_reason`): a mixer whose
   state lives anywhere else gives other outputs, and is refused.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import transformers
from transformers import DynamicCache

from hfaccel.patches.attention import AttentionCall, recording_attention
from hfaccel.patches.model_state import config_fingerprint
from hfaccel.patches.recurrent import mixer_reason, recurrent_mixers, round_trip_reason

SERVED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Layer types whose token mixer keeps a per-sequence state: served when the model's mixers run per
# sequence through transformers' cache API (`patches/recurrent.py`, checked at the probe).
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "mamba", "hybrid", "conv"})
# Layer types that mix no tokens at all (Nemotron-H's MLP and MoE layers): nothing to attend or keep.
TOKENWISE_LAYER_TYPES = frozenset({"mlp", "moe"})
LAYER_TYPE_REASONS = {
    "linear_attention": "linear-attention or recurrent layers (a per-sequence state)",
    "mamba": "Mamba layers (a per-sequence recurrent state)",
    "hybrid": "hybrid attention + recurrent layers (a per-sequence recurrent state)",
    "conv": "short-convolution layers (a per-sequence state)",
}
# Keyword arguments that carry nothing the kernels must implement, whatever their value.
NEUTRAL_ARGUMENTS = frozenset(
    {
        "position_ids",
        "use_cache",
        "cache_position",
        "output_attentions",
        "output_router_logits",
        "return_dict",
    }
)
PROBE_TOKENS = 4

_verdicts: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, _Verdict]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class AttentionShape:
    """What every layer hands attention, as the probe saw it: KV heads, the key (and query) head dim,
    and the value head dim, which multi-head latent attention (DeepSeek-V2/V3) makes narrower."""

    num_kv_heads: int
    head_dim: int
    value_head_dim: int


@dataclass(frozen=True)
class _Verdict:
    reason: str | None
    needs: frozenset[str]
    shape: AttentionShape | None
    recurrent: bool
    window: int | None
    sliding_layers: tuple[tuple[int, int], ...] = ()
    kv_layers: frozenset[int] | None = None  # the layers that call attention (None: every layer)
    state_bytes: int = 0  # one sequence's recurrent state, over every mixer


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the engine cannot serve this model's layers exactly (None: it can). Kept per model and config
    (its object and values: `config_fingerprint`): the probe runs one forward of a few tokens."""
    return _verdict(model).reason


def attention_needs(model: torch.nn.Module) -> frozenset[str]:
    """What the model's layers ask of an attention backend beyond causal attention, as the probe saw them
    (`kernels.selection.ATTENTION_NEEDS`): sliding windows, chunks, soft-capping, sinks."""
    return _verdict(model).needs


def attention_shape(model: torch.nn.Module) -> AttentionShape | None:
    """The KV heads and head dims the layers hand attention (None: the probe did not run or saw no call).
    The config's ``head_dim`` need not be it: DeepSeek-V3's is its rotary part only."""
    return _verdict(model).shape


def kv_window(model: torch.nn.Module) -> int | None:
    """The largest sliding window, when every layer that attends slides (Mistral, Phi-3, StarCoder2): no
    query attends to keys further back, so the engine gives their blocks back. None when a layer attends
    in full or in chunks (Gemma 2/3, gpt-oss, Llama 4: their full layers read every key)."""
    return _verdict(model).window


def sliding_layers(model: torch.nn.Module) -> dict[int, int]:
    """Each sliding layer's index and window, when full-attention layers sit beside them (Gemma 2/3,
    gpt-oss, Cohere 2: the engine keeps the sliding layers' K/V in a pool of their own); empty when every
    layer slides (`kv_window`), none does, or a layer attends in chunks."""
    return dict(_verdict(model).sliding_layers)


def kv_layers(model: torch.nn.Module) -> frozenset[int] | None:
    """The layers that keep K/V, on a model with recurrent layers: those that call attention (none on a
    purely recurrent model, Mamba's). None: every layer keeps K/V."""
    return _verdict(model).kv_layers


def state_bytes_per_sequence(model: torch.nn.Module) -> int:
    """Bytes one sequence's recurrent state takes, over every recurrent mixer (0 without any), as the
    probe's replay made them (shapes and dtypes are transformers' own)."""
    return _verdict(model).state_bytes


def has_recurrent_layers(model: torch.nn.Module) -> bool:
    """Whether the model has recurrent or convolutional token mixers (served with a per-sequence state
    slot, `patches/recurrent.py`: a sequence cannot be resumed from KV alone)."""
    return _verdict(model).recurrent


def _verdict(model: torch.nn.Module) -> _Verdict:
    config = model.config
    cache_key = (id(config), config_fingerprint(config))  # a config changed in place is probed again
    cached = _verdicts.get(model)
    if cached is not None and cached[0] == cache_key:
        return cached[1]
    text_config = config.get_text_config(decoder=True)
    needs: set[str] = set()
    calls: list[AttentionCall] = []
    state_bytes: list[int] = []
    mixers = recurrent_mixers(model)
    reason = (
        layer_types_reason(text_config, bool(mixers))
        or module_reason(mixers)
        or probe_reason(model, text_config, needs, calls, mixers, state_bytes)
    )
    shape = None
    if calls:
        key, value = calls[0].key_shape, calls[0].value_shape
        shape = AttentionShape(int(key[1]), int(key[-1]), int(value[-1]))
    windows = [call.kwargs.get("sliding_window") for call in calls]
    chunked = "chunked_attention" in (getattr(text_config, "layer_types", None) or ())
    window = int(max(windows)) if windows and all(windows) and not chunked else None
    sliding = tuple((call.layer_idx, int(slide)) for call, slide in zip(calls, windows) if slide)
    if chunked or window is not None or not all(isinstance(index, int) for index, _ in sliding):
        sliding = ()
    attending = frozenset(int(call.layer_idx) for call in calls) if mixers and reason is None else None
    verdict = _Verdict(
        reason, frozenset(needs), shape, bool(mixers), window, sliding, attending, sum(state_bytes)
    )
    _verdicts[model] = (cache_key, verdict)
    return verdict


def layer_types_reason(text_config: Any, has_mixers: bool = False) -> str | None:
    """The first layer type in the config's ``layer_types`` the engine does not implement (recurrent
    kinds pass when the model has recurrent mixers: the probe checks those)."""
    for index, kind in enumerate(getattr(text_config, "layer_types", None) or ()):
        if kind == "chunked_attention" and not getattr(text_config, "attention_chunk_size", None):
            return f"chunked attention layers without an attention_chunk_size (layer_types[{index}])"
        if (kind in RECURRENT_LAYER_TYPES and has_mixers) or kind in TOKENWISE_LAYER_TYPES:
            continue
        if kind not in SERVED_LAYER_TYPES:
            what = LAYER_TYPE_REASONS.get(kind, f"layers of type {kind!r}")
            return f"{what} are not implemented by the engine (layer_types[{index}] = {kind!r})"
    return None


def module_reason(mixers: Sequence[tuple[str, torch.nn.Module]]) -> str | None:
    """A module that mixes tokens outside attention (`recurrent.recurrent_mixers`: it convolves over the
    sequence) that the engine cannot run per sequence: one without a layer index or a cache argument,
    or any, on a transformers whose cache has no linear-attention API to hand it its state through."""
    if mixers and not hasattr(DynamicCache, "get_conv_state"):
        name, module = mixers[0]
        return (
            f"{name} ({type(module).__name__}) convolves over the sequence: a recurrent or convolutional token "
            f"mixer, which the engine serves through transformers' linear-attention cache API, which "
            f"transformers {transformers.__version__} does not have"
        )
    return next((reason for name, module in mixers if (reason := mixer_reason(name, module))), None)


def layer_windows(text_config: Any) -> list[int | None]:
    """Each decoder layer's sliding window as transformers' masks apply it: the config's
    ``sliding_window`` on its ``sliding_attention`` layers (on every layer of a config without
    ``layer_types`` that uses one), None elsewhere."""
    num_layers = text_config.num_hidden_layers
    window = getattr(text_config, "sliding_window", None)
    if not window or not getattr(text_config, "use_sliding_window", True):
        return [None] * num_layers
    types = getattr(text_config, "layer_types", None)
    if not types:
        return [int(window)] * num_layers
    return [int(window) if kind == "sliding_attention" else None for kind in types]


def narrowest_local_span(model: torch.nn.Module) -> int | None:
    """The fewest positions any layer attends over: its smallest sliding window or attention chunk
    (None: every layer attends in full)."""
    text_config = model.config.get_text_config(decoder=True)
    spans = [w for w in layer_windows(text_config) if w]
    types = getattr(text_config, "layer_types", None) or []
    if "chunked_attention" in types and getattr(text_config, "attention_chunk_size", None):
        spans.append(int(text_config.attention_chunk_size))
    return min(spans, default=None)


def probe_reason(
    model: torch.nn.Module,
    text_config: Any,
    needs: set[str] | None = None,
    seen: list[AttentionCall] | None = None,
    mixers: Sequence[tuple[str, torch.nn.Module]] = (),
    state_bytes: list[int] | None = None,
) -> str | None:
    """Run the model on a few tokens with the attention function recording, and check what it saw
    (the calls are appended to `seen`, when given; each recurrent mixer of `mixers` is replayed, its
    state's bytes per sequence appended to `state_bytes`)."""
    param = next(model.parameters())
    vocab = model.get_input_embeddings()
    vocab_size = embedding_rows(vocab)
    ids = (torch.arange(1, PROBE_TOKENS + 1) % vocab_size).unsqueeze(0).to(param.device)
    positions = torch.arange(PROBE_TOKENS, device=param.device).unsqueeze(0)
    mixer_calls: dict[str, tuple[tuple, dict[str, Any]]] = {}
    hooks = [
        module.register_forward_pre_hook(partial(_record_mixer_call, mixer_calls, name), with_kwargs=True)
        for name, module in mixers
    ]
    try:
        with torch.no_grad(), recording_attention(model) as calls:
            model(input_ids=ids, position_ids=positions, use_cache=False)
    except Exception as error:  # a model whose forward needs what the engine never gives it
        failure = f"{type(error).__name__}: {error}"
        return f"a forward of {PROBE_TOKENS} tokens with the engine's attention failed ({failure})"
    finally:
        for hook in hooks:
            hook.remove()
    for name, module in mixers:
        if name not in mixer_calls:
            return f"{name} ({type(module).__name__}) convolves over the sequence but was not called"
        if (reason := round_trip_reason(name, module, *mixer_calls[name], state_bytes)) is not None:
            return reason
    if seen is not None:
        seen.extend(calls)
    if needs is not None:
        needs.update(calls_needs(calls, text_config))
    implementation = getattr(text_config, "_attn_implementation", None)
    capped = next((call for call in calls if call.kwargs.get("softcap")), None)
    if capped is not None and implementation == "sdpa":  # transformers' sdpa attention drops the cap
        return (
            f"layer {capped.layer_idx} soft-caps attention logits (softcap={capped.kwargs['softcap']}), but the "
            "model runs transformers' sdpa attention, which ignores soft-capping, so transformers' own output "
            "is not soft-capped; load it with attn_implementation='eager' to serve it exactly"
        )
    recurrent = {int(module.layer_idx) for _, module in mixers}
    types = list(getattr(text_config, "layer_types", None) or ())
    recurrent |= {index for index, kind in enumerate(types) if kind in TOKENWISE_LAYER_TYPES}
    context = getattr(text_config, "max_position_embeddings", None)
    windows = layer_windows(text_config)
    return calls_reason(calls, text_config.num_hidden_layers, windows, recurrent, context)


def _record_mixer_call(
    calls: dict[str, tuple[tuple, dict[str, Any]]], name: str, module: Any, args: tuple, kwargs: dict
) -> None:
    calls.setdefault(name, (args, dict(kwargs)))


def calls_needs(calls: list[AttentionCall], text_config: Any) -> set[str]:
    """What the recorded calls (and the config's chunked layers) ask of the kernels."""
    needs = set()
    if "chunked_attention" in (getattr(text_config, "layer_types", None) or ()):
        needs.add("chunked_attention")
    for call in calls:
        if call.kwargs.get("sliding_window"):
            needs.add("sliding_window")
        if call.kwargs.get("softcap"):
            needs.add("logit_softcap")
        if call.kwargs.get("s_aux") is not None:
            needs.add("attention_sinks")
    return needs


def calls_reason(
    calls: list[AttentionCall],
    num_layers: int,
    windows: list[int | None] | None = None,
    recurrent: set[int] | frozenset[int] = frozenset(),
    context: int | None = None,
) -> str | None:
    """Why these recorded attention calls cannot run on the paged cache (None: they can). `windows`:
    each layer's sliding window as its mask has it (`layer_windows`; None: no layer slides).
    `recurrent`: layers whose recurrent mixer is served instead (they need not call attention).
    `context`: the model's longest sequence (a window as long never hides a key)."""
    windows = windows if windows is not None else [None] * num_layers
    if any(call.layer_idx is None for call in calls):
        return "an attention module without a layer_idx (the engine keeps one KV cache per layer)"
    counts = Counter(int(call.layer_idx) for call in calls)
    missing = [layer for layer in range(num_layers) if counts[layer] == 0 and layer not in recurrent]
    if missing:
        return (
            f"decoder layers {_spans(missing)} never call the attention function: they mix tokens some "
            "other way (a recurrent or linear-attention layer), which the engine does not implement"
        )
    outside = sorted(layer for layer in counts if not 0 <= layer < num_layers)
    if outside:
        return (
            f"attention modules with layer_idx {outside}, outside the {num_layers} decoder layers (a block "
            "shared across layers, as Zamba's): the engine keeps one KV cache per layer index"
        )
    repeated = sorted(layer for layer, count in counts.items() if count > 1)
    if repeated:
        return f"layers {_spans(repeated)} call attention more than once a forward"
    if not calls:  # a purely recurrent model (Mamba's): every layer's mixer is served, no K/V kept
        return None
    first = calls[0]
    for call in calls:
        # Values narrower than keys (multi-head latent attention, DeepSeek-V2/V3) are served: the cache
        # holds them zero-padded to the key width, and the output is cut back (as HF's flash path does).
        if call.key_shape[-1] != call.query_shape[-1] or call.value_shape[-1] > call.key_shape[-1]:
            return (
                f"layer {call.layer_idx} has queries, keys and values of head dims {call.query_shape[-1]}, "
                f"{call.key_shape[-1]}, {call.value_shape[-1]}: the kernels need queries as wide as keys, "
                "and values no wider"
            )
        if (
            call.key_shape[1] != first.key_shape[1]
            or call.key_shape[-1] != first.key_shape[-1]
            or call.value_shape[-1] != first.value_shape[-1]
        ):
            return (
                f"layer {call.layer_idx} has {call.key_shape[1]} KV heads of {call.key_shape[-1]} dims, layer "
                f"{first.layer_idx} {first.key_shape[1]} of {first.key_shape[-1]}: one paged cache holds one shape"
            )
        reason = arguments_reason(call, windows[int(call.layer_idx)], context)
        if reason is not None:
            return reason
    return None


def arguments_reason(call: AttentionCall, window: int | None, context: int | None = None) -> str | None:
    """The first keyword argument of one call that the kernels do not implement, or a sliding window
    other than `window`, the one the layer's mask uses (None: full attention). A window of `context`
    positions or more (the model's ``max_position_embeddings``, which bounds every sequence the engine
    serves) hides no key: it reads as full attention on either side (Phi-3.5-MoE's config sets its
    window to its context, and its layers hand none)."""
    if call.module_causal is False:
        return (
            f"layer {call.layer_idx}'s attention is not causal (its module's is_causal is False: a "
            "bidirectional encoder's, or use_bidirectional_attention): the kernels attend causally"
        )
    if call.mask is not None and not causal_mask(call.mask, window, call.query_shape[-2]):
        return (
            f"layer {call.layer_idx} builds an attention mask of its own ({_short(call.mask)}) that is not "
            "a causal one: the kernels apply no mask or bias"
        )
    passed = call.kwargs.get("sliding_window")
    if _narrower(passed, context) != _narrower(window, context):
        masked = f"a window of {window} tokens" if window else "full attention"
        return (
            f"layer {call.layer_idx} hands attention sliding_window={passed} while its mask is {masked}: "
            "the kernels would attend within the window they are handed"
        )
    for name, value in call.kwargs.items():
        if name in NEUTRAL_ARGUMENTS or value is None:
            continue
        if name == "s_aux":
            if (
                not isinstance(value, torch.Tensor)
                or value.dim() != 1
                or value.shape[0] != call.query_shape[1]
            ):
                return f"layer {call.layer_idx} passes attention sinks (s_aux) that are not one logit per query head"
            continue
        if name == "softcap":  # served: the kernels soft-cap the scores
            continue
        if name == "sliding_window":  # checked above against the layer's mask
            continue
        if name == "is_causal":
            if value is False:
                return f"layer {call.layer_idx} asks for non-causal attention (is_causal=False)"
            continue
        if value is False:
            continue
        return f"layer {call.layer_idx} passes {name}={_short(value)} to attention, which the kernels do not implement"
    return None


def _narrower(window: Any, context: int | None) -> int | None:
    """`window` where it hides keys of some sequence up to `context` tokens, else None."""
    if not window or (context and int(window) >= int(context)):
        return None
    return int(window)


def causal_mask(mask: Any, window: int | None, queries: int | None = None) -> bool:
    """Whether `mask` (``[..., T, S]``, or ``[..., 1, S]`` broadcast over the `queries`: boolean, True where
    a query sees a key, or additive) is plain causal attention of the last T of S positions (within
    `window`, where given), which the kernels apply. An additive mask hides a key with any value that
    leaves it no weight (-1e4 or less: transformers' own masks use the dtype's minimum or -inf)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() < 2:
        return False
    rows, s = mask.shape[-2:]
    t = queries or rows
    if rows not in (1, t):
        return False
    mask = mask.expand(*mask.shape[:-2], t, s)
    query = torch.arange(t, device=mask.device)[:, None] + (s - t)
    key = torch.arange(s, device=mask.device)[None, :]
    visible = (key <= query) & (key > query - window if window else True)
    if mask.dtype == torch.bool:
        return bool((mask == visible).all())
    if not mask.is_floating_point():
        return False
    return bool((mask[..., visible] == 0).all()) and bool((mask[..., ~visible] <= -1e4).all())


def _spans(layers: list[int]) -> str:
    return str(layers) if len(layers) <= 6 else f"{layers[:6]} (and {len(layers) - 6} more)"


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def embedding_rows(embeddings: torch.nn.Module) -> int:
    """The rows of the input embeddings (the vocabulary), through PEFT's wrappers: LoRA's layer keeps the
    ``nn.Embedding`` as ``base_layer``, trainable tokens' wrapper as ``token_adapter.base_layer``."""
    module: Any = embeddings
    for _ in range(4):
        if isinstance(getattr(module, "num_embeddings", None), int):
            return module.num_embeddings
        inner = getattr(module, "token_adapter", None)
        module = getattr(inner if inner is not None else module, "base_layer", None)
        if module is None:
            break
    return embeddings.weight.shape[0]
