"""A pytest plugin that runs transformers' own generation tests on patched models, and counts how many
of their ``generate`` calls the engine serves.

transformers does not ship its tests in the wheel: check its repository (or its source distribution,
which has the top-level ``tests/test_*.py``) out next to the installed version, then, from that checkout::

    python -m pytest -p hfaccel.bench.hf_tests_plugin tests/models/llama/test_modeling_llama.py \\
        -k GenerationTesterMixin-test-names --junitxml patched.xml

and the same without ``-p hfaccel.bench.hf_tests_plugin`` for the baseline. Every model's first
``generate`` patches it (``hfaccel.patch``, defaults); each call into the patched ``generate`` counts,
and so does each fallback with its reason (a call transformers makes inside another, such as an
assistant model's in assisted decoding, is part of the outer call and not counted).
``HFACCEL_TESTS_LOG`` names a JSON-lines file that gets one
line per test: its id, outcome, calls, fallbacks (reason: count) and patch refusals. docs/fidelity.md
has the figures and the summary command (`summarize`).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
from typing import Any

import pytest

_counts: dict[str, Any] = {}


class _Depth(threading.local):
    value = 0


_depth = _Depth()


@contextlib.contextmanager
def _call() -> Any:
    """Inside one counted call; yields whether it is the outermost: a call that transformers makes
    inside another (an assistant model's `generate` in assisted decoding) is part of that call."""
    _depth.value += 1
    try:
        yield _depth.value == 1
    finally:
        _depth.value -= 1


def _reset() -> None:
    _counts.update(calls=0, fallbacks=collections.Counter(), refused=collections.Counter())


def _install() -> None:
    from transformers.generation.utils import GenerationMixin

    import hfaccel
    from hfaccel.api import patching
    from hfaccel.patches import generate as generate_module

    original_generate = GenerationMixin.generate
    served_generate = patching.patched_generate
    original_fall_back = generate_module.fall_back

    def first_generate_patches(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Reached by an unpatched model's first call, and by a patched model's fallback (its
        # "original" generate is this class attribute): the latter runs transformers' own.
        if getattr(self, "_hfaccel", None) is None:
            refusal = getattr(self, "_hfaccel_refused", None)
            if refusal is None:
                try:
                    hfaccel.patch(self, progress=False)
                except (ValueError, TypeError, NotImplementedError) as error:
                    refusal = self._hfaccel_refused = str(error)[:160]
                else:
                    return self.generate(*args, **kwargs)
            with _call() as outermost:  # a call of a model patch refused: not on the engine
                if outermost:
                    _counts["calls"] += 1
                    _counts["refused"][refusal] += 1
                return original_generate(self, *args, **kwargs)
        return original_generate(self, *args, **kwargs)

    def counted_generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _call() as outermost:
            _counts["calls"] += outermost
            return served_generate(self, *args, **kwargs)

    def counted_fall_back(state: Any, reason: str) -> None:
        if _depth.value == 1:  # the outermost call's own fallback
            _counts["fallbacks"][reason] += 1
        original_fall_back(state, reason)

    GenerationMixin.generate = first_generate_patches
    patching.patched_generate = counted_generate
    generate_module.fall_back = counted_fall_back


def pytest_configure(config: pytest.Config) -> None:
    _reset()
    _install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Any:
    _reset()
    yield


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    path = os.environ.get("HFACCEL_TESTS_LOG")
    if not path:
        return
    line = {
        "test": report.nodeid,
        "outcome": report.outcome,
        "calls": _counts["calls"],
        "fallbacks": dict(_counts["fallbacks"]),
        "refused": dict(_counts["refused"]),
    }
    with open(path, "a") as log:
        log.write(json.dumps(line) + "\n")


def summarize(path: str) -> dict[str, Any]:
    """Totals of a `HFACCEL_TESTS_LOG` file: tests by outcome, calls, calls on the engine, fallback
    reasons and refusals (most frequent first)."""
    outcomes: collections.Counter[str] = collections.Counter()
    fallbacks: collections.Counter[str] = collections.Counter()
    refused: collections.Counter[str] = collections.Counter()
    calls = 0
    with open(path) as log:
        for text in log:
            line = json.loads(text)
            outcomes[line["outcome"]] += 1
            calls += line["calls"]
            fallbacks.update(line["fallbacks"])
            refused.update(line["refused"])
    served = calls - sum(fallbacks.values()) - sum(refused.values())
    return {
        "outcomes": dict(outcomes),
        "calls": calls,
        "served": served,
        "fallbacks": fallbacks.most_common(),
        "refused": refused.most_common(),
    }


if __name__ == "__main__":
    import sys

    print(json.dumps(summarize(sys.argv[1]), indent=1))
