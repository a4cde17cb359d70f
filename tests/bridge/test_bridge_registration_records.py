"""bridge.registration.FileRecords against a file store laid out as Dynamo's file
discovery writes it (1.3.0.post1 and 1.6.1 alike): the records kept to be written
back must hold the served endpoint's own instance."""

from __future__ import annotations

from pathlib import Path

from bridge.registration import FileRecords

WORKER = 0xD1F64D092A2B6217
SERVED = f"rl%2Fbackend%2Fgenerate%2F{WORKER:x}"
# The worker's other endpoint: the KV router's query source, registered first.
QUERY_SOURCE = f"rl%2Fbackend%2Fworker%5Fkv%5Findexer%5Fquery%5Fdp0%2F{WORKER:x}"
OTHER_WORKER = "rl%2Fbackend%2Fgenerate%2F1234abcd"


def write(root: Path, bucket: str, name: str) -> Path:
    path = root / "v1" / bucket / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(f"{bucket}:{name}".encode())
    return path


def test_records_are_kept_only_once_the_served_instance_is_there(tmp_path: Path) -> None:
    write(tmp_path, "mdc", SERVED)
    write(tmp_path, "instances", QUERY_SOURCE)
    write(tmp_path, "instances", OTHER_WORKER)
    records = FileRecords(tmp_path, WORKER, "rl/backend/generate")
    assert not records.capture(), "kept without the served instance"
    served = write(tmp_path, "instances", SERVED)
    assert records.capture()
    assert sorted(p.name for p in records.instance_files) == sorted([SERVED, QUERY_SOURCE])
    # Dropped by discovery: missed, and written back byte for byte.
    data = served.read_bytes()
    served.unlink()
    assert not records.present()
    assert records.restore(with_instance=True) == 1
    assert served.read_bytes() == data and records.present()


def test_without_the_endpoint_any_instance_of_the_worker_will_do(tmp_path: Path) -> None:
    write(tmp_path, "mdc", SERVED)
    write(tmp_path, "instances", QUERY_SOURCE)
    assert FileRecords(tmp_path, WORKER).capture()
