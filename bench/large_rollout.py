"""Part 3: one 16k-token rollout with routed experts (48 layers, top-8, uint8):
bytes on the wire next to the raw payload, and the time each path takes, with
the hop's own cost for that message measured apart from the engine's noise."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

from bench.context import PROMPT_TOKENS, Bench, say
from bench.local_engine import LocalEngine
from bench.stats import median, rotate
from bridge.client import EngineClient
from engine_contract.v1 import engine_pb2 as pb
from rl_client import driver

LARGE_TOKENS = 16384
LARGE_EXPERTS = "48,8,128"
# The four paths, each timed end to end.
IN_PROCESS, GRPC, HTTP_INPROC, HTTP_GRPC = "in-process", "grpc", "http-inproc", "http-grpc"
PATHS = (IN_PROCESS, GRPC, HTTP_INPROC, HTTP_GRPC)


@dataclass
class Sizes:
    """Bytes of the one large rollout, each way it travels."""

    tokens: int
    shape: list[int]
    routed_experts_raw: int
    # experts + int32 tokens + float64 logprobs
    raw_payload: int
    grpc_message: int
    http_body: int


@dataclass
class HopCost:
    """Median milliseconds for this message: protobuf encode (server side) and
    decode (client side), and carrying its bytes across loopback gRPC."""

    encode: float
    decode: float
    transfer_tcp: float
    transfer_unix: float


@dataclass
class LargeRollout:
    seconds: dict[str, float]  # path -> median seconds end to end
    hop_ms: HopCost
    bytes: Sizes
    reps: int

    def render(self) -> str:
        b, s, h = self.bytes, self.seconds, self.hop_ms
        total = h.encode + h.transfer_tcp + h.decode
        return "\n".join(
            [
                f"## 3. One large rollout: {b.tokens} tokens, routed experts {b.shape} uint8",
                "",
                "| what | bytes | MiB |",
                "|---|---:|---:|",
                f"| routed experts, raw | {b.routed_experts_raw:,} "
                f"| {b.routed_experts_raw / 2**20:.2f} |",
                f"| raw payload (experts + int32 tokens + float64 logprobs) | {b.raw_payload:,} "
                f"| {b.raw_payload / 2**20:.2f} |",
                f"| gRPC RolloutResponse on the wire | {b.grpc_message:,} "
                f"| {b.grpc_message / 2**20:.2f} |",
                f"| HTTP body from the frontend (JSON, base64) | {b.http_body:,} "
                f"| {b.http_body / 2**20:.2f} |",
                "",
                "| path | seconds (median) | added by the hop |",
                "|---|---:|---:|",
                f"| engine code in this process | {s[IN_PROCESS]:.3f} | |",
                f"| Rollout RPC (TCP) | {s[GRPC]:.3f} | {s[GRPC] - s[IN_PROCESS]:+.3f} |",
                f"| frontend + in-process worker (a) | {s[HTTP_INPROC]:.3f} | |",
                f"| frontend + bridge + engine server (b) | {s[HTTP_GRPC]:.3f} "
                f"| {s[HTTP_GRPC] - s[HTTP_INPROC]:+.3f} |",
                "",
                "The 16k decode steps take seconds and vary with the machine's load, which "
                "hides the hop in the end-to-end times; the hop alone for this message:",
                "",
                "| protobuf encode (server) | loopback gRPC transfer, TCP | unix socket "
                "| protobuf decode (client) | hop total (TCP) |",
                "|---:|---:|---:|---:|---:|",
                f"| {h.encode:.1f} ms | {h.transfer_tcp:.1f} ms | {h.transfer_unix:.1f} ms "
                f"| {h.decode:.1f} ms | {total:.1f} ms |",
                "",
            ]
        )


def engine_args(bench: Bench) -> list[str]:
    return [
        "--model",
        str(bench.model_dir),
        "--zero-delay",
        "--eos-rate",
        "0",
        "--routed-experts",
        LARGE_EXPERTS,
        # A huge made-up vocabulary, so that no greedy position ever picks EOS.
        "--vocab-size",
        str(10**9),
        "--context-length",
        str(LARGE_TOKENS + PROMPT_TOKENS),
        "--max-new-tokens",
        str(LARGE_TOKENS),
    ]


async def run(bench: Bench) -> LargeRollout:
    say(f"part 3: one {LARGE_TOKENS}-token rollout with routed experts {LARGE_EXPERTS}")
    args = engine_args(bench)
    engine, address = bench.group.engine_server("engine-large", *args)
    base_url = bench.start_frontend()
    bridge = bench.start_bridge("large-grpc", address)
    worker = bench.start_worker("large-inproc", args)
    local = LocalEngine(["--backend", "sim", *args])
    await local.start()
    client = EngineClient(address)
    await client.wait_ready(30)
    bench.wait_models(["large-grpc", "large-inproc"])
    prompt = bench.prompts[0]
    reps = max(3, bench.options.reps)
    # Warm every path up (first-call costs) with a short rollout.
    await local.rollout(
        pb.RolloutRequest(request_id="warm-local", prompt_token_ids=prompt, max_new_tokens=64)
    )
    await client.rollout(
        pb.RolloutRequest(request_id="warm-grpc", prompt_token_ids=prompt, max_new_tokens=64)
    )
    for model in ("large-inproc", "large-grpc"):
        async with driver.RolloutClient(base_url, model) as warm:
            await warm.rollout(prompt, max_tokens=64)

    times: dict[str, list[float]] = {path: [] for path in PATHS}
    local_answer = pb.RolloutResponse()
    grpc_bytes = http_bytes = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for rep in range(reps):
            for path in rotate(PATHS, rep):
                rid = f"large-{path}-{rep}"
                started = time.perf_counter()
                if path == IN_PROCESS:
                    local_answer = await local.rollout(
                        pb.RolloutRequest(request_id=rid, prompt_token_ids=prompt, greedy=True)
                    )
                    times[path].append(time.perf_counter() - started)
                elif path == GRPC:
                    answer = await client.rollout(
                        pb.RolloutRequest(request_id=rid, prompt_token_ids=prompt, greedy=True)
                    )
                    times[path].append(time.perf_counter() - started)
                    grpc_bytes = answer.ByteSize()
                else:
                    model = "large-inproc" if path == HTTP_INPROC else "large-grpc"
                    http_bytes = await http_rollout(session, base_url, model, prompt)
                    times[path].append(time.perf_counter() - started)
            say(f"  rep {rep + 1}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()))
    await client.close()
    # The hop's own cost for this message, without the engine's noise: protobuf
    # encode (server) and decode (client), and moving the bytes over loopback gRPC.
    hop = await large_message_hop(local_answer, bench.root)
    await local.shutdown()
    bench.stop(engine, bridge, worker)
    experts = local_answer.routed_experts
    return LargeRollout(
        seconds={k: median(v) for k, v in times.items()},
        hop_ms=hop,
        bytes=Sizes(
            tokens=len(local_answer.token_ids),
            shape=list(experts.shape),
            routed_experts_raw=len(experts.data),
            raw_payload=len(experts.data)
            + 4 * len(local_answer.token_ids)
            + 8 * len(local_answer.logprobs),
            grpc_message=grpc_bytes,
            http_body=http_bytes,
        ),
        reps=reps,
    )


async def http_rollout(
    session: aiohttp.ClientSession, base_url: str, model: str, prompt: list[int]
) -> int:
    """The whole large rollout through the frontend; the answer's size in bytes."""
    body = driver.build_rollout_body(model, prompt, greedy=True, max_tokens=LARGE_TOKENS)
    async with session.post(f"{base_url}/v1/completions", json=body) as http:
        raw = await http.read()
        if http.status != 200:
            raise RuntimeError(f"HTTP {http.status}: {raw[:300]!r}")
    result = driver.parse_rollout_response(json.loads(raw))
    if len(result.token_ids) != LARGE_TOKENS:
        raise RuntimeError(
            f"{model}: {len(result.token_ids)} tokens, {result.finish_reason} {result.usage}"
        )
    return len(raw)


