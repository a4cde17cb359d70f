"""etcd's v3 JSON gateway, as the trainer's side reads and writes Dynamo's
discovery store in cluster mode: no etcd client library (the ``driver`` extra
stays small), a blocking call over the standard library, each endpoint tried in
turn."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_ENDPOINTS = "http://localhost:2379"
# The largest answer read: a fleet's discovery records are kilobytes each.
MAX_ANSWER_BYTES = 16 << 20


def b64(data: bytes) -> str:
    """A key or value as the gateway carries it."""
    return base64.b64encode(data).decode()


def b64decode(text: str) -> bytes:
    """A key or value the gateway answered with."""
    return base64.b64decode(text, validate=True)


def env_endpoints(env: Mapping[str, str]) -> list[str]:
    """The endpoints Dynamo's processes with this environment use (``ETCD_ENDPOINTS``)."""
    return env.get("ETCD_ENDPOINTS", DEFAULT_ENDPOINTS).split(",")


def clean_endpoints(endpoints: Sequence[str]) -> list[str]:
    """``endpoints`` without blanks and trailing slashes; ValueError when none is left."""
    cleaned = [e.strip().rstrip("/") for e in endpoints if e.strip()]
    if not cleaned:
        raise ValueError("no etcd endpoints")
    return cleaned


class EtcdRefused(ConnectionError):
    """etcd answered with a 4xx status (404: no such lease, say): the cluster's own
    answer, which every endpoint would give alike, so no other is tried."""

    def __init__(self, path: str, endpoint: str, status: int, reason: str) -> None:
        super().__init__(f"etcd {path} refused by {endpoint}: HTTP {status} {reason}")
        self.status = status


def call(
    endpoints: Sequence[str], path: str, body: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """POST ``body`` to ``/v3/<path>`` on the first endpoint that answers;
    ConnectionError naming every endpoint's failure when none does (``EtcdRefused``
    when one answered with a 4xx status)."""
    errors = []
    for endpoint in endpoints:
        request = urllib.request.Request(
            f"{endpoint}/v3/{path}",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                raw = resp.read(MAX_ANSWER_BYTES + 1)
            if len(raw) > MAX_ANSWER_BYTES:
                raise ValueError(f"answer over {MAX_ANSWER_BYTES} bytes")
            answer = json.loads(raw)
            if not isinstance(answer, dict):
                raise ValueError(f"answer is a JSON {type(answer).__name__}, not an object")
            return answer
        except urllib.error.HTTPError as e:
            if 400 <= e.code < 500:
                raise EtcdRefused(path, endpoint, e.code, e.reason) from None
            errors.append(f"{endpoint}: {e}")
        except RecursionError:  # nested deeper than the parser goes: malformed, not a crash
            errors.append(f"{endpoint}: answer nested too deep")
        except (OSError, ValueError) as e:
            errors.append(f"{endpoint}: {e}")
    raise ConnectionError(f"etcd {path} failed on every endpoint: {'; '.join(errors)}")
