"""`python -m gateway --config FILE`: run the gateway (same as `skewserve gateway`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.config import ConfigError, load_gateway_config
from gateway.listen import ListenError
from gateway.logs import configure_logging
from gateway.server import run


def main() -> None:
    parser = argparse.ArgumentParser(description="skewserve gateway")
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--ready-file", type=Path, help="write the bound ports here once serving")
    args = parser.parse_args()
    try:
        cfg = load_gateway_config(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(cfg.log_json, cfg.log_level.upper())
    try:
        run(cfg, args.ready_file, args.config)
    except ListenError as exc:  # a taken port: one line naming the port and its field, no traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
