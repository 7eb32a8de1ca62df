"""Message types of a ring: named variable-length numpy arrays with fixed dtypes, and their byte layout.

A `Record` declares the arrays of one message type (`Record("tokens", ("req", np.int64), ...)`); a
`Vocabulary` is the set of records one ring carries, with a layout hash that an attacher checks against
the segment so that a stale or foreign segment fails loudly instead of being misread.

Body layout of one message: the element count of each array as little-endian uint64, padded to
ALIGN bytes, then each array's bytes, each starting on an ALIGN boundary.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.errors import ProtocolError

ALIGN = 16
Buffer = Any  # anything with the writable buffer protocol: mmap, bytearray, numpy array
FORMAT_VERSION = 1


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


class Record:
    """One message type: a name and its arrays, each `(name, dtype)`; every array is 1-D.

    Immutable after construction; the per-field dtypes, item sizes and the struct of the counts are
    precomputed because building views is on every ring operation's path.
    """

    __slots__ = ("_counts", "_dtypes", "_index", "_itemsizes", "fields", "header_bytes", "name")

    def __init__(self, name: str, *fields: tuple[str, npt.DTypeLike]) -> None:
        self.name = name
        self.fields: tuple[tuple[str, np.dtype], ...] = tuple((n, np.dtype(d)) for n, d in fields)
        names = [n for n, _ in self.fields]
        if len(set(names)) != len(names):
            raise ValueError(f"record {name!r} repeats a field name: {names}")
        for fname, dtype in self.fields:
            if dtype.hasobject:
                raise ValueError(
                    f"record {name!r} field {fname!r}: object dtypes cannot cross processes"
                )
        self._index = {n: i for i, n in enumerate(names)}
        self._dtypes = tuple(d for _, d in self.fields)
        self._itemsizes = tuple(d.itemsize for _, d in self.fields)
        self._counts = struct.Struct(f"<{len(self.fields)}Q")
        self.header_bytes = align_up(8 * len(self.fields))

    def __repr__(self) -> str:
        return f"Record({self.describe()})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Record) and self.describe() == other.describe()

    def __hash__(self) -> int:
        return hash(self.describe())

    def __getstate__(self) -> tuple[str, tuple[tuple[str, np.dtype], ...]]:
        return self.name, self.fields

    def __setstate__(self, state: tuple[str, tuple[tuple[str, np.dtype], ...]]) -> None:
        name, fields = state
        Record.__init__(self, name, *fields)

    @property
    def field_names(self) -> tuple[str, ...]:
        return tuple(self._index)

    def describe(self) -> str:
        """A canonical text of the layout: what the hash is taken over."""
        parts = [f"{n}:{d.str if d.fields is None else repr(d.descr)}" for n, d in self.fields]
        return f"{self.name}({','.join(parts)})"

    def body_bytes(self, counts: Sequence[int]) -> int:
        total = self.header_bytes
        for itemsize, count in zip(self._itemsizes, counts, strict=True):
            total += (count * itemsize + ALIGN - 1) // ALIGN * ALIGN
        return total

    def counts_of(self, arrays: Mapping[str, np.ndarray]) -> list[int]:
        """Element counts of the given arrays, in field order; every field must be given, 1-D."""
        if len(arrays) != len(self.fields) or any(n not in self._index for n in arrays):
            raise ValueError(
                f"record {self.name!r} takes exactly {self.field_names}, got {tuple(arrays)}"
            )
        counts = []
        for fname, _ in self.fields:
            arr = arrays[fname]
            if np.ndim(arr) != 1:
                raise ValueError(f"record {self.name!r} field {fname!r} must be 1-D")
            counts.append(len(arr))
        return counts

    def pack_counts(self, buf: Buffer, offset: int, counts: Sequence[int]) -> None:
        self._counts.pack_into(buf, offset, *counts)

    def unpack_counts(self, buf: Buffer, offset: int) -> tuple[int, ...]:
        return self._counts.unpack_from(buf, offset)

    def write_layout(
        self, buf: Buffer, offset: int, counts: Sequence[int]
    ) -> dict[str, np.ndarray]:
        """Write the counts of a body starting at buf[offset]; return writable views to fill."""
        self._counts.pack_into(buf, offset, *counts)
        return self._views(buf, offset, counts)

    def read_views(self, buf: Buffer, offset: int = 0, size: int = -1) -> dict[str, np.ndarray]:
        """Views onto the body at buf[offset:offset+size] written by write_layout (or encode)."""
        counts = self._counts.unpack_from(buf, offset)
        if size < 0:
            size = len(memoryview(buf)) - offset
        out = {}
        end = offset + size
        offset += self.header_bytes
        for (fname, dtype), itemsize, count in zip(
            self.fields, self._itemsizes, counts, strict=True
        ):
            nbytes = count * itemsize
            if offset + nbytes > end:
                raise ProtocolError(
                    f"record {self.name!r} field {fname!r}: {count} items run past the message end"
                )
            out[fname] = np.frombuffer(buf, dtype, count, offset)
            offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        return out

    def _views(self, buf: Buffer, offset: int, counts: Sequence[int]) -> dict[str, np.ndarray]:
        out = {}
        offset += self.header_bytes
        for (fname, dtype), itemsize, count in zip(
            self.fields, self._itemsizes, counts, strict=True
        ):
            out[fname] = np.frombuffer(buf, dtype, count, offset)
            offset += (count * itemsize + ALIGN - 1) // ALIGN * ALIGN
        return out


class Vocabulary:
    """The records one ring carries; a record's type id is its index here."""

    def __init__(self, name: str, records: Sequence[Record]) -> None:
        self.name = name
        self.records: tuple[Record, ...] = tuple(records)
        self._ids = {r.name: i for i, r in enumerate(self.records)}
        if len(self._ids) != len(self.records):
            raise ValueError(f"vocabulary {name!r} repeats a record name")
        text = f"v{FORMAT_VERSION};{name};" + ";".join(r.describe() for r in self.records)
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        self.layout_hash: int = int.from_bytes(digest, "little", signed=True)

    def type_id(self, record: Record | str) -> int:
        key = record if isinstance(record, str) else record.name
        try:
            return self._ids[key]
        except KeyError:
            raise ValueError(f"vocabulary {self.name!r} has no record {key!r}") from None

    def record(self, type_id: int) -> Record:
        if not 0 <= type_id < len(self.records):
            raise ProtocolError(f"vocabulary {self.name!r} has no type id {type_id}")
        return self.records[type_id]

    def __repr__(self) -> str:
        return f"Vocabulary({self.name!r}, {[r.name for r in self.records]})"


def encode(record: Record, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """A message body as a fresh uint8 array (for transports that need bytes, and for tests)."""
    counts = record.counts_of(arrays)
    body = np.zeros(record.body_bytes(counts), np.uint8)
    for fname, view in record.write_layout(body, 0, counts).items():
        view[:] = arrays[fname]
    return body
