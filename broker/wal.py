"""The broker's write-ahead log: what it acknowledged survives a kill -9 and a restart.

A folder of segments `wal-000001.log`, `wal-000002.log`, ...; each holds records

    [u32 length][u32 crc32 of payload][payload: msgpack [kind, body]]      (little-endian)

The first record of a segment written by `compact` is a snapshot of the whole broker state; every later
record is an event applied after it. Recovery reads from the newest segment that starts with a snapshot
(older ones are leftovers of a compaction interrupted before it deleted them) and replays every event. A
record cut short by a crash (the last one, usually) or failing its checksum ends the log there: the file is
truncated to the last good record, the loss is reported, and the broker starts. Nothing in a record is
executable: msgpack maps, lists, numbers, strings and raw bytes only.

A full disk (ENOSPC, a quota, a file-size limit, EIO) fails `flush` and changes nothing on disk: whatever the
failed write put there is cut off again, and every record stays pending in memory until a later `flush` writes
it whole. The broker sends nothing that depends on a pending record, so it stops acknowledging (and says why)
until the disk takes the records again; `error`, `write_errors` and `stalled_s` say what happened.

    python -m broker.wal RUN/broker-wal       # print what the log holds (records per kind, torn bytes)
"""

from __future__ import annotations

import argparse
import logging
import os
import struct
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

log = logging.getLogger("broker.wal")

_HEAD = struct.Struct("<II")
SNAPSHOT = "snapshot"
FOLDER = "broker-wal"
"""The log's folder in the run folder."""
MAX_RECORD_BYTES = 1 << 31  # a length above this is garbage, not a record
JOIN_BELOW_BYTES = 65536  # append_frames joins a message smaller than this into one write (bench/broker.py)
IOV_MAX = 1024  # pieces per writev (Linux's limit)


def _segment_name(n: int) -> str:
    return f"wal-{n:06d}.log"


def _segments(folder: Path) -> list[tuple[int, Path]]:
    out = []
    for p in folder.glob("wal-*.log"):
        try:
            out.append((int(p.stem.split("-")[1]), p))
        except (IndexError, ValueError):
            continue
    return sorted(out)


