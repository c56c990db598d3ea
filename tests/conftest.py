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


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language's builtins (inspect.getmembers over its modules)
    at every launch, then again at every call of a @triton.jit helper inside the kernel, though the
    launch's patch is still in place: half the time of an interpreted training step (~4 800 helper
    calls a step of the tiny Llama). A helper's call patches only modules the launch did not, and
    the launch's restore still undoes everything. Semantics are the interpreter's own; with another
    interpreter layout this does nothing."""
    try:
        import inspect

        import triton.language as tl
        from triton.runtime import interpreter

        patch, empty_scope = interpreter._patch_lang, interpreter._LangPatchScope
    except (ImportError, AttributeError):
        return
    patched: set[int] = set()  # ids of the language modules the running launch has patched
    languages: dict[object, frozenset[int]] = {}  # a jit function's language modules, by function

    def patch_once(fn):
        if fn not in languages:
            modules = fn.__globals__.values()
            languages[fn] = frozenset(id(v) for v in modules if inspect.ismodule(v) and v in (tl, tl.core))
        wanted = languages[fn]
        if patched and wanted <= patched:  # a helper inside a launch: its modules are patched already
            return empty_scope()
        launch = not patched
        scope = patch(fn)
        if launch and not callable(getattr(scope, "restore", None)):
            return scope  # not the layout this was written for: no launch is tracked, nothing skipped
        patched.update(wanted)
        if launch:  # the launch's scope: its restore ends the launch
            restore = scope.restore
            scope.restore = lambda: (patched.clear(), restore())[1]
        return scope

    interpreter._patch_lang = patch_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


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
