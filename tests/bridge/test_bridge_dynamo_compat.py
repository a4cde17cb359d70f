"""The Dynamo seam (bridge.dynamo_compat) against whichever ai-dynamo is installed
(1.6.1 in .venv, 1.3.0.post1 in NeMo RL's pin): each call works there, and does
what that Dynamo can do."""

from __future__ import annotations

import argparse
import array
import importlib.util
import logging
from typing import Any

import pytest
from dynamo.common.backend import run as dynamo_run
from dynamo.frontend.frontend_args import FrontendArgGroup

from bridge import dynamo_compat


def test_token_ids_come_out_a_list() -> None:
    request: dict[str, Any] = {"token_ids": [3, 4, 5]}
    assert dynamo_compat.normalize_request_token_ids(request) == {"token_ids": [3, 4, 5]}
    packed = array.array("i", [7, 8, 2**31 - 1]).tobytes()
    request = {"token_ids": packed}
    dynamo_compat.normalize_request_token_ids(request)
    if importlib.util.find_spec("dynamo.common.utils.token_ids") is not None:
        # A Dynamo that can pack ids (DYN_TOKEN_IDS_AS_BYTES) has them unpacked.
        assert request["token_ids"] == [7, 8, 2**31 - 1]
    else:
        # One that cannot never sends bytes: the request is left as it came.
        assert request["token_ids"] is packed


class _Engine:
    pass


def _factory(made: list[Any]) -> dynamo_compat.EngineFactory:
    async def factory(argv: list[str] | None) -> Any:
        made.append(argv)
        return _Engine(), "worker-config"

    return factory


def test_run_worker_serves_the_factorys_engine_with_or_without_engine_factory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served: list[tuple[Any, Any]] = []

    class FakeWorker:
        def __init__(self, engine: Any, config: Any) -> None:
            self.engine, self.config = engine, config

        async def run(self) -> None:
            served.append((self.engine, self.config))

    monkeypatch.setattr(dynamo_compat, "Worker", FakeWorker)
    monkeypatch.setattr(dynamo_run, "Worker", FakeWorker)
    made: list[Any] = []
    # The installed run(), whichever it is.
    dynamo_compat.run_worker(_Engine, ["--a"], _factory(made))  # type: ignore[arg-type]
    # A run() without engine_factory (1.3.0.post1's): from_args must not be called.
    called: list[Any] = []
    monkeypatch.setattr(dynamo_run, "run", lambda engine_cls, argv=None: called.append(argv))
    dynamo_compat.run_worker(_Engine, ["--b"], _factory(made))  # type: ignore[arg-type]
    assert called == []
    assert made == [["--a"], ["--b"]]
    assert [type(e) for e, _ in served] == [_Engine, _Engine]
    assert [c for _, c in served] == ["worker-config", "worker-config"]


class _Url:
    def system_status_server_url(self) -> str:
        return "http://127.0.0.1:9"


def test_rl_route_registry_describes_the_routes_on_either_dynamo() -> None:
    registry = dynamo_compat.rl_route_registry(_Url(), logger_=logging.getLogger("t"), world_size=1)

    async def route(body: Any) -> dict[str, Any]:
        return {"status": "ok"}

    registry.add_routes({"pause_generation": route})
    described = registry.describe()
    assert described["routes"] == ["pause_generation"]
    assert described["system_url"] == "http://127.0.0.1:9"
    # Reported where Dynamo reports a world size at all, and then ours.
    assert described.get("world_size", 1) == 1


@pytest.mark.parametrize("reset", [True, False])
def test_router_reset_flags_are_what_the_installed_frontend_takes(reset: bool) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    FrontendArgGroup().add_arguments(parser)
    flags = dynamo_compat.frontend_router_reset_flags(reset)
    spelled = "--router-reset-states" if reset else "--no-router-reset-states"
    try:
        args, unknown = parser.parse_known_args([spelled])
    except argparse.ArgumentError:
        unknown = [spelled]
    if flags:
        assert flags == [spelled] and not unknown
        assert args.router_reset_states is reset
    else:
        # The frontend would refuse the flag: none is passed.
        assert unknown == [spelled]