def _pack(kind: str, body: Any) -> bytes:
    payload = msgpack.packb([kind, body], use_bin_type=True)
    return _HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _pack_frames(kind: str, frames: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """The bytes of `_pack(kind, frames)` for a list of raw frames: [record header, payload] when small, else
    pieces that reference the frames instead of copying them into one payload (a large Transitions
    message was copied twice, bench/broker.py).
    msgpack's own encoding, spelled out: [kind, [bin, ...]] with the smallest array and bin headers."""
    n = len(frames)
    pieces: list[bytes | memoryview] = [
        b"\x92"
        + msgpack.packb(kind)
        + (
            bytes([0x90 | n])
            if n < 16
            else b"\xdc" + n.to_bytes(2, "big")
            if n < 1 << 16
            else b"\xdd" + n.to_bytes(4, "big")
        )
    ]
    for frame in frames:
        size = memoryview(frame).nbytes
        pieces.append(
            b"\xc4" + bytes([size])
            if size < 1 << 8
            else b"\xc5" + size.to_bytes(2, "big")
            if size < 1 << 16
            else b"\xc6" + size.to_bytes(4, "big")
        )
        pieces.append(frame)
    length = sum(memoryview(piece).nbytes for piece in pieces)
    if length < JOIN_BELOW_BYTES:  # small: one joined payload, one checksum call
        payload = b"".join(pieces)
        return [_HEAD.pack(length, zlib.crc32(payload)), payload]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return [_HEAD.pack(length, crc), *pieces]


@dataclass
class ReadResult:
    """What `read_segment` found: the records, and how many bytes at the end were torn or corrupt."""

    records: list[tuple[str, Any]] = field(default_factory=list)
    good_bytes: int = 0
    torn_bytes: int = 0
    reason: str = ""


def read_segment(path: Path) -> ReadResult:
    """Every intact record of one segment, stopping at the first torn or corrupt one."""
    data = path.read_bytes()
    res, pos = ReadResult(), 0
    while pos < len(data):
        if len(data) - pos < _HEAD.size:
            res.reason = "a record header cut short"
            break
        length, crc = _HEAD.unpack_from(data, pos)
        end = pos + _HEAD.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            res.reason = f"a record of {length} bytes cut short at {len(data) - pos - _HEAD.size}"
            break
        payload = data[pos + _HEAD.size : end]
        if zlib.crc32(payload) != crc:
            res.reason = "a record failing its checksum"
            break
        try:
            kind, body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types on garbage
            res.reason = f"a record that is not msgpack ({exc.__class__.__name__})"
            break
        res.records.append((kind, body))
        pos = end
    res.good_bytes = pos
    res.torn_bytes = len(data) - pos
    return res


class WriteAheadLog:
    """Append records, make them durable in batches, recover them, compact them behind a snapshot."""

    def __init__(self, folder: str | Path, fsync: bool = False):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.torn_bytes = 0  # cut off at recovery
        self.appended = 0
        self.segment = 0
        self._fd: int | None = None  # the open segment, O_APPEND
        self._size = 0  # bytes of the open segment that hold whole, flushed records
        self._pending: list[bytes | memoryview] = []  # appended, not yet written (`flush`)
        self._cut = False  # a failed flush may have left part of its records after `_size`: cut them off first
        self.error: OSError | None = None  # why the last flush failed; None once one succeeds
        self.write_errors = 0  # failed flushes (and failed compactions)
        self.failing_since: float | None = None  # monotonic time of the first failure of the current episode
        self.stalled_s = 0.0  # seconds spent in episodes of failure that ended

    # ------------------------------------------------------------------ recovery
    def recover(self) -> tuple[Any | None, list[tuple[str, Any]]]:
        """(snapshot body or None, events after it), and opens the log for appending after them."""
        segs = _segments(self.folder)
        start = 0
        for i, (_, path) in enumerate(segs):
            first = read_segment(path).records[:1]
            if first and first[0][0] == SNAPSHOT:
                start = i
        snapshot, events = None, []
        for i, (_n, path) in enumerate(segs):
            if i < start:
                path.unlink()  # superseded by the snapshot in a later segment
                continue
            res = read_segment(path)
            records = res.records
            if i == start and records and records[0][0] == SNAPSHOT:
                snapshot, records = records[0][1], records[1:]
            events.extend(records)
            if res.torn_bytes:
                self.torn_bytes += res.torn_bytes
                log.warning(
                    "%s: cut off %d bytes at its end (%s); every record before it is recovered",
                    path.name,
                    res.torn_bytes,
                    res.reason,
                )
                with open(path, "r+b") as f:
                    f.truncate(res.good_bytes)
                for _, later in segs[i + 1 :]:  # nothing after a torn record can be trusted to follow it
                    self.torn_bytes += later.stat().st_size
                    later.unlink()
                segs = segs[: i + 1]
                break
        self.segment = segs[-1][0] if segs else 1
        self._open(self.folder / _segment_name(self.segment))
        return snapshot, events

    def _open(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size

    # ------------------------------------------------------------------ writing
    def append(self, kind: str, body: Any) -> None:
        """Kept in memory: durable after the next `flush()`."""
        assert self._fd is not None, "call recover() first"
        self._pending.append(_pack(kind, body))
        self.appended += 1

    def append_frames(self, kind: str, frames: list[bytes | memoryview]) -> None:
        """`append(kind, frames)` for a message's raw frames, kept (and later written) without copying them."""
        assert self._fd is not None, "call recover() first"
        pieces = _pack_frames(kind, frames)
        if len(pieces) == 2:  # small: header + joined payload, one piece (cheaper than a piece each)
            self._pending.append(pieces[0] + pieces[1])
        else:
            self._pending.extend(pieces)
        self.appended += 1

    @property
    def pending_bytes(self) -> int:
        """Appended bytes not written yet (while a full disk fails `flush`, what waits for it)."""
        return sum(memoryview(p).nbytes for p in self._pending)

    def flush(self) -> None:
        """Hand appended records to the OS (survives the broker's death); with fsync, to the disk too.

        All or nothing: an OSError (ENOSPC, EDQUOT, EFBIG, EIO) cuts the segment back to its last flushed
        record and keeps every appended record pending, so that the next call writes them whole; it is raised
        (and kept in `error`) for the caller, which must not send anything that depends on them meanwhile."""
        if self._fd is None or not self._pending:
            return
        total, written = self.pending_bytes, 0
        try:
            if self._cut:
                os.ftruncate(self._fd, self._size)
                self._cut = False
            while written < total:  # one call, unless the disk took only part (then the next one raises)
                written += os.writev(self._fd, _skip(self._pending, written)[:IOV_MAX])
            if self.fsync:  # a failed fsync may have dropped the written pages: they are written again
                os.fsync(self._fd)
        except OSError as exc:
            self._cut = True
            self._failed(exc)
            raise
        self._size += written
        self._pending = []
        if self.failing_since is not None:
            self.stalled_s += time.monotonic() - self.failing_since
            log.warning(
                "the write-ahead log in %s is writable again after %.1fs",
                self.folder,
                time.monotonic() - self.failing_since,
            )
        self.error, self.failing_since = None, None

    def _failed(self, exc: OSError) -> None:
        self.write_errors += 1
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            log.error(
                "the write-ahead log in %s cannot be written (%s): nothing is acknowledged until it can; "
                "%d bytes wait in memory",
                self.folder,
                exc,
                self.pending_bytes,
            )
        self.error = exc

    def compact(self, snapshot: Any) -> None:
        """Start a new segment with `snapshot` (the whole state now) and delete the older segments.

        Written under a temporary name, synced and renamed: a crash at any point leaves either the old
        segments or the new one complete (recovery prefers the newest segment that starts with a snapshot).
        An OSError (a full disk) leaves the old segments as they were and is raised."""
        assert self._fd is not None
        self.flush()
        new = self.segment + 1
        tmp = self.folder / (_segment_name(new) + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_pack(SNAPSHOT, snapshot))
                f.flush()
                os.fsync(f.fileno())
        except OSError:
            self.write_errors += 1
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.folder / _segment_name(new))
        os.close(self._fd)
        for n, path in _segments(self.folder):
            if n < new:
                path.unlink()
        self.segment = new
        self._open(self.folder / _segment_name(new))

    def size_bytes(self) -> int:
        return sum(p.stat().st_size for _, p in _segments(self.folder))

    def close(self) -> None:
        """Flush and close. A flush that fails here loses only what was never acknowledged (it is reported)."""
        if self._fd is not None:
            try:
                self.flush()
            except OSError as exc:
                log.error(
                    "closing the write-ahead log: %d bytes could not be written (%s); none was acknowledged",
                    self.pending_bytes,
                    exc,
                )
            os.close(self._fd)
            self._fd = None


def _skip(pieces: list[bytes | memoryview], n: int) -> list[bytes | memoryview]:
    """`pieces` without their first `n` bytes (after a short write)."""
    for i, piece in enumerate(pieces):
        size = memoryview(piece).nbytes
        if n < size:
            return [memoryview(piece)[n:] if n else piece, *pieces[i + 1 :]]
        n -= size
    return []


def iter_records(folder: Path) -> Iterator[tuple[str, str, Any]]:
    """(segment name, kind, body) of every intact record, for inspection."""
    for _, path in _segments(folder):
        for kind, body in read_segment(path).records:
            yield path.name, kind, body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="the broker's WAL folder (RUN/broker-wal)")
    folder = parser.parse_args().folder
    kinds: Counter[str] = Counter()
    for _, kind, _ in iter_records(folder):
        kinds[kind] += 1
    for _n, path in _segments(folder):
        res = read_segment(path)
        print(
            f"{path.name}: {len(res.records)} records, {res.good_bytes} bytes"
            + (f", {res.torn_bytes} torn bytes ({res.reason})" if res.torn_bytes else "")
        )
    for kind, n in sorted(kinds.items()):
        print(f"  {kind}: {n}")


if __name__ == "__main__":
    main()
