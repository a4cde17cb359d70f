"""The fleet's committed-weights record is read and written safely: whatever sits at
its path (a FIFO, a folder, a device, a huge or hostile file) reading it answers at
once with a ValueError naming what is wrong, never hangs or crashes; a trainer given
``committed=`` replaces a record it cannot read; writers never share a temp file."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rl_client.committed import (
    CheckpointSource,
    CommittedRecord,
    CommittedWeights,
    EtcdCommittedStore,
    FileCommittedStore,
)
from rl_client.committed_strict import MAX_RECORD_BYTES
from rl_client.etcd_gateway import b64
from rl_client.refit_report import Deadlines
from tests.rl_client.fleet_fakes import Obedient

WEIGHTS = CommittedWeights("7", CheckpointSource("/ckpt/step-7"))
GOOD = json.loads(CommittedRecord(WEIGHTS, ("a",), 1.5).to_json())


def within(seconds: float, work: Callable[[], object], unblock: Callable[[], None]) -> object:
    """``work()``'s result or exception, or a failed test if it takes longer than
    ``seconds`` (then ``unblock()`` frees the thread, so the test run goes on)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        unblock()
        thread.join(5)
        pytest.fail(f"still blocked after {seconds} s")
    return outcome[0]


def open_fifo_writer(path: Path) -> None:
    """A reader blocked opening the FIFO at ``path`` gets its end of file."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


@pytest.fixture
def store(tmp_path: Path) -> FileCommittedStore:
    store = FileCommittedStore(tmp_path, "ns", "backend")
    store.path.parent.mkdir(parents=True)
    return store


def test_a_fifo_at_the_path_is_refused_at_once(store: FileCommittedStore) -> None:
    os.mkfifo(store.path)
    outcome = within(2, store.read, lambda: open_fifo_writer(store.path))
    assert isinstance(outcome, ValueError) and "a FIFO" in str(outcome)


def test_a_symlink_to_a_fifo_is_refused_at_once(store: FileCommittedStore, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    store.path.symlink_to(fifo)
    outcome = within(2, store.read, lambda: open_fifo_writer(fifo))
    assert isinstance(outcome, ValueError) and "a FIFO" in str(outcome)


def test_a_folder_or_a_device_at_the_path_is_refused(store: FileCommittedStore) -> None:
    store.path.mkdir()
    with pytest.raises(ValueError, match="a directory"):
        store.read()
    store.path.rmdir()
    store.path.symlink_to("/dev/zero")  # endless: read whole, it would never end
    outcome = within(2, store.read, lambda: None)
    assert isinstance(outcome, ValueError) and "a character device" in str(outcome)


def test_an_oversized_record_is_refused_naming_its_size(store: FileCommittedStore) -> None:
    record = dict(GOOD, path="/" + "x" * MAX_RECORD_BYTES)
    store.path.write_bytes(json.dumps(record).encode())
    size = store.path.stat().st_size
    with pytest.raises(ValueError, match=f"{size} bytes, more than the cap of {MAX_RECORD_BYTES}"):
        store.read()
    # Nor can a record that large be written: no one could read it back.
    big = CommittedRecord(WEIGHTS, tuple(f"worker-{i:06}" for i in range(MAX_RECORD_BYTES // 8)))
    with pytest.raises(ValueError, match=f"more than the cap of {MAX_RECORD_BYTES}"):
        store.publish(big)
    assert store.path.stat().st_size == size  # left as it was


def test_a_deeply_nested_record_is_a_value_error(store: FileCommittedStore) -> None:
    store.path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ValueError, match="more than the cap"):  # refused unparsed
        store.read()
    store.path.write_bytes(b"[" * 30_000 + b"]" * 30_000)  # within the cap: too deep
    with pytest.raises(ValueError, match="nested 30000 deep, more than 16"):
        store.read()
    hostile = b'"' + b'\\"' * 30_000  # one unclosed string: scanned once, not per quote
    outcome = within(2, lambda: CommittedRecord.from_json(hostile), lambda: None)
    assert isinstance(outcome, ValueError) and "not JSON" in str(outcome)
    deep_but_legal = dict(GOOD, extra={"a": [[[["]]]]]]}"]]]]})  # brackets in a string
    assert CommittedRecord.from_json(json.dumps(deep_but_legal).encode()).weights == WEIGHTS


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (json.dumps(GOOD).replace("1.5", "1e999"), "out of range"),
        (json.dumps(GOOD).replace("1.5", "1" + "0" * 400), "out of range"),
        (json.dumps(GOOD).replace("1.5", "NaN"), "NaN"),
        (json.dumps(GOOD).replace("1.5", "-Infinity"), "-Infinity"),
        (json.dumps(GOOD).replace("1.5", "-3"), "committed_unix_s"),
        (json.dumps(GOOD).replace("1.5", "true"), "committed_unix_s"),
        (json.dumps(GOOD).replace('"schema": 1', '"schema": true'), "schema True"),
        (json.dumps(GOOD).replace('"schema": 1', '"schema": 1' + "0" * 5000), "out of range"),
        (json.dumps(dict(GOOD, version=7)), "no version"),
        (json.dumps(dict(GOOD, version="a\nb")), "printable"),
        (json.dumps(dict(GOOD, source=["checkpoint"])), "source"),
        (json.dumps(dict(GOOD, path={"p": 1})), "source"),
        (json.dumps(dict(GOOD, workers={"a": 1})), "workers"),
        (json.dumps(dict(GOOD, workers=[1])), "workers"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "version"}), "no version"),
        (json.dumps([GOOD]), "not a JSON object"),
        ('{"schema": 1', "not JSON"),
        (b'{"schema": 1, "version": "\xff"}', "UTF-8"),
    ],
)
def test_every_malformed_record_is_a_value_error_naming_the_problem(
    raw: str | bytes, problem: str
) -> None:
    data = raw.encode() if isinstance(raw, str) else raw
    with pytest.raises(ValueError, match=problem) as refused:
        CommittedRecord.from_json(data)
    assert type(refused.value) is ValueError
    assert len(str(refused.value)) < 400  # a hostile value is not repeated whole


class CannedEtcd(EtcdCommittedStore):
    """The gateway's answer to ``kv/range``, as the test writes it."""

    def __init__(self, answer: Any) -> None:
        super().__init__(["http://127.0.0.1:9"], "ns")
        self.answer = answer

    def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert path == "kv/range"
        return self.answer


