"""KV-aware routing: two engine servers, each behind its own bridge, one frontend in
KV mode. A repeated prefix goes to the worker whose engine cached it, which the
router only knows through the bridges' KV-event relays."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.engine import kv_sim_args
from harness.http import routed_to
from harness.stack import Stack, kv_routed_stack

pytestmark = pytest.mark.dynamo

MODEL = "tiny-kv"
NAMESPACE = "kvroute"
BLOCK = 16


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("kv-stack")
    with kv_routed_stack(root, model_dir, MODEL, 2, *kv_sim_args(BLOCK), namespace=NAMESPACE) as s:
        yield s


def worker_of(stack: Stack, prompt: list[int]) -> int:
    return int(routed_to(stack.base_url, MODEL, prompt)["decode_worker_id"])


def test_repeated_prefixes_go_to_the_worker_that_holds_them(kv_stack: Stack) -> None:
    # New prefixes, at least 8, until both workers hold some (so that affinity below
    # is not trivial): between two idle workers with nothing cached the router breaks
    # the tie at random, so 8 alone all land on one about one run in 128.
    prefixes: list[list[int]] = []
    first: dict[int, int] = {}
    for p in range(64):
        prefixes.append([(p * 97 + i * 7) % 900 + 3 for i in range(6 * BLOCK)])
        first[p] = worker_of(kv_stack, [*prefixes[p], 1000 - p])
        if p >= 7 and len(set(first.values())) == 2:
            break
    assert len(set(first.values())) == 2, first
    hits: Counter[bool] = Counter()
    for rnd in range(3):
        for p, prefix in enumerate(prefixes):
            hits[worker_of(kv_stack, [*prefix, 900 + rnd, 901 + p]) == first[p]] += 1
    assert hits[False] == 0, (hits, first)
