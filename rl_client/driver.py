"""Driver-side client: send a rollout to the Dynamo frontend, get the exact result back.

Needs only aiohttp (no Dynamo, no torch): it runs in the RL driver. The request
is an ordinary ``POST /v1/completions`` with the prompt as token ids, the
``rollout:{...}`` annotation (``rl_client.annotation``) and
``nvext.extra_fields: ["engine_data"]``; the result is rebuilt from
``nvext.engine_data`` alone, never from the choice's text or logprobs (which the
frontend may post-process).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

import aiohttp

from rl_client import wire
from rl_client.annotation import rollout_annotation
from rl_client.wire import WeightVersionRefusal, WireError

__all__ = [
    "RETRYABLE_STATUSES",
    "RetryPolicy",
    "RolloutCancelledError",
    "RolloutClient",
    "RolloutHTTPError",
    "RolloutResult",
    "RoutedExperts",
    "WeightVersionRefusedError",
    "WireError",
    "build_rollout_body",
    "parse_rollout_response",
]

log = logging.getLogger(__name__)

# Statuses worth sending the same rollout again for (NeMo RL's Dynamo driver
# retries the same set): a timeout, overload, or a server-side failure such as
# a lost engine server. A 4xx other than these is the request's own fault.
RETRYABLE_STATUSES = frozenset({408, 429}) | frozenset(range(500, 600))


class RolloutHTTPError(RuntimeError):
    """The frontend answered with a non-2xx status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def retryable(self) -> bool:
        return self.status in RETRYABLE_STATUSES


class RolloutCancelledError(RuntimeError):
    """The rollout was cancelled before it finished (finish reason "cancelled").

    The driver did not ask for that: the frontend or the bridge stopped it, for
    example because the bridge was shutting down, or an operator aborted it.
    It has no result; sending it again starts it afresh.
    """


class WeightVersionRefusedError(RuntimeError):
    """A rollout held to a weight version (``weight_version=``) that a worker
    refused, naming the version it requires (``required``), the one that worker
    serves (``serving``) and the fleet's committed one (``committed``).

    ``retryable`` False: the fleet has moved on from ``required`` (the worker
    serves the committed version with no refit under way), so no worker will serve
    it again: raised at the first try, never sent again. True: a refit is under
    way on that worker and may bring it: retried as ``RetryPolicy`` says, raised
    once the tries are spent. A bridge answers this only where it reads the
    fleet's committed record (catch-up on, a record published); otherwise a
    refusal reaches the driver as the frontend's HTTP 503 (500 on Dynamo
    1.3.0.post1), without the versions.
    """

    def __init__(self, refusal: WeightVersionRefusal) -> None:
        super().__init__(
            refusal.message
            or (
                f"weight version {refusal.required!r} refused (required {refusal.required!r}, "
                f"serving {refusal.serving!r}, committed {refusal.committed!r})"
            )
        )
        self.refusal = refusal
        self.required = refusal.required
        self.serving = refusal.serving
        self.committed = refusal.committed
        self.retryable = refusal.retryable


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a rollout is sent again.

    ``attempts`` counts the first try. Retried: HTTP 408, 429 and 5xx, connection
    errors (refused, reset, dropped mid-answer) and a weight-version refusal during
    a refit (``WeightVersionRefusedError.retryable``); never another 4xx, nor a
    refusal of a version the fleet has moved on from.
    The pause before try n+1 is ``min(max_s, initial_s * 2**(n-1))``, times a
    random factor in [1 - jitter, 1 + jitter], so that many drivers retrying
    at once spread out.
    """

    attempts: int = 3
    initial_s: float = 0.5
    max_s: float = 8.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {self.attempts}")
        if self.initial_s < 0 or self.max_s < self.initial_s or not 0 <= self.jitter < 1:
            raise ValueError("need 0 <= initial_s <= max_s and 0 <= jitter < 1")

    def delay(self, attempt: int) -> float:
        """The pause after failed try ``attempt`` (1-based)."""
        base = min(self.max_s, self.initial_s * 2 ** (attempt - 1))
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)


@dataclass(frozen=True)
class RoutedExperts:
    """Router choices, [positions, moe_layers, top_k], as raw little-endian bytes."""

    data: bytes
    dtype: str
    shape: tuple[int, ...]

    def to_numpy(self) -> Any:
        """As a numpy array of its own dtype (numpy is imported only here)."""
        import numpy as np

        return np.frombuffer(self.data, dtype=np.dtype(self.dtype).newbyteorder("<")).reshape(
            self.shape
        )


@dataclass(frozen=True)
class RolloutResult:
    """One rollout exactly as the engine produced it."""

    token_ids: list[int]
    logprobs: list[float]
    truncated: bool
    # "stop", "length", "aborted", "error", or "weight_version_changed" (a rollout
    # that named its weight version, ended when the weights changed under it: the
    # tokens so far, all of that version).
    finish_reason: str
    stop_reason: int | str | None = None
    routed_experts: RoutedExperts | None = None
    r3_stats: dict[str, int] | None = None
    usage: dict[str, int] = field(default_factory=dict)
    request_id: str = ""
    instance_id: str = ""
    # The frontend's nvext.worker_id, when asked for.
    worker_id: Any = None
    # Which weights made which tokens: (version, start, end) spans over token_ids
    # (two or more when the rollout lived through a KEEP-mode refit); None from
    # bridges older than wire version 2.
    weight_versions: list[tuple[str, int, int]] | None = None

    @property
    def weight_version(self) -> str | None:
        """The one version that made every token (None when several did, or unknown)."""
        versions = {span[0] for span in self.weight_versions or ()}
        return versions.pop() if len(versions) == 1 else None

    @classmethod
    def nothing_generated(cls, prompt_tokens: int) -> RolloutResult:
        """A zero token budget: the engine contract's answer, without asking anyone."""
        return cls(
            token_ids=[],
            logprobs=[],
            truncated=False,
            finish_reason="length",
            usage={
                "prompt_tokens": prompt_tokens,
                "completion_tokens": 0,
                "cached_prompt_tokens": 0,
            },
        )