def etcd_value(raw: bytes) -> dict[str, Any]:
    return {"kvs": [{"key": b64(b"k"), "value": b64(raw)}]}


@pytest.mark.parametrize(
    ("answer", "problem"),
    [
        (etcd_value(b"[" * 100_000 + b"]" * 100_000), "bytes, more than the cap"),
        (etcd_value(b"[" * 20_000 + b"]" * 20_000), "nested"),
        (
            etcd_value(b" " * MAX_RECORD_BYTES + b"x"),
            f"bytes, more than the cap of {MAX_RECORD_BYTES}",
        ),
        (etcd_value(json.dumps(GOOD).replace("1.5", "1e999").encode()), "out of range"),
        ({"kvs": [{"value": "not base64!"}]}, "base64"),
        ({"kvs": [{"value": 5}]}, "value"),
        ({"kvs": ["x"]}, "kvs"),
        ({"kvs": {"a": 1}}, "kvs"),
        (["not", "an", "object"], "answer"),
    ],
)
def test_the_etcd_record_gets_the_same_checks(answer: Any, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as refused:
        CannedEtcd(answer).read()
    assert type(refused.value) is ValueError


def test_the_etcd_record_reads_back() -> None:
    record = CommittedRecord(WEIGHTS, ("a",), 1.5)
    assert CannedEtcd(etcd_value(record.to_json())).read() == record
    assert CannedEtcd({"header": {}}).read() is None


def test_two_writers_in_one_process_never_share_a_temp_file(
    store: FileCommittedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both writers hold their temp file written before either renames it.
    both_written = threading.Barrier(2, timeout=10)
    temps: list[str] = []
    real_replace = os.replace

    def replace(src: Any, dst: Any) -> None:
        temps.append(os.fspath(src))
        both_written.wait()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    other = FileCommittedStore(store.path.parent.parent.parent, "ns", "backend")
    records = [CommittedRecord(CommittedWeights(v, CheckpointSource(f"/ckpt/{v}"))) for v in "12"]
    errors: list[BaseException] = []

    def write(writer: FileCommittedStore, record: CommittedRecord) -> None:
        try:
            writer.publish(record)
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=write, args=(w, r))
        for w, r in zip((store, other), records, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert errors == []
    assert len(set(temps)) == 2
    assert store.read() in records
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]


def test_concurrent_writers_and_readers_see_only_whole_records(
    store: FileCommittedStore,
) -> None:
    records = [
        CommittedRecord(CommittedWeights(str(i), CheckpointSource(f"/ckpt/{i}" * 50)), ("w",) * i)
        for i in range(4)
    ]
    store.publish(records[0])
    problems: list[BaseException] = []
    done = threading.Event()

    def write(record: CommittedRecord) -> None:
        try:
            for _ in range(100):
                store.publish(record)
        except BaseException as e:
            problems.append(e)

    def read() -> None:
        while not done.is_set():
            try:
                assert store.read() in records
            except BaseException as e:
                problems.append(e)
                return

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(r,)) for r in records]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join(60)
    done.set()
    reader.join(10)
    assert problems == []
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]


