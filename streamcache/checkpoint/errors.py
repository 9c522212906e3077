"""Checkpoint errors; every message says what is wrong and what to do."""

from __future__ import annotations

from ..errors import CorruptDataError, StreamcacheError


class CheckpointError(StreamcacheError):
    """A checkpoint could not be written, committed or loaded."""


class CheckpointWriteError(CheckpointError):
    """A background save failed on some rank; nothing was published for that step."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no complete checkpoint for the step that was asked for."""


class CheckpointCorruptError(CheckpointError, CorruptDataError):
    """A committed checkpoint's files contradict its commit marker (size or checksum)."""


class CheckpointUnsafeError(CheckpointError):
    """A checkpoint's pickle would construct more than plain values: it was not loaded."""
