"""The one exception family: every error class is importable from ``streamcache`` itself."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys

import streamcache
from streamcache.errors import StreamcacheError


def _public_error_classes() -> dict[str, type]:
    """Every public StreamcacheError subclass defined in any streamcache module."""
    found: dict[str, type] = {}
    for module_info in pkgutil.walk_packages(streamcache.__path__, "streamcache."):
        if module_info.name.rsplit(".", 1)[-1].startswith("_") and not module_info.name.endswith(
                "plan._util"):
            continue
        module = importlib.import_module(module_info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, StreamcacheError)
                    and not name.startswith("_") and value.__module__ == module.__name__):
                found[name] = value
    return found


def test_every_error_class_is_importable_from_the_package() -> None:
    classes = _public_error_classes()
    assert {"CursorMismatchError", "CheckpointCorruptError", "CheckpointNotFoundError",
            "CacheBudgetError", "PrefetchError", "NativeError"} <= set(classes)
    for name, cls in classes.items():
        assert getattr(streamcache, name) is cls, name
        assert name in streamcache.__all__, name


def test_importing_the_package_and_its_errors_does_not_import_torch() -> None:
    code = ("import sys, streamcache\n"
            "from streamcache import CacheBudgetError, CursorMismatchError, GoodputError\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"


def test_importing_the_package_does_not_import_the_http_stacks() -> None:
    # aiohttp and botocore cost every fresh process (the CLI too) a quarter of a second;
    # the fetcher loads them when it first reads something remote
    code = ("import sys, streamcache\n"
            "print(sorted(m for m in ('aiohttp', 'botocore') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_lazily_loaded_checkpoint_errors_are_the_real_classes() -> None:
    from streamcache import CheckpointError, CursorMismatchError
    from streamcache.checkpoint.errors import CheckpointError as Real
    from streamcache.plan import CursorMismatchError as RealCursor

    assert CheckpointError is Real and CursorMismatchError is RealCursor
    assert issubclass(CheckpointError, StreamcacheError)
