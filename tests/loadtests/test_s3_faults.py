"""The fault-injecting S3 proxy in front of a real moto_server: what passes is the store's answer
byte for byte, and each fault kind reaches a boto3 client as S3's own failure would."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError, ReadTimeoutError

from loadtests.s3_faults import FaultPlan, S3FaultProxy
from tests.deploy.conftest import CREDENTIALS, S3Server, s3_server  # noqa: F401 - the fixture

BUCKET = "faults"


def _client(endpoint: str, attempts: int = 1, read_timeout: float = 10.0) -> Any:
    """A client that does not retry (by default): every fault the proxy injects reaches the test."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(
            s3={"addressing_style": "path"},
            retries={"total_max_attempts": attempts, "mode": "standard"},
            connect_timeout=5,
            read_timeout=read_timeout,
        ),
    )


@pytest.fixture()
def store(s3_server: S3Server) -> Any:  # noqa: F811 - the fixture imported above
    """moto's server, not through the proxy: the truth the proxy's answers are compared with."""
    client = _client(s3_server.endpoint)
    try:
        client.create_bucket(Bucket=BUCKET)
    except ClientError as exc:
        if exc.response["Error"]["Code"] != "BucketAlreadyOwnedByYou":
            raise
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    for i in range(8):
        client.put_object(Bucket=BUCKET, Key=f"models/m{i}/state.json", Body=f"state {i}".encode())
    return client


@pytest.fixture()
def proxy(s3_server: S3Server) -> Iterator[S3FaultProxy]:  # noqa: F811
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    with S3FaultProxy(("127.0.0.1", port), seed=7) as running:
        yield running


def _listing(client: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(client.list_objects_v2(Bucket=BUCKET, Prefix="models/", **kwargs))


def test_without_faults_every_call_is_the_stores_answer(store: Any, proxy: S3FaultProxy) -> None:
    client = _client(proxy.endpoint)
    big = bytes(range(256)) * 8192  # 2 MiB: boto3 sends `Expect: 100-continue` first
    client.put_object(Bucket=BUCKET, Key="models/big.bin", Body=big)
    assert client.get_object(Bucket=BUCKET, Key="models/big.bin")["Body"].read() == big
    assert store.get_object(Bucket=BUCKET, Key="models/big.bin")["Body"].read() == big
    head = client.head_object(Bucket=BUCKET, Key="models/m3/state.json")
    assert head["ContentLength"] == len(b"state 3")
    # conditional writes keep their meaning through the proxy: the store's 412 comes back as is
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=BUCKET, Key="models/m3/state.json", Body=b"again", IfNoneMatch="*")
    assert refused.value.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    with pytest.raises(ClientError) as missing:
        client.get_object(Bucket=BUCKET, Key="models/none")
    assert missing.value.response["Error"]["Code"] == "NoSuchKey"
    keys = [o["Key"] for o in _listing(client)["Contents"]]
    assert keys == [o["Key"] for o in _listing(store)["Contents"]]
    prefixes = _listing(client, Delimiter="/")
    assert [p["Prefix"] for p in prefixes["CommonPrefixes"]] == [f"models/m{i}/" for i in range(8)]
    assert proxy.counts == {"requests": 7}


