"""Whether a shard is worth compressing: ShardWriter compresses a few of its chunks first.

A compressed shard costs a decode on every install and on a local dataset's first read (a
64 MB shard: ~0.1-0.5 s of CPU) and is read from a decoded copy; an uncompressed one is
installed as downloaded and read where it lies. Data the codec cannot shrink (JPEG, audio,
video, random bytes) pays the first cost for nothing, so such a shard is stored uncompressed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc

#: A shard is stored compressed only where the codec saves at least this share of its bytes.
DEFAULT_MIN_SAVINGS = 0.1
#: Chunks of a shard compressed to decide, spread over the shard.
PROBE_CHUNKS = 8
#: The options of an uncompressed shard.
PLAIN = ipc.IpcWriteOptions()


def check_min_savings(value: Any) -> float:
    """``value`` as a share in [0, 1), or ValueError saying what it must be."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 <= value < 1):
        raise ValueError("compression_min_savings must be a number in [0, 1) (the share of a "
                         "shard's bytes the codec must save for the shard to be stored "
                         f"compressed; 0 compresses every shard), not {value!r}")
    return float(value)


def compression_pays(chunks: Sequence[pa.RecordBatch], options: ipc.IpcWriteOptions | None,
                     min_savings: float) -> bool:
    """Whether ``options`` (a codec's; None: no codec) store :data:`PROBE_CHUNKS` of
    ``chunks``, spread over them, in at most ``1 - min_savings`` of their plain bytes."""
    if options is None or min_savings == 0 or not chunks:
        return options is not None
    step = max(1, len(chunks) // PROBE_CHUNKS)
    probe = list(chunks[::step])[:PROBE_CHUNKS]
    plain = sum(encoded_size(c, PLAIN) for c in probe)
    packed = sum(encoded_size(c, options) for c in probe)
    return packed <= plain * (1 - min_savings)


def encoded_size(batch: pa.RecordBatch, options: ipc.IpcWriteOptions) -> int:
    """Bytes of ``batch`` as an Arrow IPC stream (schema and one batch) with ``options``."""
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, batch.schema, options=options) as writer:
        writer.write_batch(batch)
    return int(sink.getvalue().size)
