"""Request builders and stream helpers shared by the conformance tests."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from engine_contract.v1 import engine_pb2 as pb
from engine_contract.v1 import engine_pb2_grpc as pb_grpc


def new_id(prefix: str = "conf") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def make_prompt(info: pb.GetServerInfoResponse, length: int, seed: int) -> list[int]:
    """Deterministic ids that avoid EOS and the first few (special) ids."""
    rng = random.Random(seed)
    banned = set(info.eos_token_ids) | {0, 1, 2}
    out: list[int] = []
    while len(out) < length:
        token = rng.randrange(3, info.vocab_size)
        if token not in banned:
            out.append(token)
    return out


@dataclass
class StreamResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[pb.TopLogprobs] = field(default_factory=list)
    messages: list[pb.GenerateResponse] = field(default_factory=list)

    @property
    def finished(self) -> pb.GenerateFinished:
        return self.messages[-1].finished


async def collect(stub: pb_grpc.EngineServiceStub, request: pb.GenerateRequest) -> StreamResult:
    result = StreamResult()
    async for message in stub.Generate(request, timeout=60):
        result.messages.append(message)
        result.token_ids.extend(message.token_ids)
        result.logprobs.extend(message.logprobs)
        result.top_logprobs.extend(message.top_logprobs)
    return result


def long_generate(
    info: pb.GetServerInfoResponse, request_id: str, seed: int = 0, max_tokens: int = 400
) -> pb.GenerateRequest:
    """A request that runs for hundreds of decode steps (EOS ignored)."""
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=make_prompt(info, 8, seed))
    room = info.engine_config.context_length - 8
    request.stop.max_tokens = min(max_tokens, room)
    request.stop.ignore_eos = True
    return request
