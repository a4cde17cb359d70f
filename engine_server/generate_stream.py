"""One Generates stream: many ordinary completions over one call, their deltas
packed per message (``tagged_stream`` says how the stream is shared and bounded).

Deltas of one completion that queue up while a write is in flight are merged
into one (protobuf's MergeFrom concatenates tokens, logprobs and top logprobs
and adds ``finished``), so a busy stream sends fewer, larger deltas, and the
client yields fewer chunks. Under load (``hold_from`` completions or more
running on the stream) the writer also waits ``hold_s`` after each write, so
more of each completion's tokens merge: every delta costs each process on its
way (engine server, bridge, Dynamo's frontend, the client) about the same
whatever it carries, and a stream this busy spends its CPU on deltas rather
than tokens. A quieter stream writes each delta at once.

A completion started ``paced`` (revision 6) has at most one delta on its way:
once one is written, no more of its output is taken from the engine until the
client names its tag in ``taken``. The engine runs on meanwhile and merges what
it makes (vLLM's delta output collector, the sim's drain), so the deltas are as
coarse as the client's own pace needs, as in a one-process worker whose engine
and server share a loop, and a stream whose client keeps up still gets every
token at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from typing import Any, Unpack

import grpc

from engine_contract.v1 import engine_pb2 as pb
from engine_server.tagged_stream import Queued, StreamLimits, TaggedStream

RunGenerate = Callable[[pb.GenerateRequest], AsyncGenerator[pb.GenerateResponse, None]]
"""One completion's messages (``ServerCore.generate``); closing it aborts the request."""


class GenerateStream(TaggedStream[pb.GenerateRequest, pb.GenerateDelta]):
    """Serves one Generates call: ``await GenerateStream(...).serve(requests)``."""

    request_name = "GeneratesRequest"
    noun = "completions"
    payload_field = "generate"
    item_type = pb.GenerateDelta
    response_type = pb.GeneratesResponse
    items_field = "deltas"

    def __init__(
        self,
        generate: RunGenerate,
        context: grpc.aio.ServicerContext,
        *,
        hold_s: float = 0.0,
        hold_from: int = 1,
        **limits: Unpack[StreamLimits],
    ) -> None:
        super().__init__(context, **limits)
        self._generate = generate
        self._hold_s = hold_s
        self._hold_from = hold_from
        # The delta of each completion still waiting for a write: later ones merge in.
        self._unsent: dict[int, Queued[pb.GenerateDelta]] = {}
        # A merged delta stops growing here (and a next one queues behind it).
        self._merge_limit = self._limit // 2
        # Paced completions: set while the client has taken their last delta
        # written (a next one may go), clear while it is on its way.
        self._pacers: dict[int, asyncio.Event] = {}

    def _on_message(self, message: Any) -> None:
        pacers = self._pacers
        for tag in message.taken:
            pacer = pacers.get(tag)
            if pacer is not None:
                pacer.set()

    def _start_one(self, start: Any) -> None:
        tag = start.tag
        new = tag not in self._running
        super()._start_one(start)
        if start.paced and new and tag in self._running:
            pacer = self._pacers[tag] = asyncio.Event()
            pacer.set()

    def _finished(self, tag: int, task: asyncio.Task[pb.GenerateDelta | None]) -> None:
        self._pacers.pop(tag, None)
        super()._finished(tag, task)

    async def _answer(self, tag: int, request: pb.GenerateRequest) -> None:
        pacer = self._pacers.get(tag)
        async with contextlib.aclosing(self._generate(request)) as messages:
            while True:
                if pacer is not None:
                    # Nothing is taken from the engine until the client has taken
                    # the last delta: what the engine makes meanwhile merges there.
                    await pacer.wait()
                try:
                    message = await anext(messages)
                except StopAsyncIteration:
                    return
                size = message.ByteSize()
                unsent = self._unsent.get(tag)
                if unsent is not None and unsent.size + size <= self._merge_limit:
                    unsent.item.response.MergeFrom(message)
                    unsent.size += size
                    continue
                if size > self._limit:
                    self._emit(tag, pb.GenerateDelta(tag=tag, response=message))  # an error
                    return
                if pacer is not None:
                    # Pulled while the last delta was being written: it waits for its take.
                    await pacer.wait()
                queued = Queued(tag, pb.GenerateDelta(tag=tag, response=message), size)
                self._unsent[tag] = queued
                self._queue(queued)

    def _pause_after_write(self) -> float:
        return self._hold_s if len(self._running) >= self._hold_from else 0.0

    def _taken(self, queued: Queued[pb.GenerateDelta]) -> None:
        tag = queued.tag
        if self._unsent.get(tag) is queued:
            del self._unsent[tag]
        pacer = self._pacers.get(tag)
        if pacer is not None:
            pacer.clear()  # on its way: the next waits for the client's take

    def _emit(self, tag: int, item: pb.GenerateDelta) -> None:
        self._unsent.pop(tag, None)  # an error ends the completion: nothing merges after it
        super()._emit(tag, item)
