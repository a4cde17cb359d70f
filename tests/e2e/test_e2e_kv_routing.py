"""KV-aware routing: two engine servers, each behind its own bridge, one frontend in
KV mode. A repeated prefix goes to the worker whose engine cached it, which the
router only knows through the bridges' KV-event relays."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from procs import (
    ProcessGroup,
    blocking_env,
    dynamo_env,
    http_json,
    registered_workers,
    wait_for_model,
    wait_until,
)

pytestmark = pytest.mark.dynamo

MODEL = "tiny-kv"
NAMESPACE = "kvroute"
BLOCK = 16


@dataclass
class KvStack:
    base_url: str
    group: ProcessGroup


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[KvStack]:
    root = tmp_path_factory.mktemp("kv-stack")
    kv_dir = root / "kv"
    env = dynamo_env(kv_dir)
    with ProcessGroup(root / "logs") as group:
        procs = []
        for i in range(2):
            engine, address = group.engine_server(
                f"engine-{i}",
                "--model",
                str(model_dir),
                "--served-model-name",
                MODEL,
                "--block-size",
                str(BLOCK),
                "--eos-rate",
                "0",
                "--decode-step-ms",
                "1",
                "--seed",
                str(i),
            )
            bridge = group.bridge(
                f"bridge-{i}",
                address,
                model_dir,
                MODEL,
                NAMESPACE,
                {**env, **blocking_env("vllm", "torch")},
            )
            procs += [engine, bridge]
        frontend, base_url = group.frontend(
            "frontend", env, "--router-mode", "kv", "--router-temperature", "0"
        )
        procs.append(frontend)
        wait_until(lambda: registered_workers(kv_dir, NAMESPACE) == 2, 60, "two workers", procs)
        wait_for_model(base_url, MODEL, procs)
        yield KvStack(base_url, group)


def worker_of(stack: KvStack, prompt: list[int]) -> int:
    status, body = http_json(
        f"{stack.base_url}/v1/completions",
        {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 2,
            "nvext": {"extra_fields": ["worker_id"]},
        },
    )
    assert status == 200, body
    return int(body["nvext"]["worker_id"]["decode_worker_id"])


def test_repeated_prefixes_go_to_the_worker_that_holds_them(kv_stack: KvStack) -> None:
    prefixes = [[(p * 97 + i * 7) % 900 + 3 for i in range(6 * BLOCK)] for p in range(8)]
    first = {p: worker_of(kv_stack, [*prefixes[p], 1000 - p]) for p in range(len(prefixes))}
    # Both workers got some of the new prefixes (so affinity below is not trivial).
    assert len(set(first.values())) == 2, first
    hits = Counter()
    for rnd in range(3):
        for p, prefix in enumerate(prefixes):
            hits[worker_of(kv_stack, [*prefix, 900 + rnd, 901 + p]) == first[p]] += 1
    assert hits[False] == 0, (hits, first)
