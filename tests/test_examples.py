"""The examples run end to end (on the embedded SmolLM2)."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_quickstart_runs():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Paris" in result.stdout
    assert "Engine(model=LlamaForCausalLM" in result.stdout


def test_grpo_rollouts_example_runs_on_the_tiny_model():
    pytest.importorskip("trl")
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "grpo_rollouts.py")], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "rollouts on the engine" in result.stdout
    assert "same tokens as HF generate: True" in result.stdout
