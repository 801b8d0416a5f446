"""How a command runs in the foreground: logging for people, and blocking until Ctrl-C."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable


def setup_logging(verbose: bool) -> None:
    """INFO (DEBUG with --verbose) to stderr; the exporter's and the publishes' INFO lines only with
    --verbose."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not verbose:
        # The command prints what export and rollout did, once, for people; their INFO log lines
        # (for services and logs) would say it a second time.
        for noisy in ("exporter", "repository.publish", "repository.object_publish"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def wait_for_interrupt(check: Callable[[], None] | None = None) -> None:
    """Block the foreground until Ctrl-C or SIGTERM; `check()` runs every half second and may raise."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            if check is not None:
                check()
    except KeyboardInterrupt:
        pass
