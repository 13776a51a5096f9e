"""The coordinator serves grpc.health.v1 (overall and per model) and server reflection."""

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase)

from .conftest import MODEL_ID, health_check, rpc_error


@pytest.fixture(scope="module")
def one_worker(module_cluster):
    return module_cluster(workers=1, worker_args=["--kv-cache-memory", "16MiB"])


def test_health_serving(one_worker):
    channel = one_worker.client.channel
    assert health_check(channel, "") == health_pb2.HealthCheckResponse.SERVING
    assert health_check(channel, MODEL_ID) == health_pb2.HealthCheckResponse.SERVING


def test_health_unknown_service_is_not_found(one_worker):
    e = rpc_error(lambda: health_check(one_worker.client.channel, "no-such-service"))
    assert e.code() == grpc.StatusCode.NOT_FOUND, (e.code(), e.details())


def test_reflection_lists_services(one_worker):
    db = ProtoReflectionDescriptorDatabase(one_worker.client.channel)
    services = set(db.get_services())
    assert {"kvgrid.v1.Generation", "grpc.health.v1.Health"} <= services, services
    # The descriptors are complete enough to drive a generic client.
    pool = descriptor_pool.DescriptorPool(db)
    gen = pool.FindServiceByName("kvgrid.v1.Generation")
    assert {m.name for m in gen.methods} == {"Generate", "Tokenize", "Detokenize", "ListModels",
                                             "ClusterStatus"}
    generate = gen.methods_by_name["Generate"]
    assert generate.output_type.full_name == "kvgrid.v1.GenerateResponse"
    assert "prompt_token_ids" in generate.input_type.fields_by_name
