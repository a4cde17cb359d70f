"""GetServerInfo, health and reflection."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import engine_contract
from engine_contract.v1 import engine_pb2 as pb


def test_server_info_describes_engine_and_contract(server_info: pb.GetServerInfoResponse) -> None:
    info = server_info
    assert info.contract_revision >= engine_contract.MINIMUM_SERVER_REVISION
    assert 1 <= info.minimum_client_revision <= engine_contract.CONTRACT_REVISION
    assert len(info.instance_id) >= 8
    assert info.model_name
    config = info.engine_config
    assert config.context_length > 0 and config.kv_block_size > 0
    assert config.total_kv_blocks > 0 and config.max_running_sequences > 0
    assert config.max_batched_tokens > 0 and config.data_parallel_size >= 1
    assert info.vocab_size > 0 and info.eos_token_ids
    assert all(0 <= t < info.vocab_size for t in info.eos_token_ids)
    defaults = info.generation_defaults
    assert defaults.max_new_tokens >= 0 and defaults.stop_token_ids
    assert 0 < defaults.top_p <= 1 and defaults.temperature >= 0
    assert info.backend_name and info.backend_version
    assert info.limits.max_stop_strings > 0 and info.limits.max_request_id_length >= 64
    assert info.limits.max_message_bytes > 0
    assert info.start_time_unix_nanos > 0


async def test_instance_id_is_stable_within_a_process(stub, server_info) -> None:  # type: ignore[no-untyped-def]
    again = await stub.GetServerInfo(
        pb.GetServerInfoRequest(client_revision=engine_contract.CONTRACT_REVISION)
    )
    assert again.instance_id == server_info.instance_id


async def test_health_serving_for_server_and_service(engine_address: str) -> None:
    async with grpc.aio.insecure_channel(engine_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", engine_contract.SERVICE_NAME):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services(engine_address: str) -> None:
    async with grpc.aio.insecure_channel(engine_address) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for answer in reflect.ServerReflectionInfo(iter([request])):
            names = {s.name for s in answer.list_services_response.service}
            break
    assert {engine_contract.SERVICE_NAME, "grpc.health.v1.Health"} <= names
