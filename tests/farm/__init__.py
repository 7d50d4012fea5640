"""A render farm on one machine, built from Linux namespaces (root needed).

- ``Farm(folder)`` (a context manager): a bridge with a free ``10.77.X.0/24``; the database
  host in the root namespace: a PostgreSQL cluster of the farm's own listening on
  127.0.0.1 and ``farm.db_address`` (``farm.db_url`` for hosts, ``farm.local_db_url`` for
  the test, ``farm.restart_database()``), the machine's RabbitMQ behind a forwarder on
  ``farm.amqp_address`` (``farm.amqp_url``, ``farm.queue(name)`` for a queue of the
  farm's own). Everything is removed on exit, whatever happened.
- ``farm.add_host(name, hostname=..., clock_offset_s=...) -> Host``: its own network
  namespace (a veth to the bridge, ``host.address``), PID, UTS and mount namespaces (two
  hosts may share a host name; pids start at 1 in each). ``host.start(cmd, env, name=)``
  -> ``Proc`` (``.wait()``, ``.text()``, ``.signal()``, ``.ns_pid``, ``.wait_for(text)``);
  ``host.link(False/True)``: its cable; ``host.cut(address)`` / ``host.heal(address)``:
  its packets to one address lost; ``host.kill()``: every process SIGKILLed at once.
- ``farm.add_gpu_host(name, fakes=2, prompt_seconds=0.1) -> GpuHost``: a host running fake
  ComfyUI servers on its address (``farm.server_args()``, ``farm.stats()``,
  ``farm.queued()``).
- ``unavailable()``: why the farm cannot be built here (not root, no namespaces), or None.
- ``invariants``: what must hold after a scenario (``tests/farm/invariants.py``).
"""

from __future__ import annotations

from tests.farm import database, net
from tests.farm.farm import Farm
from tests.farm.gpu import Fake, GpuHost
from tests.farm.host import Host, HostError, Proc


def unavailable() -> str | None:
    """Why no farm can be built on this machine, or None (see ``net.unavailable`` and
    ``database.unavailable``)."""
    return net.unavailable() or database.unavailable()


__all__ = ["Fake", "Farm", "GpuHost", "Host", "HostError", "Proc", "unavailable"]
