"""Dynamo's frontend over HTTP: JSON calls (stdlib), a raw SSE stream a client
drops, and requests under load (aiohttp) whose every ending is an ``HttpOutcome``."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from harness.waits import Watched, wait_until
from rl_client import driver


def http_json(
    url: str, body: dict[str, Any] | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """GET (or POST ``body``) and parse the JSON answer; (status, body) also on
    errors, (0, None) when nothing answered."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, None
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def routed_to(base_url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    """Where the frontend's router sent a short completion of ``prompt``: its
    ``nvext.worker_id`` (decode_worker_id, decode_dp_rank, ...)."""
    status, body = http_json(
        f"{base_url}/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 2,
            "nvext": {"extra_fields": ["worker_id"]},
        },
    )
    assert status == 200, body
    return dict(body["nvext"]["worker_id"])


def served_models(base_url: str) -> list[str]:
    """The model names the frontend lists now (none while it does not answer)."""
    status, body = http_json(f"{base_url}/v1/models", timeout=5)
    if status != 200 or not isinstance(body, dict):
        return []
    return [m["id"] for m in body.get("data", [])]


def wait_for_model(
    base_url: str, model: str, procs: Sequence[Watched], timeout: float = 60.0
) -> None:
    wait_until(
        lambda: model in served_models(base_url), timeout, f"model {model} at {base_url}", procs
    )


@contextlib.contextmanager
def open_sse_stream(
    base_url: str, body: dict[str, Any], events: int = 3, timeout: float = 30
) -> Iterator[bytes]:
    """POST a streaming /v1/completions over a raw socket, read ``events`` SSE events,
    and on leaving the block drop the connection without a word: a client that dies
    mid-stream, which aiohttp or urllib would not let us imitate as bluntly."""
    host, port = base_url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        received = b""
        while received.count(b"data:") < events:
            chunk = sock.recv(4096)
            if not chunk:
                raise ConnectionError(f"stream closed after {received[-500:]!r}")
            received += chunk
        yield received


# -- requests under load (aiohttp) ----------------------------------------------


@dataclass
class HttpOutcome:
    """How one HTTP request ended: status (0: no answer), when it ended (monotonic),
    the parsed body, the error text, and an SSE error event's code."""

    status: int
    ended: float
    body: Any = None
    error: str = ""
    stream_error_code: int | None = None


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, timeout: float = 60.0
) -> HttpOutcome:
    """POST ``body``; never raises for what the server or the network did."""
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            text = await resp.text()
            try:
                parsed: Any = json.loads(text)
            except ValueError:
                parsed = text
            return HttpOutcome(resp.status, time.monotonic(), parsed)
    except (TimeoutError, aiohttp.ClientError) as e:
        return HttpOutcome(0, time.monotonic(), error=f"{type(e).__name__}: {e}")


async def post_rollout(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    tokens: Sequence[int],
    max_tokens: int,
    timeout: float = 60.0,
    **kwargs: Any,
) -> HttpOutcome:
    """A rollout (greedy unless told otherwise) as the driver encodes it."""
    kwargs.setdefault("greedy", True)
    body = driver.build_rollout_body(model, tokens, max_tokens=max_tokens, **kwargs)
    return await post(session, f"{base_url}/v1/completions", body, timeout)


def stream_body(model: str, tokens: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """A greedy streamed completion of ``tokens``."""
    return {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
    }


async def post_stream(
    session: aiohttp.ClientSession, url: str, body: Any, timeout: float = 60.0
) -> HttpOutcome:
    """POST a streamed completion and read it to its end; an SSE error event's code
    is kept (the HTTP status is 200 by then)."""
    code: int | None = None
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                return HttpOutcome(resp.status, time.monotonic(), await resp.text())
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    code = int(event["error"].get("code") or 500)
            return HttpOutcome(resp.status, time.monotonic(), stream_error_code=code)
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        return HttpOutcome(
            0, time.monotonic(), error=f"{type(e).__name__}: {e}", stream_error_code=code
        )
