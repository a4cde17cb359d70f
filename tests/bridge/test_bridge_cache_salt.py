"""A request's cache salt (contract revision 11): read where dynamo.vllm reads it
(the token-in/token-out envelope, the client's nvext), checked, and carried to the
engine server on every kind of request."""

from __future__ import annotations

from typing import Any

import pytest
from dynamo._core import Context
from dynamo.llm.exceptions import InvalidArgument

from bridge import cache_salt
from bridge.codec import RequestError
from tests.bridge.bridge_fakes import FakeServer
from tests.bridge.test_bridge_engine import bridge_for, collect
from tests.bridge.test_bridge_tito import tito_request


@pytest.mark.parametrize(
    ("request_", "envelope", "want"),
    [
        ({}, None, None),
        ({"nvext": {"cache_salt": "a"}}, None, "a"),
        ({"extra_args": {"nvext": {"cache_salt": "b"}}}, None, "b"),
        # The envelope's first, as dynamo.vllm; an empty salt is none.
        ({"nvext": {"cache_salt": "a"}}, {"cache_salt": "t"}, "t"),
        ({"nvext": {"cache_salt": "a"}}, {"cache_salt": ""}, "a"),
        ({"nvext": {"cache_salt": None}}, {"cache_salt": None}, None),
    ],
)
def test_the_salt_is_read_where_dynamo_vllm_reads_it(
    request_: dict[str, Any], envelope: dict[str, Any] | None, want: str | None
) -> None:
    assert cache_salt.requested(request_, envelope) == want


@pytest.mark.parametrize(
    ("request_", "envelope", "message"),
    [
        ({}, {"cache_salt": 7}, "cache_salt must be a string, got 7"),
        ({"nvext": {"cache_salt": "a\nb"}}, None, "nvext.cache_salt: holds the control"),
        ({"nvext": {"cache_salt": "s" * 257}}, None, "nvext.cache_salt: 257 characters"),
        ({}, {"cache_salt": "  "}, "cache_salt: must not be empty"),
    ],
)
def test_a_bad_salt_is_refused_by_name(
    request_: dict[str, Any], envelope: dict[str, Any] | None, message: str
) -> None:
    with pytest.raises(RequestError) as e:
        cache_salt.requested(request_, envelope)
    assert str(e.value).startswith(message), str(e.value)


ROLLOUT = {"token_ids": [5, 6, 7], "annotations": ['rollout:{"greedy":true}']}
COMPLETION = {"token_ids": [5, 6, 7], "stop_conditions": {"max_tokens": 2}}


async def test_every_kind_of_request_carries_its_salt_to_the_engine() -> None:
    async with FakeServer() as server:
        engine = bridge_for(server.address)
        try:
            await engine.start(worker_id=1)
            await collect(engine, tito_request({"max_tokens": 2}, cache_salt="t"), Context(id="1"))
            salted = {"extra_args": {"nvext": {"cache_salt": "c"}}}
            await collect(engine, {**COMPLETION, **salted}, Context(id="2"))
            await collect(engine, {**ROLLOUT, **salted}, Context(id="3"))
            await collect(engine, COMPLETION, Context(id="4"))
            generates = server.engine.generates
            assert [g.cache_salt for g in generates] == ["t", "c", ""]
            assert not generates[2].HasField("cache_salt")
            assert [r.cache_salt for r in server.engine.rollouts] == ["c"]
            with pytest.raises(InvalidArgument, match=r"^nvext\.cache_salt: holds the control"):
                bad = {"nvext": {"cache_salt": "a\x00"}}
                await collect(engine, {**COMPLETION, **bad}, Context(id="5"))
            assert len(generates) == 3  # refused before the engine
        finally:
            await engine.cleanup()
