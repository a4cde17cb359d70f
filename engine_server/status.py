"""The one place a failure inside an RPC becomes the call's gRPC status.

Every servicer method is wrapped by ``rpc``: a request that could not be parsed
(``handlers.Undecodable``) is INVALID_ARGUMENT; a ``ServerError`` ends the
call with its own code and message; anything else is a bug or an engine
failure nobody anticipated, so it is logged with its traceback and answered
INTERNAL (never the UNKNOWN gRPC would send for an escaped exception, which
clients cannot act on). Cancellation and
an abort already under way pass through untouched. Being the one place every
call ends, it also counts them by method and status code.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import traceback
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from engine_contract.retry import LIMIT_TRAILER
from engine_contract.text import clip
from engine_server.errors import ServerError
from engine_server.handlers import Undecodable
from engine_server.metrics import ABORT_CLIENT_CANCEL, RpcCounter

log = logging.getLogger(__name__)

Self = TypeVar("Self")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServerError):
        if exc.limit:  # a capacity refusal: say which limit, so clients know to retry
            context.set_trailing_metadata(((LIMIT_TRAILER, exc.limit),))
        await context.abort(exc.code, str(exc))
    log.error("%s failed unexpectedly", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {clip(exc, 512)}")


def rpc(
    method: Callable[[Self, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Self, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Status boundary for a unary-response method (or one that writes its stream)."""
    calls = RpcCounter(method.__name__)
    # A cancelled call of these aborts its one engine request (streams count their own).
    one_request = method.__name__ in ("Rollout", "Generate")

    @functools.wraps(method)
    async def wrapper(self: Self, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        code = grpc.StatusCode.OK
        try:
            if isinstance(request, Undecodable):
                code = grpc.StatusCode.INVALID_ARGUMENT
                await context.abort(code, str(request))
            return await method(self, request, context)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            if one_request:
                ABORT_CLIENT_CANCEL.inc()
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as e:
            code = e.code if isinstance(e, ServerError) else grpc.StatusCode.INTERNAL
            try:
                await _abort(context, method.__name__, e)
            finally:
                # gRPC keeps the abort in a reference cycle with this error, and so
                # every frame it passed through, the request among their locals (a
                # 100,000-tensor manifest: megabytes), until a full collection: let
                # them go now, once the status is set (and a traceback logged).
                traceback.clear_frames(e.__traceback__)
            raise AssertionError("unreachable: context.abort raises") from e
        finally:
            calls.ended(code)

    return wrapper
