"""engine_worker.split: NeMo RL's dynamo.vllm command line, routed to the engine
server and the bridge by what each side's parser knows."""

from __future__ import annotations

import argparse

import pytest

from engine_worker.flags import describe
from engine_worker.split import UsageError, split_args
from launch.supervisor import RestartPolicy

ENGINE = {
    "--model": 1,
    "--served-model-name": "+",
    "--seed": 1,
    "--trust-remote-code": 0,
    "--weight-transfer-config": 1,
    "--enable-prefix-caching": 0,
    "--no-enable-prefix-caching": 0,
    "--log-level": 1,
    "--listen": 1,
    "--top-k": 1,
    "-tp": 1,
}
BRIDGE = {
    "--served-model-name": 1,
    "--namespace": 1,
    "--enable-rl": 0,
    "--no-enable-rl": 0,
    "--endpoint-types": 1,
    "--dyn-structural-tag-scope": "?",
    "--log-level": 1,
    "--engine": 1,
}
OWN = {"--backend": 1, "--dry-run": 0}


def test_each_flag_goes_to_the_side_knowing_it() -> None:
    argv = [
        "--model", "/m", "--served-model-name", "m", "--namespace", "ns", "--enable-rl",
        "--weight-transfer-config", '{"backend":"nccl"}', "--trust-remote-code", "--seed", "7",
        "--no-enable-prefix-caching", "--endpoint-types=completions", "--log-level", "debug",
        "--backend", "sim", "--top-k", "-1", "-tp", "2",
    ]  # fmt: skip
    out = split_args(argv, ENGINE, BRIDGE, OWN)
    assert out.engine == [
        "--model", "/m", "--served-model-name", "m", "--weight-transfer-config",
        '{"backend":"nccl"}', "--trust-remote-code", "--seed", "7",
        "--no-enable-prefix-caching", "--log-level", "debug", "--top-k", "-1", "-tp", "2",
    ]  # fmt: skip
    assert out.bridge == [
        "--served-model-name", "m", "--namespace", "ns", "--enable-rl",
        "--endpoint-types=completions", "--log-level", "debug",
    ]  # fmt: skip
    assert out.own == ["--backend", "sim"]
    assert (out.model, out.served_model_name) == ("/m", "m")


def test_several_served_names_reach_the_bridge_as_its_one() -> None:
    out = split_args(["--served-model-name", "a", "b", "--enable-rl"], ENGINE, BRIDGE)
    assert out.engine == ["--served-model-name", "a", "b"]
    assert out.bridge == ["--served-model-name", "a", "--enable-rl"]


def test_an_optional_value_is_taken_only_when_there() -> None:
    out = split_args(["--dyn-structural-tag-scope", "--enable-rl"], ENGINE, BRIDGE)
    assert out.bridge == ["--dyn-structural-tag-scope", "--enable-rl"]
    out = split_args(["--dyn-structural-tag-scope", "all"], ENGINE, BRIDGE)
    assert out.bridge == ["--dyn-structural-tag-scope", "all"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--disaggregation-mode", "prefill"], "unrecognized argument --disaggregation-mode"),
        (["--mod", "/m"], "unrecognized argument --mod"),  # no abbreviations
        (["--seed"], "--seed expects 1 value"),
        (["--seed", "--enable-rl"], "--seed expects 1 value"),
        (["--enable-rl=1"], "--enable-rl takes no value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--listen", "x"], "--listen is set by the launcher"),
        (["--engine", "x"], "--engine is set by the launcher"),
        (["--model="], "--model is empty"),  # not the current folder
        (["--model", ""], "--model is empty"),
    ],
)
def test_refused_naming_the_argument(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        split_args(argv, ENGINE, BRIDGE, OWN)


def test_describe_reads_arities_from_a_parser() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a")
    parser.add_argument("--b", action="store_true")
    parser.add_argument("--c", nargs="+")
    parser.add_argument("--d", action=argparse.BooleanOptionalAction)
    parser.add_argument("-e", "--eee", nargs=2)
    assert describe(parser) == {
        "--a": 1, "--b": 0, "--c": "+", "--d": 0, "--no-d": 0, "-e": 2, "--eee": 2,
    }  # fmt: skip


def test_the_restart_pause_doubles_to_its_cap_within_its_jitter() -> None:
    policy = RestartPolicy()
    exact = [0.5, 1, 2, 4, 8, 10, 10]
    assert [RestartPolicy(jitter=0).delay(n) for n in range(1, 8)] == exact
    for n, base in enumerate(exact, start=1):
        for _ in range(20):
            assert base * 0.8 <= policy.delay(n) <= base * 1.2
