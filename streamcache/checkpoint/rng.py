"""Per-rank random number generator states as JSON-able data.

Captured: Python's ``random``, numpy's legacy global generator, torch's CPU generator and,
when CUDA is initialized, every CUDA device's generator. A rank that did not exist when the
checkpoint was written (the world grew) gets states derived from (seed, rank, step), so a
restart is deterministic whatever the world size.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
from typing import Any

import numpy as np
import torch

RNG_VERSION = 1
K_VERSION, K_PYTHON, K_NUMPY, K_TORCH, K_CUDA = "version", "python", "numpy", "torch", "cuda"


def rng_key(rank: int) -> str:
    """The DCP key of one rank's RNG states (rank-unique, so DCP never deduplicates them)."""
    return f"_streamcache_rng_rank{rank}"


def capture() -> dict[str, Any]:
    """This process's RNG states as a JSON-able dict."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        K_VERSION: RNG_VERSION,
        K_PYTHON: [py_version, list(py_state), py_gauss],
        K_NUMPY: [str(np_name), np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss),
                  float(np_gauss)],
        K_TORCH: _b64(torch.get_rng_state()),
        K_CUDA: None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[K_CUDA] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def check(state: Any) -> None:
    """Raise ValueError unless ``state`` is what :func:`capture` returns; sets nothing.

    Each part is set on a fresh generator of its kind (not this process's), so whatever
    :func:`restore` would refuse is refused here first.
    """
    try:
        if not isinstance(state, dict) or state.get(K_VERSION) != RNG_VERSION:
            version = state.get(K_VERSION) if isinstance(state, dict) else state
            raise ValueError(f"unknown RNG state version {version!r}")
        py_version, py_state, py_gauss = state[K_PYTHON]
        random.Random().setstate((py_version, tuple(py_state), py_gauss))
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = state[K_NUMPY]
        np.random.RandomState().set_state((np_name, np.asarray(np_keys, dtype=np.uint32),
                                           np_pos, np_has_gauss, np_gauss))
        torch.Generator().set_state(_unb64(state[K_TORCH]))
        cuda_states = state.get(K_CUDA)
        if cuda_states is not None:
            for text in cuda_states:
                _unb64(text)
    except ValueError:
        raise
    except Exception as exc:  # wrong types, lengths, encodings: all mean "not an RNG state"
        raise ValueError(f"malformed RNG state ({type(exc).__name__}: {exc})") from exc


def restore(state: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture`'s output (checked by :func:`check`
    first: a malformed state sets nothing).

    CUDA states are restored only when CUDA is available here; a checkpoint from a GPU job
    restored on a CPU-only machine keeps the CPU generators exact and skips CUDA's.
    """
    check(state)
    py_version, py_state, py_gauss = state[K_PYTHON]
    random.setstate((py_version, tuple(py_state), py_gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state[K_NUMPY]
    np.random.set_state((np_name, np.asarray(np_keys, dtype=np.uint32), np_pos, np_has_gauss,
                         np_gauss))
    torch.set_rng_state(_unb64(state[K_TORCH]))
    cuda_states = state.get(K_CUDA)
    if cuda_states and torch.cuda.is_available():
        count = min(len(cuda_states), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([_unb64(s) for s in cuda_states[:count]])


def derive(seed: int, rank: int, step: int) -> None:
    """Seed every generator from (seed, rank, step): the state of a rank that was not saved."""
    digest = hashlib.sha256(f"streamcache-rng:{seed}:{rank}:{step}".encode()).digest()
    derived = int.from_bytes(digest[:8], "little")
    random.seed(derived)
    np.random.seed(derived % (2**32))
    torch.manual_seed(derived)  # also seeds every CUDA device


def encode(state: dict[str, Any]) -> str:
    return json.dumps(state, separators=(",", ":"))


def decode(text: str) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(text)
    return result


def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)