def test_503_is_s3s_slow_down_and_the_write_never_reaches_the_store(store: Any, proxy: S3FaultProxy) -> None:
    proxy.plan = FaultPlan(fraction=1.0, kinds=("503",))
    client = _client(proxy.endpoint)
    with pytest.raises(ClientError) as refused:
        client.put_object(Bucket=BUCKET, Key="models/new", Body=b"x")
    err = refused.value.response
    assert err["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert err["Error"] == {"Code": "SlowDown", "Message": "Please reduce your request rate."}
    with pytest.raises(ClientError):
        store.head_object(Bucket=BUCKET, Key="models/new")
    # boto3's standard retries meet the same fraction: with every call failing, each attempt fails
    with pytest.raises(ClientError):
        _client(proxy.endpoint, attempts=3).get_object(Bucket=BUCKET, Key="models/m0/state.json")
    assert proxy.counts == {"requests": 4, "503": 4}


def test_a_share_of_calls_fails_and_the_client_sees_exactly_those(store: Any, proxy: S3FaultProxy) -> None:
    proxy.plan = FaultPlan(fraction=0.25, kinds=("503",))
    client = _client(proxy.endpoint)
    failed = 0
    for i in range(80):
        try:
            body = client.get_object(Bucket=BUCKET, Key=f"models/m{i % 8}/state.json")["Body"].read()
            assert body == f"state {i % 8}".encode()
        except ClientError as exc:
            assert exc.response["Error"]["Code"] == "SlowDown"
            failed += 1
    assert proxy.counts["requests"] == 80 and proxy.counts["503"] == failed
    assert 0 < failed < 80


def test_timeout_holds_the_call_until_the_clients_read_timeout(store: Any, proxy: S3FaultProxy) -> None:
    proxy.plan = FaultPlan(fraction=1.0, kinds=("timeout",), hang_s=60.0)
    client = _client(proxy.endpoint, read_timeout=0.2)
    with pytest.raises(ReadTimeoutError):
        client.put_object(Bucket=BUCKET, Key="models/hung", Body=b"x")
    with pytest.raises(ClientError):
        store.head_object(Bucket=BUCKET, Key="models/hung")
    assert proxy.counts == {"requests": 1, "timeout": 1}


def test_listing_faults_answer_empty_or_partial_listings_that_say_they_are_complete(
    store: Any, proxy: S3FaultProxy
) -> None:
    client = _client(proxy.endpoint)
    everything = {o["Key"] for o in _listing(store)["Contents"]}
    proxy.plan = FaultPlan(fraction=1.0, kinds=("empty_listing",))
    empty = _listing(client)
    assert "Contents" not in empty and empty["KeyCount"] == 0 and empty["IsTruncated"] is False
    # only listings have listing faults: a read under the same plan is the store's answer
    assert client.get_object(Bucket=BUCKET, Key="models/m1/state.json")["Body"].read() == b"state 1"

    proxy.plan = FaultPlan(fraction=1.0, kinds=("partial_listing",))
    partial = _listing(client, MaxKeys=3)  # a truncated page comes back as if it were the last
    keys = {o["Key"] for o in partial.get("Contents", [])}
    assert keys < everything and partial["KeyCount"] == len(keys) and partial["IsTruncated"] is False
    pages = [_listing(client) for _ in range(4)]
    for page in pages:
        listed = {o["Key"] for o in page.get("Contents", [])}
        assert listed <= everything and page["KeyCount"] == len(listed) and page["IsTruncated"] is False
    assert any({o["Key"] for o in page.get("Contents", [])} != everything for page in pages)
    assert proxy.counts == {"requests": 7, "empty_listing": 1, "partial_listing": 5}


def test_slow_reads_arrive_whole_or_not_within_a_short_read_timeout(store: Any, proxy: S3FaultProxy) -> None:
    body = bytes(range(256)) * 64
    store.put_object(Bucket=BUCKET, Key="models/slow.bin", Body=body)
    proxy.plan = FaultPlan(fraction=1.0, kinds=("slow",), slow_s=1.0)  # ten pieces, 0.1 s apart
    assert _client(proxy.endpoint).get_object(Bucket=BUCKET, Key="models/slow.bin")["Body"].read() == body
    with pytest.raises(ReadTimeoutError):
        _client(proxy.endpoint, read_timeout=0.05).get_object(Bucket=BUCKET, Key="models/slow.bin")[
            "Body"
        ].read()
    assert proxy.counts == {"requests": 2, "slow": 2}


def test_a_plan_names_only_known_kinds_and_a_fraction() -> None:
    with pytest.raises(ValueError, match=r"^fault kinds must be some of 503, timeout, .*got \['teapot'\]$"):
        FaultPlan(0.1, ("teapot",))
    with pytest.raises(ValueError, match=r"^fault fraction must be within \[0, 1\], got 1.5$"):
        FaultPlan(1.5)