async def large_message_hop(resp: pb.RolloutResponse, root: Path) -> HopCost:
    """Median milliseconds to encode and decode ``resp``, and to carry its bytes across
    a loopback gRPC call (an echo server in this process, TCP and unix socket)."""
    data = resp.SerializeToString()
    encode, decode = [], []
    for _ in range(7):
        started = time.perf_counter()
        resp.SerializeToString()
        encode.append(time.perf_counter() - started)
        started = time.perf_counter()
        pb.RolloutResponse.FromString(data)
        decode.append(time.perf_counter() - started)
    limit = 64 * 2**20
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]

    async def echo(request: bytes, context: object) -> bytes:
        return data

    server = grpc.aio.server(options=options)
    handler = grpc.method_handlers_generic_handler(
        "bench.Echo", {"Get": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    sock = root / "echo.sock"
    server.add_insecure_port(f"unix:{sock}")
    await server.start()
    transfer: dict[str, float] = {}
    try:
        for name, target in (("tcp", f"127.0.0.1:{port}"), ("unix", f"unix:{sock}")):
            async with grpc.aio.insecure_channel(target, options=options) as channel:
                call = channel.unary_unary("/bench.Echo/Get")
                await call(b"")
                samples = []
                for _ in range(7):
                    started = time.perf_counter()
                    got = await call(b"")
                    samples.append(time.perf_counter() - started)
                    assert len(got) == len(data)
                transfer[name] = median(samples) * 1000
    finally:
        await server.stop(None)
    return HopCost(
        encode=median(encode) * 1000,
        decode=median(decode) * 1000,
        transfer_tcp=transfer["tcp"],
        transfer_unix=transfer["unix"],
    )