class RolloutOptions(TypedDict, total=False):
    """How one rollout is sampled and answered: ``build_rollout_body``'s keywords that
    ``RolloutClient.rollout`` passes on as its caller gave them."""

    greedy: bool
    stop_strings: Sequence[str]
    max_tokens: int | None
    worker_id: bool
    weight_version: str | None


def build_rollout_body(
    model: str,
    prompt_token_ids: Sequence[int],
    *,
    greedy: bool = False,
    stop_strings: Sequence[str] = (),
    max_tokens: int | None = None,
    request_id: str | None = None,
    worker_id: bool = False,
    text: bool = False,
    weight_version: str | None = None,
) -> dict[str, Any]:
    """The /v1/completions body; stop strings go in the annotation, never in ``stop``
    (the frontend would cut the text and abort the engine on them). ``text``: also
    answer the decoded text in ``choices[0].text``. ``weight_version``: the version
    every token must come from, in the annotation too (the frontend passes
    ``nvext.annotations`` to the worker untouched)."""
    extra_fields = ["engine_data"] + (["worker_id"] if worker_id else [])
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_token_ids),
        "stream": False,
        "nvext": {
            "annotations": [
                rollout_annotation(
                    greedy=greedy,
                    stop_strings=stop_strings,
                    request_id=request_id,
                    text=text,
                    weight_version=weight_version,
                )
            ],
            "extra_fields": extra_fields,
        },
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def parse_rollout_response(body: Mapping[str, Any]) -> RolloutResult:
    """Rebuild the result from ``nvext.engine_data``; raises WireError when malformed,
    RolloutCancelledError when the rollout was cancelled before it finished,
    WeightVersionRefusedError when a worker refused its weight version."""
    nvext = body.get("nvext") or {}
    engine_data = nvext.get("engine_data")
    if isinstance(engine_data, Mapping) and wire.REFUSAL_KEY in engine_data:
        raise WeightVersionRefusedError(wire.decode_refusal(engine_data[wire.REFUSAL_KEY]))
    if not isinstance(engine_data, Mapping) or wire.WIRE_KEY not in engine_data:
        reason = _finish_reason(body)
        if reason in ("cancelled", "abort", "aborted"):
            raise RolloutCancelledError(
                f"the rollout was cancelled before it finished (finish reason {reason!r}): "
                "the frontend or the bridge stopped it (a shutting-down worker, an abort); "
                "it has no result"
            )
        raise WireError(
            "the response has no nvext.engine_data.rollout: the request did not reach a "
            "rollout bridge (is the model served by this project's bridge, and does the body "
            f"ask for nvext.extra_fields ['engine_data']?); finish reason {reason!r}"
        )
    obj = engine_data[wire.WIRE_KEY]
    if not isinstance(obj, Mapping):
        raise WireError("nvext.engine_data.rollout is not an object")
    if obj.get("version") not in wire.READABLE_WIRE_VERSIONS:
        raise WireError(
            f"rollout wire version {obj.get('version')!r}, expected one of "
            f"{sorted(wire.READABLE_WIRE_VERSIONS)}"
        )
    unknown = sorted(set(obj) - wire.WIRE_KEYS)
    if unknown:
        raise WireError(f"rollout wire object has unknown keys {unknown}")
    try:
        token_ids = [int(t) for t in obj["token_ids"]]
        logprobs = wire.decode_logprobs(obj["logprobs"], obj["version"])
        truncated = obj["truncated"]
        finish_reason = obj["finish_reason"]
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed rollout wire object: {e!r}") from e
    if len(logprobs) != len(token_ids):
        raise WireError(f"{len(logprobs)} logprobs for {len(token_ids)} tokens")
    if not isinstance(truncated, bool) or not isinstance(finish_reason, str):
        raise WireError("rollout 'truncated' must be a boolean and 'finish_reason' a string")
    experts = None
    if obj.get("routed_experts") is not None:
        experts = RoutedExperts(*wire.decode_routed_experts(obj["routed_experts"]))
    r3 = obj.get("r3_stats")
    spans = obj.get("weight_versions")
    return RolloutResult(
        token_ids=token_ids,
        logprobs=logprobs,
        truncated=truncated,
        finish_reason=finish_reason,
        stop_reason=obj.get("stop_reason"),
        routed_experts=experts,
        r3_stats={k: int(r3[k]) for k in wire.R3_KEYS} if r3 is not None else None,
        usage={k: int(v) for k, v in (obj.get("usage") or {}).items()},
        request_id=str(obj.get("request_id", "")),
        instance_id=str(obj.get("instance_id", "")),
        worker_id=nvext.get("worker_id"),
        weight_versions=(
            wire.decode_weight_versions(spans, len(token_ids)) if spans is not None else None
        ),
    )


