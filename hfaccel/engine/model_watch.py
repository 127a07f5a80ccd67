"""Whether the engine's model changed, so that no KV or CUDA graph made by the model as it was is used.

Two readings, both from the executor (`patches/model_state.py` for a transformers model):

- the **token**, a fingerprint of every weight, adapter, hook and config setting (about 1 ms on
  SmolLM2), read before steps that admit requests and whenever the sentinel moved: a new token forgets
  the prefix cache, and the captured CUDA graphs unless only values changed;
- the **sentinel**, a reading of the model-wide changes that costs a few microseconds (optimizer steps,
  the training flag, the adapter state of one adapter layer), read at every step. A change made and
  undone between two token readings (another thread's ``with model.disable_adapter(): model(x)``, a
  reference pass during training) would leave both tokens equal and the prefix cache holding KV the
  changed model computed; the sentinel sees a change at the first step boundary it is still there
  at, and a step the sentinel moved across forgets the prefix cache at its end (its blocks may hold
  either model's KV). A change made and undone within one step's forward is not seen.

An executor without a sentinel (a parallel model: its ranks must check at the same steps) is read at
admissions only.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable


class ModelWatch:
    """The last token and sentinel seen of a model (`token_of` None: the model is not watched)."""

    def __init__(
        self, token_of: Callable[[], Hashable] | None, sentinel_of: Callable[[], Hashable] | None
    ) -> None:
        self.token_of = token_of
        self.sentinel_of = sentinel_of if token_of is not None else None
        self.token = token_of() if token_of is not None else None
        self.sentinel = self.sentinel_of() if self.sentinel_of is not None else None
        # `force` calls counted in any thread, and those the stepping thread has applied: counts, not a
        # flag, so a call landing while a reading runs is applied at the next one, never lost.
        self._forced, self._applied = 0, 0

    def force(self) -> None:
        """Make the next reading report a change (its previous token None: nothing carried over), as if
        the model had changed: the engine then forgets its prefix cache and graphs there."""
        self._forced += 1

    @property
    def draws_dropout(self) -> bool:
        """Whether the model, at the last token reading, draws dropout in its forward (a module in train
        mode): its KV is then no function of the tokens, and no prefix may be shared."""
        return bool(getattr(self.token, "draws_dropout", False))

    def new_token(self) -> tuple[Hashable, Hashable] | None:
        """(previous, new) when the token changed since the last reading, else None."""
        if self.token_of is None:
            return None
        if self.sentinel_of is not None:  # before the token: a change between the two is read again
            self.sentinel = self.sentinel_of()
        forced = self._forced
        token = self.token_of()
        if token == self.token and forced == self._applied:
            return None
        previous, self.token = (None if forced != self._applied else self.token), token
        self._applied = forced
        return previous, token

    def sentinel_moved(self) -> bool:
        """Whether the sentinel changed since the last reading, or a change was forced (a token reading
        is then due)."""
        return self.sentinel_of is not None and (
            self._forced != self._applied or self.sentinel_of() != self.sentinel
        )

    def moved_during(self, mark: Hashable) -> bool:
        """Whether the sentinel changed since `mark` (read at a step's start): the step ran across a
        change. The next step then reads the token again."""
        if self.sentinel_of is None or self.sentinel_of() == mark:
            return False
        self.sentinel = None  # differs from any reading: the next step reads the token
        return True
