"""`python -m gateway --config FILE`: run the gateway (same as `skewserve gateway`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.config import ConfigError, load_gateway_config
from gateway.fleet.cascade import check_rules
from gateway.fronts.grpc_plane import WorkerSlot
from gateway.fronts.listen import ListenError
from gateway.operations.logs import configure_logging
from gateway.server import run


def main() -> None:
    parser = argparse.ArgumentParser(description="skewserve gateway")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--ready-file", type=Path, help="write the bound ports here once serving")
    # Set by the supervisor of listen.workers > 1 (gateway/supervisor.py): index:http_port:directory.
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        cfg = load_gateway_config(args.config)
        check_rules(cfg)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(cfg.log_json, cfg.log_level.upper())
    slot = None
    if args.worker:
        index, port, directory = args.worker.split(":", 2)
        slot = WorkerSlot(int(index), Path(directory), int(port))
    try:
        run(cfg, slot.ready_file if slot else args.ready_file, args.config, slot)
    except ListenError as exc:  # a taken port: one line naming the port and its field, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
