"""Large copies into staging buffers (``stream_copy``, and the checkpoint's ``copy_into`` over
it): the native core and its twin against ``numpy.copyto``, at the sizes where the native one
changes method (non-temporal stores from 256 KiB, parts of at least 4 MiB a thread), from and
to addresses of every alignment, and what each refuses."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from streamcache import _native
from streamcache.checkpoint.host_buffers import NATIVE_COPY_BYTES, copy_into
from streamcache.errors import NativeError

KIB, MIB = 1 << 10, 1 << 20
_EDGES = [0, 1, 15, 16, 63, 64, 65, 256 * KIB - 1, 256 * KIB, 256 * KIB + 17, 4 * MIB,
          8 * MIB + 3]


@given(size=st.one_of(st.sampled_from(_EDGES), st.integers(0, 9 * MIB)),
       src_shift=st.integers(0, 63), dst_shift=st.integers(0, 63), threads=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
@example(size=8 * MIB + 3, src_shift=1, dst_shift=7, threads=3, seed=0)
@example(size=256 * KIB, src_shift=0, dst_shift=15, threads=1, seed=1)
@settings(max_examples=40, deadline=None)
def test_stream_copy_is_a_copy(size: int, src_shift: int, dst_shift: int, threads: int,
                               seed: int) -> None:
    rng = np.random.default_rng(seed)
    source = rng.integers(0, 256, size + src_shift, dtype=np.uint8)[src_shift:]
    for name in _native.available_backends():
        guard = rng.integers(0, 256, size + dst_shift + 64, dtype=np.uint8)
        out = guard[dst_shift:dst_shift + size]
        before, after = guard[:dst_shift].copy(), guard[dst_shift + size:].copy()
        with _native.use(name):
            _native.stream_copy(source, out, threads)
        assert out.tobytes() == source.tobytes(), name
        # nothing written outside the destination (the native one writes its unaligned
        # ends and 64-byte blocks separately)
        assert guard[:dst_shift].tobytes() == before.tobytes(), name
        assert guard[dst_shift + size:].tobytes() == after.tobytes(), name


def _call(**changes: object) -> None:
    arguments: dict[str, object] = {"source": np.arange(64, dtype=np.uint8),
                                    "out": np.empty(64, np.uint8), "threads": 1}
    arguments.update(changes)
    _native.stream_copy(**arguments)  # type: ignore[arg-type]


_SHARED = np.zeros(1024, np.uint8)


@pytest.mark.parametrize("changes, message", [
    ({"out": np.empty(63, np.uint8)}, "source holds 64 bytes, out 63: give buffers of one "
                                      "size"),
    ({"out": np.empty(64, np.int8)}, "out must have dtype uint8"),
    ({"source": np.arange(64, dtype=np.int64)}, "source must have dtype uint8"),
    ({"source": np.arange(128, dtype=np.uint8)[::2]}, "source must be C-contiguous"),
    ({"out": np.empty((8, 8), np.uint8)}, "out must be one-dimensional"),
    ({"out": b"\0" * 64}, "out must be a numpy array"),
    ({"threads": 0}, "threads must be positive"),
    ({"threads": -2}, "threads must be positive"),
    ({"source": _SHARED[:512], "out": _SHARED[256:768]}, "source and destination overlap"),
    ({"source": _SHARED[:512], "out": _SHARED[:512]}, "source and destination overlap"),
])
def test_stream_copy_refuses_what_it_cannot_copy_and_says_why(backend: str, changes: dict,
                                                              message: str) -> None:
    out = changes.get("out")
    before = out.tobytes() if isinstance(out, np.ndarray) else None
    with pytest.raises(NativeError, match=message):
        _call(**changes)
    if isinstance(out, np.ndarray):
        assert out.tobytes() == before  # a refused copy wrote nothing


def test_stream_copy_refuses_a_read_only_output(backend: str) -> None:
    out = np.zeros(64, np.uint8)
    out.setflags(write=False)
    with pytest.raises(NativeError, match="out must be writable"):
        _call(out=out)


def test_adjacent_buffers_are_not_an_overlap(backend: str) -> None:
    shared = np.arange(512, dtype=np.uint8)
    _native.stream_copy(shared[:256], shared[256:], 2)
    assert shared[256:].tolist() == shared[:256].tolist()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(700, 300),  # large: the native copy
    lambda: torch.randn(NATIVE_COPY_BYTES // 2 + 3).to(torch.bfloat16),  # an odd byte count
    lambda: torch.randn(3, 5),  # small: Tensor.copy_
    lambda: torch.nn.Parameter(torch.randn(400, 400)),  # requires grad
    lambda: torch.randn(600, 400).t(),  # strided: Tensor.copy_
    lambda: torch.randn(300, 300, dtype=torch.complex64).conj(),  # a conjugate view
    lambda: torch.randint(0, 2, (300_000,), dtype=torch.bool),
    lambda: torch.empty(0, 7),
    lambda: torch.quantize_per_tensor(torch.randn(300, 300), 0.1, 0, torch.qint8),
])
def test_copy_into_leaves_the_buffer_equal_to_the_tensor(backend: str, make: object) -> None:
    with warnings.catch_warnings():  # (torch deprecates quantized tensors; they still exist)
        warnings.simplefilter("ignore", UserWarning)
        tensor = make()  # type: ignore[operator]
    buffer = torch.empty_like(tensor, requires_grad=False)
    copy_into(buffer, tensor, threads=2)
    if tensor.is_quantized:
        assert torch.equal(buffer.int_repr(), tensor.int_repr())
        assert torch.equal(buffer.dequantize(), tensor.dequantize())
        return
    assert torch.equal(buffer.resolve_conj(), tensor.detach().resolve_conj())
    assert buffer.dtype == tensor.dtype and buffer.shape == tensor.shape
