"""`skewserve up`: real Triton servers per region plus the gateway, started and stopped as one."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from skewserve.stack import StackConfigError, load_stack_config
from tests.process_helpers import cli_process, read_until


@pytest.mark.slow
def test_up_serves_through_the_gateway_and_stops_everything(gateway_repo: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "repository": str(gateway_repo),
                "regions": {"us-east": 1, "eu-west": 1},
                "gateway": {
                    "home_region": "eu-west",
                    "listen": {"http_port": 0, "grpc_port": 0, "ops_port": 0},
                },
            }
        )
    )
    with cli_process("up", "--config", str(cfg), "--log-dir", str(tmp_path / "logs")) as proc:
        text = read_until(proc, "press Ctrl-C")
        m = re.search(
            r"gateway\s+│\s+eu-west \(home\)\s+│\s+gateway\s+│\s+http://[\d.]+:\d+\s+│\s+([\d.]+:\d+)", text
        )
        assert m, text
        ops = re.search(r"gateway ops listener \(metrics, admin\): (http://[\d.]+:\d+)/metrics", text)
        assert ops, text
        with urllib.request.urlopen(f"{ops.group(1)}/admin/upstreams", timeout=10) as r:
            assert json.loads(r.read())["home_region"] == "eu-west"
        client = grpcclient.InferenceServerClient(m.group(1))
        inp = grpcclient.InferInput("features", [1, 8], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 8), np.float32))
        assert client.infer("lt", [inp]).as_numpy("label").shape == (1, 1)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, rest
        assert "stopped the gateway and all servers" in rest
        pids = [int(p) for p in re.findall(r"│\s+(\d{2,})\s+│\n", text)]
        assert len(pids) == 3, text
        for pid in pids:
            assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_stack_config_errors_name_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(yaml.safe_dump({"regions": {"us-east": 0}}))
    with pytest.raises(StackConfigError, match="regions: each region needs at least one server"):
        load_stack_config(cfg)
    cfg.write_text(yaml.safe_dump({"regions": {"us-east": 1}, "gateway": {"home_region": "mars"}}))
    with pytest.raises(
        StackConfigError,
        match=r"gateway section\): home_region 'mars' is not one of the regions \['us-east'\]",
    ):
        load_stack_config(cfg)
