"""Shared helpers for the format tests: backend selection and sample comparison."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import pytest

from streamcache import _native


@pytest.fixture(params=_native.available_backends())
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test once with the C++ core and once with its pure-Python twin."""
    with _native.use(request.param):
        yield request.param


def assert_sample_equal(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> None:
    assert set(expected) == set(actual)
    for name, want in expected.items():
        got = actual[name]
        if isinstance(want, (bytes, str)):
            assert got == want, name
        else:
            want_array = np.asarray(want)
            got_array = np.asarray(got)
            assert got_array.shape == want_array.shape, name
            assert got_array.tobytes() == want_array.astype(got_array.dtype).tobytes(), name
