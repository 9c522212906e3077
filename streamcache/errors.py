"""The one exception family of streamcache.

Every error the project raises on purpose derives from :class:`StreamcacheError`, so a training
script can catch all of them in one place. Each message says what is wrong and what to do.
"""

from __future__ import annotations


class StreamcacheError(Exception):
    """Base class of every streamcache error."""


class NativeError(StreamcacheError):
    """A native (C++) job failed; ``code`` and ``item`` say what and where."""

    def __init__(self, message: str, code: int = -1, item: int = -1) -> None:
        super().__init__(message)
        self.code = code
        self.item = item


class RowOutOfRangeError(NativeError, IndexError):
    """A batch asked for a row or shard that does not exist."""


class CorruptDataError(StreamcacheError):
    """Bytes on disk or on the wire contradict their own structure or their index."""


class ShardCorruptError(CorruptDataError):
    """A shard is truncated, unreadable or structurally wrong."""


class ChecksumMismatchError(ShardCorruptError):
    """A shard's bytes do not hash to the checksum its index records."""


class ShardNotFoundError(StreamcacheError, FileNotFoundError):
    """A shard the index lists is gone (the dataset was replaced or removed after loading)."""


class IndexNotFoundError(StreamcacheError, FileNotFoundError):
    """There is no index.json where a dataset was expected."""


class IndexFormatError(CorruptDataError):
    """index.json is unreadable, of an unknown version, or inconsistent."""


class SchemaError(StreamcacheError, ValueError):
    """A sample or a shard does not match the dataset's schema, or a type is unsupported."""


class EmptyDatasetError(StreamcacheError, ValueError):
    """A dataset (or a conversion source) holds no samples."""


class DestinationError(StreamcacheError):
    """A destination cannot be written, or already holds a dataset."""


class SourceError(StreamcacheError):
    """A conversion or index source cannot be found or read."""


class CacheError(StreamcacheError):
    """The node cache cannot be used as configured, or a shard cannot be installed in it."""


class CacheBudgetError(CacheError, ValueError):
    """``cache_limit`` is smaller than the bytes that must be cached at once."""


class PrefetchError(StreamcacheError):
    """A shard could not be prefetched; raised in the reader that needed it."""


class TransformError(StreamcacheError, TypeError):
    """A user's ``transform`` or ``batch_transform`` returned something the loader cannot
    batch (the message names the transform and what it must return), or it or a
    ``collate_fn`` raised StopIteration, which would end the loop's iteration early."""


class ConfigError(StreamcacheError, ValueError):
    """An option has a value it cannot take (an unknown mode, a negative size, two options
    that exclude each other); raised when the object is made. The message names the option
    and the values it accepts."""


class UsageError(StreamcacheError, ValueError):
    """A value given by the user (a size, a duration, an option) cannot be read or used."""


class StorageError(StreamcacheError):
    """A URL cannot be opened: an unknown protocol, a missing fsspec backend, no credentials,
    or a store that cannot be reached. The message names the URL and what to do."""


class UnknownProtocolError(StorageError, ValueError):
    """A URL's protocol (``s4://``) is not one fsspec knows."""


class MissingDependencyError(StreamcacheError, ImportError):
    """An optional feature needs a package that is not installed; the message names the
    extra to install."""


class LoaderStateError(StreamcacheError):
    """A trainer checkpoint's loader state is missing, unreadable, or not where the trainer's
    own step count puts the job (``streamcache.integrations.transformers``)."""
