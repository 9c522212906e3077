"""The local side of a download to a file: a temporary file beside the target, verified,
then published atomically; an error of the local file is told apart from the remote's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ChecksumMismatchError
from ..format import checksum as _checksum
from . import storage

#: Suffix of the temporary files :meth:`Fetcher.fetch_to_file` writes before the rename; a
#: file with this suffix is an unfinished download (a crash can leave one) and never data.
TEMP_SUFFIX = ".fetching"


def write_file(target: str, url: str, checksum: str | None,
               transfer: Callable[[Callable[[bytes], object]], int], *,
               durable: bool = True) -> int:
    """One attempt: ``transfer`` streams the body of ``url`` into a temporary file beside
    ``target`` (suffix :data:`TEMP_SUFFIX`), which is verified against ``checksum``, then
    renamed over ``target`` (fsynced first where ``durable``); returns the byte count. A
    failure leaves no temporary behind.

    Raises:
        _LocalIOError: the local file could not be written (not to be retried).
        ChecksumMismatchError: the bytes written fail ``checksum``.
    """
    # storage.atomic_path in two halves: only local errors bypass the retries
    temp = storage.temp_path(target, suffix=TEMP_SUFFIX)
    try:
        with _local_io():
            out = open(temp, "wb")  # noqa: SIM115  (closed by the with below)
        with out:
            received = transfer(_local_writer(out))
        _verify_file(temp, checksum, url)
        with _local_io():
            storage.publish_temp(temp, target, durable=durable)
    except BaseException:
        _remove_quietly(temp)
        raise
    return received


class _LocalIOError(Exception):
    """Carries an ``OSError`` of a local file past the retry logic, which re-raises it."""

    def __init__(self, original: OSError) -> None:
        super().__init__(str(original))
        self.original = original


@contextlib.contextmanager
def _local_io() -> Iterator[None]:
    try:
        yield
    except OSError as error:
        raise _LocalIOError(error) from error


def _local_writer(out: Any) -> Callable[[bytes], None]:
    def write(block: bytes) -> None:
        with _local_io():
            out.write(block)

    return write



def _verify_file(path: str, expected: str | None, url: str) -> None:
    if expected is None:
        return
    with _local_io():
        actual = _checksum.checksum_file(path)
    if actual != expected:
        raise ChecksumMismatchError(
            f"{url}: checksum {actual} does not match the index's {expected}; the object is "
            "corrupt or was rewritten after indexing (re-run `streamcache index` if it was "
            "rewritten on purpose)"
        )



def _remove_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
