"""torchft's lighthouse messages, declared here with protobuf's descriptor API (no generated
code, no .proto file shipped): the same package ``torchft``, message names, field names and
numbers as torchft 0.2.0's ``proto/torchft.proto``, so its Rust manager cannot tell us from
its lighthouse on the wire. Only what ``LighthouseService`` uses is declared.

:func:`frame` and :func:`varint` are the two pieces of the wire format the roster cache
needs to splice pre-serialized members into a ``Quorum`` (a repeated message field is its
tag, the member's length and the member's bytes, once per member).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

PACKAGE = "torchft"
SERVICE = "torchft.LighthouseService"
QUORUM_METHOD = f"/{SERVICE}/Quorum"
HEARTBEAT_METHOD = f"/{SERVICE}/Heartbeat"

_F = descriptor_pb2.FieldDescriptorProto
_TIMESTAMP_FILE = "google/protobuf/timestamp.proto"

# (message, [(field, number, type, label, message type)]): torchft.proto's lighthouse part.
_MESSAGES: list[tuple[str, list[tuple[str, int, int, int, str]]]] = [
    (
        "QuorumMember",
        [
            ("replica_id", 1, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
            ("address", 2, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
            ("store_address", 3, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
            ("step", 4, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
            ("world_size", 5, _F.TYPE_UINT64, _F.LABEL_OPTIONAL, ""),
            ("shrink_only", 6, _F.TYPE_BOOL, _F.LABEL_OPTIONAL, ""),
            ("data", 7, _F.TYPE_STRING, _F.LABEL_OPTIONAL, ""),
            ("commit_failures", 8, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
        ],
    ),
    (
        "Quorum",
        [
            ("quorum_id", 1, _F.TYPE_INT64, _F.LABEL_OPTIONAL, ""),
            ("participants", 2, _F.TYPE_MESSAGE, _F.LABEL_REPEATED, ".torchft.QuorumMember"),
            ("created", 3, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, ".google.protobuf.Timestamp"),
        ],
    ),
    (
        "LighthouseQuorumRequest",
        [("requester", 1, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, ".torchft.QuorumMember")],
    ),
    (
        "LighthouseQuorumResponse",
        [("quorum", 1, _F.TYPE_MESSAGE, _F.LABEL_OPTIONAL, ".torchft.Quorum")],
    ),
    ("LighthouseHeartbeatRequest", [("replica_id", 1, _F.TYPE_STRING, _F.LABEL_OPTIONAL, "")]),
    ("LighthouseHeartbeatResponse", []),
]

# Field numbers the roster cache writes by hand (see :func:`frame`).
QUORUM_PARTICIPANTS = 2
QUORUM_CREATED = 3
RESPONSE_QUORUM = 1


def _file() -> descriptor_pb2.FileDescriptorProto:
    f = descriptor_pb2.FileDescriptorProto(
        # Our own file name in a pool of our own: a generated torchft module elsewhere in the
        # process (torchft ships none today) could never clash with it.
        name="spottrain/torchft_lighthouse.proto",
        package=PACKAGE,
        syntax="proto3",
        dependency=[_TIMESTAMP_FILE],
    )
    for name, fields in _MESSAGES:
        msg = f.message_type.add(name=name)
        for fname, number, ftype, label, type_name in fields:
            fd = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                fd.type_name = type_name
    svc = f.service.add(name="LighthouseService")
    svc.method.add(
        name="Quorum",
        input_type=".torchft.LighthouseQuorumRequest",
        output_type=".torchft.LighthouseQuorumResponse",
    )
    svc.method.add(
        name="Heartbeat",
        input_type=".torchft.LighthouseHeartbeatRequest",
        output_type=".torchft.LighthouseHeartbeatResponse",
    )
    return f


def _build() -> dict[str, Any]:
    pool = descriptor_pool.DescriptorPool()
    ts = descriptor_pb2.FileDescriptorProto()
    timestamp_pb2.DESCRIPTOR.CopyToProto(ts)
    pool.Add(ts)
    pool.Add(_file())
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{name}"))
        for name, _ in _MESSAGES
    }


_CLASSES = _build()
QuorumMember: Any = _CLASSES["QuorumMember"]
Quorum: Any = _CLASSES["Quorum"]
LighthouseQuorumRequest: Any = _CLASSES["LighthouseQuorumRequest"]
LighthouseQuorumResponse: Any = _CLASSES["LighthouseQuorumResponse"]
LighthouseHeartbeatRequest: Any = _CLASSES["LighthouseHeartbeatRequest"]
LighthouseHeartbeatResponse: Any = _CLASSES["LighthouseHeartbeatResponse"]


def varint(n: int) -> bytes:
    """``n`` (>= 0) as a protobuf base-128 varint."""
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def frame(number: int, body: bytes) -> bytes:
    """``body`` as length-delimited field ``number`` (a sub-message, once)."""
    return varint(number << 3 | 2) + varint(len(body)) + body
