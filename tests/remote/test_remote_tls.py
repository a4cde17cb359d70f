"""A remote engine server over mutual TLS: the engine server on "another host" (its
own network namespace, joined to this one by a veth pair, where ``ip netns``
works; else this machine's non-loopback address), the bridge and the frontend
here. Rollouts come back exact; a wrong CA, a missing or expired client
certificate, or a server without TLS make the bridge refuse at once, saying
which, and the engine server logs each refused handshake."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc
from harness.procs import Proc, ProcessGroup, Role
from harness.stack import Engine, Stack
from harness.waits import wait_until
from tests.e2e.e2e_stack import assert_same, bridged_rollout
from tests.remote.pki import Pki

pytestmark = [pytest.mark.dynamo]

MODEL = "tiny-remote"
SIM_ARGS = ("--eos-rate", "0.05", "--decode-step-ms", "1", "--max-new-tokens", "24")


@dataclass
class Hosts:
    """Where the engine server runs (``prefix`` puts a command there) and listens."""

    prefix: tuple[str, ...]
    engine_ip: str
    how: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Two "hosts": this network namespace and a new one, joined by a veth pair."""
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"rl16-{tag}", f"vb{tag}", f"ve{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    try:
        _ip("netns", "add", ns)
    except (OSError, subprocess.CalledProcessError):
        yield _fallback_hosts()
        return
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{subnet}.1/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{subnet}.2/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        how = f"network namespace {ns} at {subnet}.2, joined by veth {here}<->{there}"
        print(f"\n[remote] engine server in {how}", flush=True)
        yield Hosts(("ip", "netns", "exec", ns), f"{subnet}.2", how)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", here], capture_output=True)


