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


@pytest.mark.slow
def test_demo_runs_and_outputs_match_hf():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hfaccel",
            "demo",
            "--num-prompts",
            "6",
            "--max-new-tokens",
            "24",
            "--batch-size",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "identical outputs: 6 of 6 requests" in out, out
    assert "speed-up:" in out and "ISA" in out and "dtype: float32" in out
    assert "prefix cache:" in out
