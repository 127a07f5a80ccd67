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


def test_the_hermes_response_template_reads_hermes_tool_calls():
    """`hfaccel serve MODEL --response-template examples/response_templates/hermes.json` for a model that
    writes Hermes-style calls (ChatML, `<tool_call>` JSON) without a template of its own (Hermes 2 Pro/3)."""
    from hfaccel.cli import _read_templates
    from hfaccel.patches.reply_parsing import ToolCall, parse_reply

    _, template = _read_templates(None, str(EXAMPLES / "response_templates" / "hermes.json"))
    reply = 'Checking.\n<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call><|im_end|>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parsed = parse_reply(
        template, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", list(reply), tools
    )
    assert (parsed.content, parsed.tool_calls) == (
        "Checking.",
        [ToolCall("get_weather", '{"city": "Paris"}')],
    )