def _fallback_hosts() -> Hosts:
    """No network namespaces here: the engine server on this machine's own non-loopback
    address (one host, two addresses)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            ip = s.getsockname()[0]
        except OSError:
            pytest.skip("no network namespaces and no non-loopback address here")
    how = f"no network namespaces here: this machine's non-loopback address {ip}"
    print(f"\n[remote] engine server on {how}", flush=True)
    return Hosts((), ip, how)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory, hosts: Hosts) -> Pki:
    pki = Pki(tmp_path_factory.mktemp("pki"))
    pki.ca("ca")
    pki.ca("other-ca")
    pki.leaf("server", "ca", server_ips=(hosts.engine_ip,))
    pki.leaf("client", "ca")
    pki.leaf("client-expired", "ca", expired=True)
    pki.leaf("client-other", "other-ca")
    return pki


def start_remote_engine(
    group: ProcessGroup, hosts: Hosts, model_dir: Path, name: str, *args: str
) -> tuple[Proc, str]:
    """An engine server on the other host; returns once it has its address."""
    ready = group.log_dir / f"{name}.addr"
    ready.unlink(missing_ok=True)
    argv = [
        *hosts.prefix,
        sys.executable,
        "-m",
        "engine_server",
        "--backend",
        "sim",
        "--listen",
        f"{hosts.engine_ip}:0",
        "--allow-remote",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        *SIM_ARGS,
        *args,
        "--ready-file",
        str(ready),
    ]
    proc = group.spawn(name, argv, None, Role.ENGINE_SERVER)
    wait_until(lambda: ready.exists() and ready.read_text().strip(), 60, name, [proc])
    return proc, ready.read_text().strip()


def tls_server_args(pki: Pki, client_ca: bool = True) -> tuple[str, ...]:
    d = pki.folder
    extra = ("--tls-client-ca", str(d / "ca.pem")) if client_ca else ()
    return ("--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"), *extra)


def client_args(pki: Pki, ca: str = "ca", client: str | None = "client") -> tuple[str, ...]:
    d = pki.folder
    args: tuple[str, ...] = ("--engine-tls-ca", str(d / f"{ca}.pem"))
    if client:
        args += ("--engine-tls-cert", str(d / f"{client}.pem"))
        args += ("--engine-tls-key", str(d / f"{client}.key"))
    return args


@pytest.fixture(scope="module")
def remote(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, hosts: Hosts, pki: Pki
) -> Iterator[Stack]:
    """The remote engine server (mTLS), a bridge and a frontend here."""
    root = tmp_path_factory.mktemp("remote")
    with ProcessGroup(root / "logs") as group:
        stack = Stack.new(root, group, model_dir, MODEL)
        proc, address = start_remote_engine(
            group, hosts, model_dir, "engine", *tls_server_args(pki)
        )
        stack.engines.append(Engine(proc, address, MODEL))
        stack.start_bridge("bridge", address, *client_args(pki))
        stack.start_frontend()
        stack.wait_serving(timeout=60)
        yield stack


def secure_stub(address: str, pki: Pki) -> tuple[grpc.Channel, pb_grpc.EngineServiceStub]:
    d = pki.folder
    creds = grpc.ssl_channel_credentials(
        (d / "ca.pem").read_bytes(),
        (d / "client.key").read_bytes(),
        (d / "client.pem").read_bytes(),
    )
    channel = grpc.secure_channel(address, creds)
    return channel, pb_grpc.EngineServiceStub(channel)


@pytest.mark.parametrize("greedy", [True, False])
async def test_rollouts_exact_over_mtls(remote: Stack, pki: Pki, greedy: bool) -> None:
    address = remote.address()
    assert not address.startswith("127.")
    for seed in range(3):
        prompt = [(seed * 31 + i * 7) % 500 + 3 for i in range(12)]
        request_id = f"tls-{greedy}-{seed}"
        result = await bridged_rollout(remote, prompt, greedy=greedy, request_id=request_id)
        channel, stub = secure_stub(address, pki)
        with channel:
            direct = stub.Rollout(
                pb.RolloutRequest(
                    request_id=f"{request_id}-direct", prompt_token_ids=prompt, greedy=greedy
                ),
                timeout=30,
            )
        if greedy:
            assert_same(result, direct)
        else:  # sampled: the same length budget and shape, over the same channel kind
            assert len(result.token_ids) == len(result.logprobs) > 0


def test_nothing_served_in_clear_text(remote: Stack) -> None:
    with grpc.insecure_channel(remote.address()) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.EngineServiceStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=3)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


REFUSALS = {
    "wrong-ca": (dict(ca="other-ca"), "not trusted by --engine-tls-ca"),
    "no-client-cert": (dict(client=None), "requires a client certificate"),
    "expired-client-cert": (dict(client="client-expired"), "has expired"),
    "client-cert-of-another-ca": (
        dict(client="client-other"),
        "not signed by a CA the server trusts",
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bridge_refuses_and_says_why(
    tmp_path: Path, model_dir: Path, hosts: Hosts, pki: Pki, case: str
) -> None:
    options, words = REFUSALS[case]
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        engine, address = start_remote_engine(
            group, hosts, model_dir, "engine", *tls_server_args(pki)
        )
        bridge = stack.start_bridge("bridge", address, *client_args(pki, **options))  # type: ignore[arg-type]
        code = bridge.wait_exit(60)
        log = bridge.log_path.read_text()
        assert code != 0
        assert "TLS to the engine server" in log and words in log, log[-3000:]
        assert "Handshake failed" in engine.log_path.read_text()
        print(f"\n[remote] {case}: {log[log.index('TLS to the engine server') :].splitlines()[0]}")


def test_bridge_with_tls_refuses_a_clear_text_server(
    tmp_path: Path, model_dir: Path, hosts: Hosts, pki: Pki
) -> None:
    with ProcessGroup(tmp_path / "logs") as group:
        stack = Stack.new(tmp_path, group, model_dir, MODEL)
        _, address = start_remote_engine(group, hosts, model_dir, "engine")
        bridge = stack.start_bridge("bridge", address, *client_args(pki))
        assert bridge.wait_exit(60) != 0
        assert "does not speak TLS" in bridge.log_path.read_text()
