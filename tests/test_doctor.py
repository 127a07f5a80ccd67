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
