"""The write-ahead log: records survive, a torn tail is cut off, compaction keeps exactly the snapshot."""

import shutil
from pathlib import Path

import numpy as np

from broker.wal import WriteAheadLog, _pack, _pack_frames, read_segment


def test_records_round_trip_and_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    assert wal.recover() == (None, [])
    for i in range(5):
        wal.append("admit", ["actor-0", 0, i])
    wal.append("transition", [b"\x00\x01", b"raw"])
    wal.flush()
    seg = next(tmp_path.glob("wal-*.log"))
    full = seg.stat().st_size
    # A kill -9 in the middle of a write: the last record is cut 3 bytes short.
    with open(seg, "r+b") as f:
        f.truncate(full - 3)
    wal2 = WriteAheadLog(tmp_path)
    snapshot, events = wal2.recover()
    assert snapshot is None
    assert events == [("admit", ["actor-0", 0, i]) for i in range(5)]  # the torn transition is gone
    assert wal2.torn_bytes > 0 and seg.stat().st_size == read_segment(seg).good_bytes
    wal2.append("admit", ["actor-1", 0, 0])  # appending after the cut continues a valid log
    wal2.close()
    assert WriteAheadLog(tmp_path).recover()[1][-1] == ("admit", ["actor-1", 0, 0])


def test_a_flipped_byte_fails_the_checksum_and_ends_the_log_there(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.recover()
    for i in range(4):
        wal.append("version", [i, False, -1])
    wal.close()
    seg = next(tmp_path.glob("wal-*.log"))
    data = bytearray(seg.read_bytes())
    # Records are equal-sized here: flip a byte inside the payload of the third.
    size = len(data) // 4
    data[2 * size + 10] ^= 0xFF
    seg.write_bytes(bytes(data))
    _, events = WriteAheadLog(tmp_path).recover()
    assert [e[1][0] for e in events] == [0, 1]


def test_compaction_keeps_the_snapshot_and_later_events_only(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.recover()
    wal.append("admit", ["a", 0, 0])
    wal.compact({"state": 1})
    wal.append("admit", ["a", 0, 1])
    wal.close()
    assert [p.name for p in sorted(tmp_path.glob("wal-*.log"))] == ["wal-000002.log"]
    assert WriteAheadLog(tmp_path).recover() == ({"state": 1}, [("admit", ["a", 0, 1])])


def test_a_compaction_interrupted_before_deleting_old_segments_recovers_from_the_snapshot(tmp_path: Path) -> None:
    wal = WriteAheadLog(tmp_path)
    wal.recover()
    wal.append("admit", ["a", 0, 0])
    wal.flush()
    old = tmp_path / "keep.log"
    shutil.copy(tmp_path / "wal-000001.log", old)
    wal.compact({"state": 2})
    wal.close()
    shutil.copy(old, tmp_path / "wal-000001.log")  # as if the crash came before the unlink
    (tmp_path / "wal-000003.log.tmp").write_bytes(b"half a snapshot")  # and a later one died half-written
    old.unlink()
    snapshot, events = WriteAheadLog(tmp_path).recover()
    assert snapshot == {"state": 2} and events == []
    assert not (tmp_path / "wal-000001.log").exists()


def test_frames_are_written_as_the_same_bytes_as_a_packed_record(tmp_path: Path) -> None:
    # msgpack switches header sizes at these lengths: bin8 < 256 <= bin16 < 65,536 <= bin32, fixarray < 16 <= array16
    rng = np.random.default_rng(0)
    sizes = [0, 1, 255, 256, 65535, 65536, 70000]
    for n_frames in (1, 7, 15, 16, 17):
        frames = [rng.integers(0, 256, int(rng.choice(sizes)), dtype=np.uint8).tobytes() for _ in range(n_frames)]
        views = [memoryview(f) for f in frames]  # as the broker passes them: views of the received buffers
        assert b"".join(bytes(p) for p in _pack_frames("transitions", views)) == _pack("transitions", frames)
    wal = WriteAheadLog(tmp_path)
    wal.recover()
    big = bytes(range(256)) * 300  # above JOIN_BELOW_BYTES: written piece by piece
    wal.append_frames("transition", [memoryview(b"head"), memoryview(bytes(300))])
    wal.append("count", "x")
    wal.append_frames("transitions", [memoryview(b"head"), memoryview(big)])
    wal.close()
    assert read_segment(next(tmp_path.glob("wal-*.log"))).records == [
        ("transition", [b"head", bytes(300)]),
        ("count", "x"),
        ("transitions", [b"head", big]),
    ]
