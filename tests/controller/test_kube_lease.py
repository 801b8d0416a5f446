"""Issue 34, item 5 in a cluster: the leader election's lease as a Kubernetes Lease object, over the
API server's wire format (tests/gateway/kube_api.py: TLS, a bearer token, resourceVersion-checked
writes). The election's rules are the store lease's (test_leader_election.py); here: the Lease says
who leads, a take-over needs a whole lease without renewal, and of two replicas racing one wins."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.errors import ControlError
from controller.kube_lease import KubeAccess, KubeLeaseRecords
from controller.leader import LeaderElection
from repository.errors import StateConflict
from tests.controller.test_leader_election import Clock
from tests.gateway.kube_api import KubeApi, make_tls

TOKEN = "service-account-token"


@pytest.fixture()
def account(tmp_path: Path) -> Iterator[tuple[KubeApi, Path]]:
    """The API server and a service-account folder as kubelet mounts it (token, ca.crt, namespace)."""
    ca, tls = make_tls(tmp_path / "tls")
    api = KubeApi(TOKEN, namespace="skewserve", tls=tls)
    folder = tmp_path / "serviceaccount"
    folder.mkdir()
    (folder / "token").write_text(TOKEN + "\n")
    (folder / "ca.crt").write_bytes(ca.read_bytes())
    (folder / "namespace").write_text("skewserve")
    try:
        yield api, folder
    finally:
        api.close()


def _records(api: KubeApi, folder: Path) -> KubeLeaseRecords:
    return KubeLeaseRecords(KubeAccess.in_cluster(api.url, account_dir=folder))


def test_a_kubernetes_lease_elects_one_leader_and_hands_over_after_a_whole_lease(
    account: tuple[KubeApi, Path],
) -> None:
    api, folder = account
    clock = Clock()
    a = LeaderElection(_records(api, folder), "a", "us-east", duration_s=15, clock=clock)
    b = LeaderElection(_records(api, folder), "b", "us-east", duration_s=15, clock=clock)
    assert a.attempt() and not b.attempt()
    lease = api.leases["skewserve-leader-us-east"]
    assert lease["spec"]["holderIdentity"] == "a" and lease["spec"]["leaseDurationSeconds"] == 15
    assert lease["spec"]["leaseTransitions"] == 1 and lease["spec"]["renewTime"].endswith("Z")
    for _ in range(5):  # renewals move the Lease's resourceVersion; b never takes over
        clock.now += 5
        assert a.attempt() and not b.attempt()
    clock.now += 10.1
    assert not a.leading and not b.attempt()  # a stopped leading; b waits a whole lease
    clock.now += 5
    assert b.attempt() and b.term == 2
    assert api.leases["skewserve-leader-us-east"]["spec"]["holderIdentity"] == "b"
    b.release()
    assert api.leases["skewserve-leader-us-east"]["spec"]["holderIdentity"] == ""
    assert a.attempt() and a.term == 3


def test_of_two_writers_of_one_lease_version_the_second_gets_a_conflict(
    account: tuple[KubeApi, Path],
) -> None:
    api, folder = account
    records = _records(api, folder)
    first = json.dumps({"holder": "a", "term": 1, "duration_s": 15.0, "renewed": 1.0}).encode()
    records.write_record("leader-x", first, None)
    with pytest.raises(StateConflict):  # a create of an existing Lease
        records.write_record("leader-x", first, None)
    _, token = records.read_record("leader-x")
    records.write_record("leader-x", first, token)
    with pytest.raises(StateConflict):  # the version read is no longer current
        records.write_record("leader-x", first, token)
    assert api.conflicts == 2
    records.remove_record("leader-x")
    assert records.read_record("leader-x") == (None, None)


def test_a_wrong_token_or_no_cluster_is_an_error_naming_the_fix(
    account: tuple[KubeApi, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    api, folder = account
    (folder / "token").write_text("not-the-token")
    with pytest.raises(ControlError, match="401"):
        _records(api, folder).read_record("leader-x")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ControlError, match="--leader-lease-in store"):
        KubeAccess.in_cluster(account_dir=folder)


def test_the_command_outside_a_cluster_refuses_a_kubernetes_lease_naming_the_fix(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    servers = [{"name": "s", "http": "127.0.0.1:9", "grpc": "127.0.0.1:9"}]
    config.write_text(json.dumps({"regions": [{"name": "r", "servers": servers}]}))
    cmd = [sys.executable, "-m", "skewserve", "controller", "--config", str(config), "--repo", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    done = subprocess.run(
        [*cmd, "--leader-election", "--leader-lease-in", "kubernetes"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--leader-lease-in store" in done.stdout + done.stderr
