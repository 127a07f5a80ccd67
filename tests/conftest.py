import os

# Triton reads TRITON_INTERPRET when a kernel is decorated: set it before anything imports the kernels,
# so the Triton backend runs under its CPU interpreter wherever no GPU is asked for.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.helpers import tiny_model


@pytest.fixture(scope="session")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct (float32), loaded once per test session."""
    from hfaccel.default_model import load_default_model

    return load_default_model()
