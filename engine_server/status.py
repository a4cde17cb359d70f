"""The one place a failure inside an RPC becomes the call's gRPC status.

Every servicer method is wrapped by ``rpc`` (coroutines) or ``rpc_stream``
(async generators): a ``ServerError`` ends the call with its own code and
message; anything else is a bug or an engine failure nobody anticipated, so it
is logged with its traceback and answered INTERNAL (never the UNKNOWN gRPC would
send for an escaped exception, which clients cannot act on). Cancellation and
an abort already under way pass through untouched.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from engine_server.errors import ServerError

log = logging.getLogger(__name__)

Self = TypeVar("Self")
Req = TypeVar("Req")
Resp = TypeVar("Resp")


async def _abort(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServerError):
        await context.abort(exc.code, str(exc))
    log.error("%s failed unexpectedly", method, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc!r}")


def rpc(
    method: Callable[[Self, Req, grpc.aio.ServicerContext], Awaitable[Resp]],
) -> Callable[[Self, Req, grpc.aio.ServicerContext], Awaitable[Resp]]:
    """Status boundary for a unary-response method (or one that writes its stream)."""

    @functools.wraps(method)
    async def wrapper(self: Self, request: Req, context: grpc.aio.ServicerContext) -> Resp:
        try:
            return await method(self, request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:
            await _abort(context, method.__name__, e)
            raise AssertionError("unreachable: context.abort raises") from e

    return wrapper


def rpc_stream(
    method: Callable[[Self, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]],
) -> Callable[[Self, Req, grpc.aio.ServicerContext], AsyncIterator[Resp]]:
    """Status boundary for a method that yields its stream's messages."""

    @functools.wraps(method)
    async def wrapper(self: Self, request: Req, context: grpc.aio.ServicerContext) -> Any:
        try:
            async for message in method(self, request, context):
                yield message
        except (asyncio.CancelledError, grpc.aio.AbortError, GeneratorExit):
            raise
        except Exception as e:
            await _abort(context, method.__name__, e)

    return wrapper
