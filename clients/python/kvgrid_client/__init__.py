"""kvgrid_client: a Python client for a kvgrid cluster's `Generation` gRPC service.

    from kvgrid_client import Client
    with Client("127.0.0.1:50051") as c:
        for r in c.generate("In the beginning", max_new_tokens=32, temperature=0):
            print(r.text, end="", flush=True)
        reply = c.generate_text(messages=[{"role": "user", "content": "Hello"}])

Importing the package generates the protobuf/gRPC modules from the repository's proto/
directory when they are missing (see kvgrid_client._gen); they are then importable as
`kvgrid.v1.generation_pb2` (also `kvgrid_client.pb`) and `kvgrid.v1.generation_pb2_grpc`
(`kvgrid_client.pb_grpc`).
"""

from kvgrid_client.client import (Client, Completion, build_request, chat_message,
                                  finish_reason_name, pb, pb_grpc)

__all__ = ["Client", "Completion", "build_request", "chat_message", "finish_reason_name", "pb",
           "pb_grpc"]
