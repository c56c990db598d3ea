"""Test setup: Triton runs in its CPU interpreter unless a GPU is present; GPU tests are skipped without one."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

# Must be set before triton is imported anywhere (GPU.md): without a GPU, kernels run interpreted.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_sdc_warnings():
    # Tests assert on incidents directly; the warn policy's warnings would only clutter the output.
    from aegis_sdc import SilentDataCorruptionWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SilentDataCorruptionWarning)
        yield
