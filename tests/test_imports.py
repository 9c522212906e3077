"""`import streamcache` is light: the exception family only; every other public name loads on
first use and is still importable, as an attribute and with ``from streamcache import X``.

Checked by what a fresh interpreter has imported, not by timing (benchmarks/bench_chaos.py
measures the import time).
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import streamcache

HEAVY = ("pyarrow", "fsspec", "torch.distributed.checkpoint", "aiohttp", "zstandard",
         "streamcache.format", "streamcache.loading", "streamcache.checkpoint")


def _fresh(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_streamcache_loads_no_heavy_module() -> None:
    out = _fresh(f"import sys, streamcache; print([m for m in {HEAVY!r} if m in sys.modules])")
    assert out.strip() == "[]"


def test_every_public_name_is_importable_and_listed_by_dir() -> None:
    for name in streamcache.__all__:
        assert getattr(streamcache, name) is not None, name
    exec("from streamcache import " + ", ".join(streamcache.__all__), {})
    assert set(streamcache.__all__) <= set(dir(streamcache))


def test_lazy_names_are_the_objects_of_their_modules() -> None:
    from streamcache.checkpoint import Checkpointer
    from streamcache.loading.loader import StreamLoader
    from streamcache.plan import PlanError

    assert streamcache.Checkpointer is Checkpointer
    assert streamcache.StreamLoader is StreamLoader
    assert streamcache.PlanError is PlanError
    assert issubclass(streamcache.PlanError, streamcache.StreamcacheError)
    try:
        streamcache.NoSuchName  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchName" in str(exc)
    else:
        raise AssertionError("an unknown name must raise AttributeError")


def test_the_suite_ignores_pynvml_13s_deprecation_from_torch_and_nothing_wider() -> None:
    """With the ``resilience`` extra installed (nvidia-resiliency-ext brings pynvml 13),
    ``import torch`` warns that pynvml is deprecated; under pyproject's
    ``filterwarnings = error`` that failed the collection of every test module."""
    message = ("The pynvml package is deprecated. Please install nvidia-ml-py instead. If you "
               "did not install pynvml directly, please report this to the maintainers of the "
               "package that installed pynvml for you.")
    warnings.warn_explicit(message, FutureWarning, "torch/cuda/__init__.py", 64,
                           module="torch.cuda")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit("another warning", FutureWarning, "torch/cuda/__init__.py", 64,
                               module="torch.cuda")
    with pytest.raises(FutureWarning):
        warnings.warn_explicit(message, FutureWarning, "streamcache/x.py", 1,
                               module="streamcache.x")
