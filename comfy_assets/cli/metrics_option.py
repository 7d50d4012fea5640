"""Options of the steering features: ``--metrics-port P`` and ``--metrics-host HOST`` of
``run`` and ``worker`` (Prometheus metrics on ``http://<host>:P/metrics``:
``comfy_assets/metrics.py``, imported only when asked) and ``--priority N`` of ``run``
and ``enqueue``."""

from __future__ import annotations

import argparse
import sys


def port(text: str) -> int:
    """An argparse ``type``: a TCP port, 1 to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return value


def priority(text: str) -> int:
    """An argparse ``type``: a batch's priority, an integer (``jobs/model.py``)."""
    from comfy_assets.jobs.model import MAX_PRIORITY, is_priority

    try:
        value = int(text)
    except ValueError:
        value = None
    if not is_priority(value):
        raise argparse.ArgumentTypeError(
            f"expected an integer from -{MAX_PRIORITY} to {MAX_PRIORITY}, got {text!r}"
        )
    return value  # type: ignore[return-value]


# The steering options, each its flag and what argparse takes of it (default: None, the
# header's priority else 0, or no metrics served).
STEERING_OPTIONS: dict[str, tuple[str, dict[str, object]]] = {
    "priority": (
        "--priority",
        {
            "type": priority,
            "metavar": "N",
            "help": "the batch's priority among those sharing the servers, higher first: a "
            "freed server goes to the highest waiting; a prompt rendering is never "
            'interrupted (default: the job file header\'s "priority", else 0)',
        },
    ),
    "metrics": (
        "--metrics-port",
        {
            "type": port,
            "metavar": "P",
            "help": "serve Prometheus metrics (names comfy_assets_*) on this port, /metrics "
            "(default: none)",
        },
    ),
    "metrics_host": (
        "--metrics-host",
        {
            "metavar": "HOST",
            "help": "the address --metrics-port listens on: 127.0.0.1 keeps the metrics "
            "on this machine (default: 0.0.0.0, every address, for a Prometheus elsewhere; "
            "they carry server names, partitions and counts, and no authentication)",
        },
    ),
}


def add_steering_option(p: argparse.ArgumentParser, name: str) -> None:
    """Register the steering option ``name`` of ``STEERING_OPTIONS`` (``--priority N``,
    ``--metrics-port P``, ``--metrics-host HOST``), default None."""
    flag, spec = STEERING_OPTIONS[name]
    p.add_argument(flag, default=None, **spec)  # type: ignore[arg-type]


def serve_metrics(args: argparse.Namespace) -> int | None:
    """Serve the metrics when ``--metrics-port`` was given, on ``--metrics-host``
    (0.0.0.0 when not given), before the command opens its store, so a refused option
    leaves nothing behind. Returns None, or 2 after saying on stderr why not:
    ``--metrics-host`` without ``--metrics-port``, or a port that could not be bound (the
    address included, when one was given). ``track_metrics`` then says what to count."""
    port = getattr(args, "metrics_port", None)
    host = getattr(args, "metrics_host", None)
    if port is None:
        if host is not None:
            print("error: --metrics-host needs --metrics-port", file=sys.stderr)
            return 2
        return None
    from comfy_assets.metrics import METRICS

    try:
        METRICS.serve(port, addr=host or "0.0.0.0")
    except (OSError, UnicodeError) as e:  # a host that does not resolve, or no such address
        where = f"--metrics-host {host} --metrics-port {port}" if host else f"--metrics-port {port}"
        print(f"error: {where}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    return None


def track_metrics(args: argparse.Namespace, store: object, partition: str | None) -> None:
    """Count the jobs and attempts of ``partition`` of ``store`` (None: every partition)
    in the metrics ``serve_metrics`` serves; nothing when ``--metrics-port`` was not given."""
    if getattr(args, "metrics_port", None) is None:
        return
    from comfy_assets.metrics import METRICS

    METRICS.track_store(store, partition)  # type: ignore[arg-type]