def _finish_reason(body: Mapping[str, Any]) -> str | None:
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], Mapping):
        reason = choices[0].get("finish_reason")
        return reason if isinstance(reason, str) else None
    return None


def error_message(status: int, text: str) -> str:
    """The frontend's error message out of its JSON error body (or the raw text)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text.strip() or f"HTTP {status}"
    if isinstance(body, Mapping):
        err = body.get("error", body)
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return body["message"]
    return text.strip()


class RolloutClient:
    """Rollouts through a Dynamo frontend. One aiohttp session, reused; ``close()`` it.

    ``timeout_s`` bounds one try (NeMo RL's default is 900 s); ``retry`` says
    which failures are tried again and how patiently (see RetryPolicy).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        timeout_s: float = 900.0,
        retry: RetryPolicy | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.retry = retry or RetryPolicy()
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._owns_session = session is None

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def rollout(
        self,
        prompt_token_ids: Sequence[int],
        *,
        request_id: str | None = None,
        **options: Unpack[RolloutOptions],
    ) -> RolloutResult:
        """One rollout, retried as ``retry`` says (a retry runs as ``request_id``.N);
        ``options`` as ``build_rollout_body`` takes them. ``weight_version``: the weight
        version (the label a refit set) every token must come from. A worker serving
        another refuses it before generating. Where its bridge reads the fleet's
        committed record, the refusal is ``WeightVersionRefusedError`` naming the
        required, serving and committed versions: raised at once when the fleet has
        moved on from it (no worker will serve it again), retried while a refit is
        under way on that worker. Otherwise it is HTTP 503 once the frontend's
        migrations are spent, retried like any 503 (a refit under way may end,
        another worker may serve it). A worker whose weights change under it (a
        KEEP-mode refit) ends it there: finish reason "weight_version_changed", the
        tokens so far."""
        if options.get("max_tokens") == 0:
            # The frontend refuses max_tokens 0 (HTTP 400); the answer is known anyway.
            return RolloutResult.nothing_generated(len(prompt_token_ids))
        policy = self.retry
        for attempt in range(1, policy.attempts + 1):
            # A retry must not collide with a previous try the engine may still
            # be aborting: it runs under an id of its own.
            attempt_id = (
                request_id if request_id is None or attempt == 1 else f"{request_id}.{attempt}"
            )
            body = build_rollout_body(
                self.model, prompt_token_ids, request_id=attempt_id, **options
            )
            try:
                return await self._post(body)
            except (
                RolloutHTTPError,
                WeightVersionRefusedError,
                aiohttp.ClientConnectionError,
                aiohttp.ClientPayloadError,
            ) as e:
                retryable = (
                    e.retryable
                    if isinstance(e, RolloutHTTPError | WeightVersionRefusedError)
                    else True
                )
                if not retryable or attempt == policy.attempts:
                    raise
                pause = policy.delay(attempt)
                log.warning(
                    "rollout try %d of %d failed (%s); trying again in %.2fs",
                    attempt,
                    policy.attempts,
                    e,
                    pause,
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable: the last try returns or raises")

    async def _post(self, body: dict[str, Any]) -> RolloutResult:
        session = self._get_session()
        async with session.post(f"{self.base_url}/v1/completions", json=body) as resp:
            text = await resp.text()
            if not 200 <= resp.status < 300:
                raise RolloutHTTPError(resp.status, error_message(resp.status, text))
        try:
            data = json.loads(text)
        except ValueError as e:
            raise WireError(f"the frontend's answer is not JSON: {text[:200]!r}") from e
        return parse_rollout_response(data)

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and self._owns_session:
            await session.close()
