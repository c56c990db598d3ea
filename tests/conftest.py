"""Test setup: Triton runs in its CPU interpreter unless a GPU is present; GPU tests are skipped without one."""

from __future__ import annotations

import os
import warnings

# Under pytest-xdist (`pytest -n 2`) each worker gets its share of the cores: two workers with a
# thread pool each as wide as the machine oversubscribe it, and OpenMP's and BLAS's waiting threads
# spin — on CI's two cores the suite ran several times slower. Set before torch and numpy load.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, _THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(_THREADS))

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
