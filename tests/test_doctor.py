"""`python -m hfaccel doctor`: every backend checked or skipped with its reason, never a crash."""

import subprocess
import sys

import torch

from hfaccel.doctor import auto_limits_line, check_backend, environment


def test_torch_backend_checks_out_against_hf():
    report = check_backend("torch", torch.device("cpu"))
    assert report.status == "ok" and report.generate_match and report.kernel_error == 0.0


def test_a_backend_that_cannot_run_is_skipped_with_its_reason():
    report = check_backend("flashinfer", torch.device("cpu"))
    if not torch.cuda.is_available():
        assert report.status == "skipped" and "flashinfer" in report.detail


def test_environment_names_versions_and_isa():
    env = environment()
    assert env["torch"] == torch.__version__ and env["cpu isa"]


def test_cli_doctor_checks_triton_under_the_interpreter_on_cpu():
    result = subprocess.run(
        [sys.executable, "-m", "hfaccel", "doctor"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:] if line.strip()}
    assert " ok " in lines["torch"]
    if not torch.cuda.is_available():
        assert " ok " in lines["triton"] and "interpreter" in lines["triton"]
        assert "skipped" in lines["flashinfer"]


def test_doctor_reports_the_auto_batch_limits():
    line = auto_limits_line(torch.device("cpu"))
    assert "max_num_seqs=" in line and "(auto)" in line and "max_num_batched_tokens=2048 (auto)" in line


def test_a_first_difference_counts_only_at_a_near_tie():
    from hfaccel.doctor import first_difference_is_a_near_tie
    from tests.helpers import hf_greedy, tiny_model

    model = tiny_model("llama")
    prompt = [5, 9, 14, 3]
    ref = hf_greedy(model, prompt, 6)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ref[:2]])).logits[0, -1]
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    other = ref[:2] + [int(top.indices[1])] + ref[3:]  # the runner-up taken at token 2
    assert first_difference_is_a_near_tie(model, prompt, ref, ref, 0.0)
    assert first_difference_is_a_near_tie(model, prompt, other, ref, gap * 1.01)
    assert not first_difference_is_a_near_tie(model, prompt, other, ref, gap * 0.99)
    assert not first_difference_is_a_near_tie(model, prompt, ref[:-1], ref, 1.0)  # a length differs
