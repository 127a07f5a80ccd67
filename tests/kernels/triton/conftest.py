"""Triton kernel tests run under the Triton interpreter unless told otherwise.

``TRITON_INTERPRET`` is read when a kernel is decorated, so it is set before the kernel modules are imported.
Set ``TRITON_INTERPRET=0`` on a CUDA machine to run the same tests compiled on the GPU.
The full hypothesis sweep (marker ``kernels_full``) runs only with ``HFACCEL_FULL_KERNEL_TESTS=1``.
"""

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

FULL = os.environ.get("HFACCEL_FULL_KERNEL_TESTS") == "1"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "kernels_full: full Triton kernel sweep, run only with HFACCEL_FULL_KERNEL_TESTS=1"
    )


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="full kernel sweep: set HFACCEL_FULL_KERNEL_TESTS=1 (make test-kernels)")
    for item in items:
        if "kernels_full" in item.keywords:
            item.add_marker(skip)