def test_a_failed_write_leaves_nothing_behind(
    store: FileCommittedStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.publish(CommittedRecord(WEIGHTS))
    before = store.path.read_bytes()

    def replace(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device (the test's)")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="the test's"):
        store.publish(CommittedRecord(CommittedWeights("8", CheckpointSource("/ckpt/8"))))
    assert [p.name for p in store.path.parent.iterdir()] == [store.path.name]
    assert store.path.read_bytes() == before


def test_the_record_is_readable_by_other_users(store: FileCommittedStore) -> None:
    store.publish(CommittedRecord(WEIGHTS))
    assert store.path.stat().st_mode & 0o777 == 0o644


# The deadlines of a fleet whose every worker does as it is told (``Obedient``).
QUICK = Deadlines(pause_s=2, update_s=2, control_s=2)


@pytest.mark.parametrize("unreadable", ["fifo", "deep", "out of range", "oversized"])
def test_a_trainer_given_committed_replaces_a_record_it_cannot_read(
    store: FileCommittedStore, unreadable: str
) -> None:
    if unreadable == "fifo":
        os.mkfifo(store.path)
    elif unreadable == "deep":
        store.path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    elif unreadable == "out of range":
        store.path.write_text(json.dumps(GOOD).replace("1.5", "1" + "0" * 400))
    else:
        store.path.write_bytes(b" " * (MAX_RECORD_BYTES + 1))
    new = CommittedWeights("8", CheckpointSource("/ckpt/step-8"))
    trainer = Obedient(WEIGHTS, store, QUICK)

    outcome = within(
        10,
        lambda: asyncio.run(trainer._run("8", new.source, "wait", True)),
        lambda: open_fifo_writer(store.path),
    )
    assert not isinstance(outcome, BaseException), outcome
    record = store.read()
    assert record is not None and record.weights == new and record.workers == ("w0", "w1")


def test_a_trainer_without_committed_is_told_the_record_is_unreadable_at_once(
    store: FileCommittedStore,
) -> None:
    os.mkfifo(store.path)
    trainer = Obedient(None, store, QUICK)
    outcome = within(
        10,
        lambda: asyncio.run(trainer._run("8", CheckpointSource("/ckpt/8"), "wait", True)),
        lambda: open_fifo_writer(store.path),
    )
    assert isinstance(outcome, ValueError) and "a FIFO" in str(outcome)
