"""The EC2 front before moto's server, driven by real boto3 clients (fake credentials): what it
refuses as AWS does (oversized user data, denied secrets and objects), what it serves itself
(console output) and what it passes through untouched (S3 objects of tens of MB, in pieces)."""

from __future__ import annotations

import base64
import hashlib
import http.client
import os
import secrets
import socket
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.config import Config
from botocore.credentials import Credentials
from botocore.exceptions import ClientError
from box.ec2_front import CHUNK, Ec2Front
from moto.server import ThreadedMotoServer

REGION = "us-east-1"
CREDS = {
    "aws_access_key_id": "testing",
    "aws_secret_access_key": "testing",
    "aws_session_token": "testing",
}


@pytest.fixture(scope="module")
def moto_url() -> Iterator[str]:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def front(moto_url: str, no_egress: None) -> Iterator[Ec2Front]:
    # Each test its own moto account: the front puts it on every request.
    with Ec2Front(moto_url, account_id=f"{secrets.randbelow(10**12):012d}") as fake:
        yield fake
    assert fake.internal_errors == []


def _client(front: Ec2Front, service: str, **config: Any) -> Any:
    return boto3.session.Session(**CREDS).client(
        service,
        region_name=REGION,
        endpoint_url=front.url,
        config=Config(retries={"max_attempts": 1}, **config),
    )


def _image(ec2: Any) -> str:
    return str(
        ec2.register_image(
            Name="box-test",
            Architecture="x86_64",
            RootDeviceName="/dev/sda1",
            BlockDeviceMappings=[{"DeviceName": "/dev/sda1", "Ebs": {"VolumeSize": 8}}],
            VirtualizationType="hvm",
        )["ImageId"]
    )


def _launch(ec2: Any, image: str, user_data: str) -> str:
    resp = ec2.run_instances(
        ImageId=image, InstanceType="t3.micro", MinCount=1, MaxCount=1, UserData=user_data
    )
    return str(resp["Instances"][0]["InstanceId"])


def _instance_ids(ec2: Any) -> list[str]:
    return [
        i["InstanceId"] for r in ec2.describe_instances()["Reservations"] for i in r["Instances"]
    ]


def test_user_data_of_16384_bytes_launches_and_one_byte_more_is_refused_as_ec2_does(
    front: Ec2Front,
) -> None:
    ec2 = _client(front, "ec2")
    image = _image(ec2)
    launched = _launch(ec2, image, "#" * 16384)
    with pytest.raises(ClientError) as err:
        _launch(ec2, image, "#" * 16385)
    assert err.value.response["Error"] == {
        "Code": "InvalidParameterValue",
        "Message": "User data is limited to 16384 bytes",
    }
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
    assert _instance_ids(ec2) == [launched]
    attribute = ec2.describe_instance_attribute(InstanceId=launched, Attribute="userData")
    assert base64.b64decode(attribute["UserData"]["Value"]) == b"#" * 16384
    assert front.count("ec2", "RunInstances") == 2


def test_console_output_comes_from_the_source_cut_to_the_newest_64_kib(front: Ec2Front) -> None:
    ec2 = _client(front, "ec2")
    vm = _launch(ec2, _image(ec2), "#!/bin/bash\n")
    lines = "".join(f"boot line {n}\n" for n in range(8000)).encode()
    assert len(lines) > 64 * 1024
    asked: list[str] = []

    def console(instance_id: str) -> bytes | None:
        asked.append(instance_id)
        return lines if instance_id == vm else None

    front.console_source = console
    for latest in ({}, {"Latest": True}, {"Latest": False}):
        out = ec2.get_console_output(InstanceId=vm, **latest)
        # botocore decodes the base64 itself.
        assert out["Output"].encode() == lines[-64 * 1024 :]
        assert out["InstanceId"] == vm and out["Timestamp"].year >= 2024
    assert asked == [vm] * 3
    # The source knows no console for it: moto answers.
    other = _launch(ec2, ec2.describe_instances()["Reservations"][0]["Instances"][0]["ImageId"], "")
    assert ec2.get_console_output(InstanceId=other)["InstanceId"] == other
    front.console_source = lambda _: b""
    assert "Output" not in ec2.get_console_output(InstanceId=vm)


def test_s3_objects_of_50_mb_pass_byte_identical_without_being_held_whole(
    front: Ec2Front,
) -> None:
    s3 = _client(front, "s3")
    s3.create_bucket(Bucket="ckpts")
    data = os.urandom(50 * 1024 * 1024)
    s3.put_object(Bucket="ckpts", Key="step-1/shard-0", Body=data)
    assert s3.head_object(Bucket="ckpts", Key="step-1/shard-0")["ContentLength"] == len(data)
    body = s3.get_object(Bucket="ckpts", Key="step-1/shard-0")["Body"]
    digest = hashlib.sha256()
    for piece in iter(lambda: body.read(4 << 20), b""):
        digest.update(piece)
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert 0 < front.peak_buffer <= CHUNK
    assert front.count("s3", "PUT") == 2 and front.count("s3", "GET") == 1


def test_a_chunked_upload_streams_through_in_pieces(front: Ec2Front) -> None:
    s3 = _client(front, "s3")
    s3.create_bucket(Bucket="logs")
    pieces = [os.urandom(300_000) for _ in range(10)]
    request = AWSRequest(
        method="PUT",
        url=f"{front.url}/logs/boot.log",
        headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"},
    )
    SigV4Auth(Credentials("testing", "testing"), "s3", REGION).add_auth(request)
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    conn.request(
        "PUT",
        "/logs/boot.log",
        body=iter(pieces),
        headers=dict(request.headers.items()),
        encode_chunked=True,
    )
    resp = conn.getresponse()
    resp.read()
    conn.close()
    assert resp.status == 200
    got = s3.get_object(Bucket="logs", Key="boot.log")["Body"].read()
    assert got == b"".join(pieces)


