"""The Hugging Face side of an engine step: the ``model(...)`` call and what the engine must know of
the model (layers, KV heads, head dim, vocabulary, context length)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from typing import Any

import torch

from hfaccel.engine.executor import ExecutorBase
from hfaccel.kernels.op import current_forward_context
from hfaccel.patches import lora
from hfaccel.patches.attention import engine_attention, register_attention, restore_attention
from hfaccel.patches.compiled_forward import CompiledForward, own_code
from hfaccel.patches.layer_loop import LeanForward
from hfaccel.patches.layer_support import (
    attention_needs,
    embedding_rows,
    has_recurrent_layers,
    kv_layers,
    kv_window,
    sliding_layers,
    state_bytes_per_sequence,
)
from hfaccel.patches.model_state import ModelStateTracker
from hfaccel.patches.models import attention_dims
from hfaccel.patches.models import max_model_len as resolve_max_model_len
from hfaccel.patches.recurrent import SlotStates, install_mixers, restore_mixers


class HFExecutor(ExecutorBase):
    """Runs a transformers causal LM on a packed ``[1, T]`` step with the "hfaccel" attention."""

    def __init__(self, model: Any) -> None:
        register_attention()
        self.model = model
        # The recurrent state rows its mixers hold (`reserve_state_slots`).
        self._states: SlotStates | None = None
        param = next(model.parameters())
        self.device = param.device
        self.dtype = param.dtype
        embeddings = model.get_input_embeddings()
        self.vocab_size = embedding_rows(embeddings)  # through PEFT's wrappers of embed_tokens
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        self.kv_layers = kv_layers(model)
        # What the layers hand attention (DeepSeek-V3's config says otherwise), or a nominal geometry
        # where no layer attends (Mamba: no attention heads in its config).
        self.num_kv_heads, self.head_dim = attention_dims(model)
        attends = self.kv_layers != frozenset()
        self.num_q_heads = config.num_attention_heads if attends else self.num_kv_heads
        self.attention_scale = _attention_scale(model, self.head_dim)
        self.attention_needs = attention_needs(model)
        self.recurrent = has_recurrent_layers(model)
        self.state_bytes_per_seq = state_bytes_per_sequence(model)
        self.kv_window = kv_window(model)
        self.sliding_layers = sliding_layers(model)
        self._state = ModelStateTracker(model)
        self._last_token: Hashable = None
        self._adapter_checks: dict[str, ValueError | None] = {}
        # One process, on a CPU (ranks of a parallel model must all run the same shapes).
        head = (
            model.get_output_embeddings() if self.device.type == "cpu" and type(self) is HFExecutor else None
        )
        self._logit_rows = None if head is None else LogitRows(head, config.hidden_size, self.dtype)
        # Eager decode steps without the top-level forward's wrappers, once checked (`LeanForward`): one
        # process (a parallel model's executors run their own forwards), no recurrent state (a checking
        # step runs its layers twice).
        plain = type(self) is HFExecutor and not self.recurrent
        self._lean = LeanForward(model) if plain and LeanForward.unavailable_reason(model) is None else None
        self.recorded: tuple[Any, Any] | None = (
            None  # the last recording forward's (hidden states, attentions)
        )

    def max_model_len(self, requested: int | None) -> int:
        return resolve_max_model_len(self.model, requested)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        compiled: Callable[..., torch.Tensor] | None = None,
        token_adapters: list[str | None] | None = None,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        record: bool = False,
    ) -> torch.Tensor:
        if record:  # eager: the model's hidden states and attention probabilities kept in `recorded`
            adapters = (
                nullcontext()
                if token_adapters is None
                else self._adapter_step(token_adapters, logits_indices)
            )
            with engine_attention(self.model), adapters:
                return self._recording_forward(input_ids, positions, logits_indices, prompt_embeds)
        wanted = logits_indices.shape[0]
        if compiled is None and self._logit_rows is not None:  # eager on a CPU: see `LogitRows`
            logits_indices = padded_indices(logits_indices, self._logit_rows.rows(wanted))
        with engine_attention(self.model):
            if token_adapters is None and prompt_embeds is None:
                if compiled is None and self._lean is not None and self._lean_step():
                    # Every token sampled and no row padded (the runner's word, and `LogitRows` padded
                    # none): the lean forward takes its head's input as it is.
                    every_row = (
                        current_forward_context().samples_every_token and logits_indices.shape[0] == wanted
                    )
                    return self._lean_forward(input_ids, positions, logits_indices, every_row)[:wanted]
                return (compiled or self._model_forward)(input_ids, positions, logits_indices)[:wanted]
            if token_adapters is None:
                return self._model_forward(input_ids, positions, logits_indices, prompt_embeds)[:wanted]
            with self._adapter_step(token_adapters, logits_indices):  # each token gets its request's LoRA
                return self._model_forward(input_ids, positions, logits_indices, prompt_embeds)[:wanted]

    def _lean_step(self) -> bool:
        """Whether this eager step may run the lean forward: decodes only, outside a CUDA graph capture
        (a check compares tensors on the host), with nothing wrapping the top-level modules."""
        context = current_forward_context()
        layout = None if context is None else context.layout
        if layout is None or layout.num_decodes != len(layout.query_lens):
            return False
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        return self._lean.usable()

    def _lean_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor, every_row: bool
    ) -> torch.Tensor:
        lean, rows = self._lean, None if every_row else logits_indices
        if lean.verified:
            return lean(input_ids, positions, rows)
        ours = lean.attempt(input_ids, positions, rows)
        logits = self._model_forward(input_ids, positions, logits_indices)  # second: its K/V stay
        lean.judge(ours, logits)
        return logits

    def forget_outputs(self, structure: bool = True) -> None:
        """The model changed: check the lean forward again before it serves, unless only its tensors'
        values changed (an optimizer step: the same modules compute the same way)."""
        if self._lean is not None and structure:
            self._lean.forget()

    def _adapter_step(self, token_adapters: list[str | None], logits_indices: torch.Tensor) -> Any:
        """Each packed token's LoRA adapter for this step; the LM head's, for the logit rows it sees."""
        head = self.model.get_output_embeddings()
        if not lora.is_lora_layer(head):  # the usual case: no rows to read back from the device
            return lora.adapter_step(token_adapters, self.device)
        return lora.adapter_step(token_adapters, self.device, logits_indices.tolist(), head)

    def reserve_state_slots(self, num_slots: int) -> None:
        """Wrap the model's recurrent mixers to run per sequence over `num_slots` state rows."""
        self._states = SlotStates(num_slots)
        install_mixers(self.model, self._states)

    def release_state_slots(self) -> None:
        """The engine is released: unwrap the mixers that still hold this engine's state rows (the
        wrappers kept them, a sequence's state per layer for `max_num_seqs` rows, until the next engine
        or ``unpatch``); a newer engine's wrappers stay."""
        states, self._states = self._states, None
        if states is not None:
            restore_mixers(self.model, states)

    def prompt_inputs_reason(self) -> str | None:
        """Why this executor cannot take prompt embeddings or imported K/V (None: it can). A sharded
        model (tensor, pipeline or expert parallel) holds a rank's share of the heads or layers."""
        if type(self) is not HFExecutor:
            return f"a model run by {type(self).__name__} (parallel)"
        return None

    def check_adapter(self, name: str) -> None:
        """Raise ValueError unless the engine can apply LoRA adapter `name` per request.

        A check walks every module (about 0.1 s for SmolLM2 with four adapters on seven projections), so
        its result is kept per name until the model-state token changes (adapters added, deleted,
        merged, switched: see `state_token`); the front-ends check a call's names afresh anyway."""
        if name not in self._adapter_checks:
            try:
                lora.check_adapter_names(self.model, [name])
                reason = lora.unsupported_reason(self.model, [name])
                self._adapter_checks[name] = (
                    None
                    if reason is None
                    else ValueError(f"adapter {name!r}: the engine does not batch {reason}")
                )
            except ValueError as error:
                self._adapter_checks[name] = error
        error = self._adapter_checks[name]
        if error is not None:
            raise ValueError(str(error))

    def compile(self, dynamic: bool) -> Callable[..., torch.Tensor]:
        """The model forward under ``torch.compile``: one graph, attention as the custom-op node
        (``fullgraph=True``: a graph break is an error, found at warm-up, never silently slow)."""
        # A copy of the forward's code per compile: its graphs are this model's alone, freed with it, and
        # count against dynamo's recompile limit apart from other models' (`compiled_forward`).
        forward = own_code(type(self)._model_forward).__get__(self)
        compiled = torch.compile(
            forward, fullgraph=True, dynamic=dynamic, options=inductor_options(self.device)
        )
        return CompiledForward(compiled, self._model_forward)

    def _model_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if prompt_embeds is None:
            output = self.model(
                input_ids=input_ids, position_ids=positions, use_cache=False, logits_to_keep=logits_indices
            )
            return output.logits[0]
        output = self.model(
            inputs_embeds=self._embedded(input_ids, prompt_embeds),
            position_ids=positions,
            use_cache=False,
            logits_to_keep=logits_indices,
        )
        return output.logits[0]

    def _embedded(
        self, input_ids: torch.Tensor, prompt_embeds: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """Embedded prompt tokens: the model's own embedding of every packed id, then the given rows at
        their packed positions; the model runs on the embeddings (as HF's generate does for a prompt
        given as inputs_embeds)."""
        index, rows = prompt_embeds
        embeds = self.model.get_input_embeddings()(input_ids)
        embeds[0, index] = rows.to(embeds.dtype)
        return embeds

    def _recording_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        logits_indices: torch.Tensor,
        prompt_embeds: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        inputs: dict[str, Any] = {"input_ids": input_ids}
        if prompt_embeds is not None:
            inputs = {"inputs_embeds": self._embedded(input_ids, prompt_embeds)}
        output = self.model(
            **inputs,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=logits_indices,
            output_hidden_states=True,
            output_attentions=True,
        )
        self.recorded = (output.hidden_states, output.attentions)
        return output.logits[0]

    def state_sentinel(self) -> Hashable:
        """What model-wide changes are cheaply seen by, at every step (`ModelStateTracker.sentinel`);
        None in a parallel model, whose ranks must all check their state at the same steps."""
        return self._state.sentinel() if type(self) is HFExecutor else None

    def state_token(self) -> Hashable:
        """Weights, optimizer steps and adapters, fingerprinted (see `ModelStateTracker`)."""
        token = self._state.token()
        if token != self._last_token:  # the model changed: adapter checks are redone
            if self._last_token is None or not token.same_structure(self._last_token):
                # Modules were swapped in (a grafted layer may hold a config object of its own): the
                # attention switch looks for the model's configs afresh.
                restore_attention(self.model)
            self._last_token = token
            self._adapter_checks.clear()
        return token


def inductor_options(device: torch.device) -> dict[str, Any] | None:
    """Inductor settings of a compiled step. On a CPU, inductor's C++ wrapper (``cpp_wrapper``) calls
    the step's kernels and matmuls from C++ instead of a generated Python function: measured on SmolLM2
    in float32 (2 threads), the step went from 89% to 91% of its matmul floor at batch 1 and from 83% to
    87% at batch 8, for about a minute more of cold compile (docs/benchmarks.md).
    ``HFACCEL_CPP_WRAPPER=0`` keeps the Python wrapper. On CUDA, graphs replay the step anyway."""
    if device.type != "cpu" or os.environ.get("HFACCEL_CPP_WRAPPER", "1") == "0":
        return None
    return {"cpp_wrapper": True}


def _attention_scale(model: Any, head_dim: int) -> float:
    """The softmax scale of the model's attention layers (``scaling``), or ``head_dim ** -0.5``."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float) and hasattr(module, "layer_idx"):
            return scaling
    return head_dim**-0.5


# --------------------------------------------------------------------------- the LM head's row count


MOST = 12  # beyond it the measured kernels were even (16 rows 16 ms, 13 rows 13 ms)
MARGIN = 0.9  # pad only where the padded head took at most 90% of the time


class LogitRows:
    """How many rows the LM head multiplies in an eager CPU step: sometimes more than are sampled.

    A CPU BLAS picks its kernel by the matrix shape, and for a few row counts it picks a slow one. Measured
    on SmolLM2's head (``[M, 576] x [576, 49152]``, float32, AVX512+BF16, torch 2.13): 7 rows take 22.9 ms
    and 8 rows 11.3; 3 rows 19.9 and 4 rows 9.6; 11 rows 22.4 and 12 rows 12.3. A step samples one row per
    sequence (decode) or per prompt chunk, so a batch of 7 pays that on every step. `LogitRows` times, once
    per row count of 2 to `MOST`, the head on that many rows and on the next multiple of 4, and pads the
    rows (repeating the last index; the extra logits are dropped) where that was faster by
    `MARGIN`. Each logit row is the same dot products either way; only the blocking of the sum may differ
    in the last bits, as it does between any two batch sizes. The choices are kept per head shape for the
    whole process: two engines of one model (or of two equal ones) pad alike, so their logits are the
    same bits, whatever the timing noise of each one's first steps. Timing inputs are ones, not random:
    torch's global random state is the user's.
    """

    def __init__(self, head: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.head, self.hidden_size, self.dtype = head, hidden_size, dtype
        weight = getattr(head, "weight", None)
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else id(head)
        self.choice: dict[int, int] = _CHOICES.setdefault((type(head), shape, hidden_size, dtype), {})

    def rows(self, wanted: int) -> int:
        if wanted < 2 or wanted > MOST or wanted % 4 == 0:
            return wanted
        if wanted not in self.choice:
            padded = -(-wanted // 4) * 4
            try:
                faster = self._seconds(padded) < MARGIN * self._seconds(wanted)
            except Exception:  # a head that does not take [rows, hidden_size]: never padded
                faster = False
            self.choice[wanted] = padded if faster else wanted
        return self.choice[wanted]

    @torch.inference_mode()
    def _seconds(self, rows: int) -> float:
        x = torch.ones(rows, self.hidden_size, dtype=self.dtype)
        self.head(x)  # first call: allocation and kernel selection
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            self.head(x)
            best = min(best, time.perf_counter() - start)
        return best


_CHOICES: dict[tuple, dict[int, int]] = {}  # LogitRows' choices, by head type, shape and dtype


def padded_indices(logits_indices: torch.Tensor, rows: int) -> torch.Tensor:
    """`logits_indices` with its last index repeated up to `rows` entries."""
    extra = rows - logits_indices.shape[0]
    return torch.cat([logits_indices, logits_indices[-1:].expand(extra)]) if extra > 0 else logits_indices