def test_virtual_host_requests_with_the_fronts_host_or_s3s_reach_the_bucket(
    front: Ec2Front,
) -> None:
    _client(front, "s3").create_bucket(Bucket="runs")
    # Sent through the front as an HTTP proxy, so that no name needs to resolve: the
    # request line carries the absolute URL, the Host header the bucket's name.
    virtual = {"proxies": {"http": front.url}, "s3": {"addressing_style": "virtual"}}
    for endpoint in (f"http://localhost:{front.port}", "http://s3.amazonaws.com"):
        s3 = boto3.session.Session(**CREDS).client(
            "s3",
            region_name=REGION,
            endpoint_url=endpoint,
            config=Config(retries={"max_attempts": 1}, **virtual),
        )
        s3.put_object(Bucket="runs", Key="r1/spec.json", Body=b"{}")
        assert s3.get_object(Bucket="runs", Key="r1/spec.json")["Body"].read() == b"{}"
        front.deny_object("runs", "r1/")
        with pytest.raises(ClientError) as err:
            s3.get_object(Bucket="runs", Key="r1/spec.json")
        assert err.value.response["Error"]["Code"] == "AccessDenied"
        front.clear_denials()
    path_style = _client(front, "s3").list_objects_v2(Bucket="runs")["Contents"]
    assert [o["Key"] for o in path_style] == ["r1/spec.json"]


def test_a_denied_object_is_403_for_get_and_head_and_nothing_else_is(front: Ec2Front) -> None:
    s3 = _client(front, "s3")
    s3.create_bucket(Bucket="run")
    for key in ("secret/token", "secret/other", "public/wheel"):
        s3.put_object(Bucket="run", Key=key, Body=key.encode())
    front.deny_object("run", "secret/")
    with pytest.raises(ClientError) as err:
        s3.get_object(Bucket="run", Key="secret/token")
    assert err.value.response["Error"]["Code"] == "AccessDenied"
    assert err.value.response["Error"]["Message"] == "Access Denied"
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    with pytest.raises(ClientError) as err:
        s3.head_object(Bucket="run", Key="secret/other")
    assert err.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    assert s3.get_object(Bucket="run", Key="public/wheel")["Body"].read() == b"public/wheel"
    s3.put_object(Bucket="run", Key="secret/new", Body=b"written")  # a PUT is not denied
    listed = s3.list_objects_v2(Bucket="run", Prefix="secret/")["Contents"]
    assert sorted(o["Key"] for o in listed) == ["secret/new", "secret/other", "secret/token"]
    front.clear_denials()
    assert s3.get_object(Bucket="run", Key="secret/token")["Body"].read() == b"secret/token"


def test_secrets_pass_through_and_a_denied_one_is_refused_as_iam_refuses_it(
    front: Ec2Front,
) -> None:
    sm = _client(front, "secretsmanager")
    arn = sm.create_secret(Name="gh/deploy", SecretString="ghp_token")["ARN"]
    sm.create_secret(Name="hf/token", SecretBinary=b"hf_binary")
    assert sm.get_secret_value(SecretId="gh/deploy")["SecretString"] == "ghp_token"
    assert sm.get_secret_value(SecretId=arn)["SecretString"] == "ghp_token"
    front.deny_secret("gh/deploy")
    for asked in ("gh/deploy", arn):
        with pytest.raises(ClientError) as err:
            sm.get_secret_value(SecretId=asked)
        error = err.value.response["Error"]
        assert error["Code"] == "AccessDeniedException"
        assert error["Message"] == (
            f"User: arn:aws:sts::{front.account_id}:assumed-role/spottrain-vm/box is not "
            f"authorized to perform: secretsmanager:GetSecretValue on resource: {asked} "
            "because no identity-based policy allows the secretsmanager:GetSecretValue action"
        )
        meta = err.value.response["ResponseMetadata"]
        assert meta["HTTPStatusCode"] == 400
        assert meta["HTTPHeaders"]["x-amzn-errortype"].startswith("AccessDeniedException")
    assert sm.get_secret_value(SecretId="hf/token")["SecretBinary"] == b"hf_binary"
    front.clear_denials()
    front.deny_secret(arn)  # denied by ARN, asked by name
    with pytest.raises(ClientError, match="AccessDeniedException"):
        sm.get_secret_value(SecretId="gh/deploy")
    assert front.count("secretsmanager", "GetSecretValue") == 6
    assert front.count("secretsmanager", "CreateSecret") == 2


def test_requests_are_counted_by_service_and_operation_on_a_moto_of_its_own(
    no_egress: None,
) -> None:
    with Ec2Front() as front:
        _client(front, "sts").get_caller_identity()
        ec2 = _client(front, "ec2")
        ec2.describe_instances()
        ec2.describe_instances()
        _client(front, "s3").list_buckets()
        assert front.calls == {
            ("sts", "GetCallerIdentity"): 1,
            ("ec2", "DescribeInstances"): 2,
            ("s3", "GET"): 1,
        }
        assert front.count("ec2") == 2 and front.count() == 4
    assert front.internal_errors == []


def test_a_moto_that_cannot_be_reached_is_a_502_and_an_internal_error() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{unused.getsockname()[1]}"
    with Ec2Front(dead) as front:
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
        conn.request("GET", "/?Action=DescribeRegions")
        resp = conn.getresponse()
        assert resp.status == 502 and b"ConnectionRefusedError" in resp.read()
        conn.close()
    assert len(front.internal_errors) == 1
