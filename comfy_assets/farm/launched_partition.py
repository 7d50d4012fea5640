"""The partition a command line launches, added from the watched folder when the sensor
has not added it yet.

``dg launch --assets renders --partition images`` (like ``dagster asset materialize`` and
``dagster job execute`` with ``--partition``) loads the definitions in its own process and
refuses a key that is not yet a partition of ``job_files`` (``DagsterInvalidSubsetError``),
as in a project whose sensor has not ticked yet (no daemon). When the definitions load, a
``--partition KEY`` on the command line that names a job file of the farm's watched
folders is added as a partition first, in the instance of ``DAGSTER_HOME`` (the one those
commands use), with one line on stderr. Without ``DAGSTER_HOME`` the commands run on a
temporary instance of their own, which nothing here can reach: nothing is added.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from dagster import DagsterInstance

from comfy_assets.farm.names import Farm
from comfy_assets.farm.partitions import iter_job_files, partition_key_for


def partition_argument(argv: Sequence[str]) -> str | None:
    """The value of ``--partition KEY`` or ``--partition=KEY`` in ``argv``, else None."""
    for i, arg in enumerate(argv):
        if arg == "--partition" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--partition="):
            return arg.removeprefix("--partition=")
    return None


def add_launched_partition(farm: Farm, argv: Sequence[str] | None = None) -> Path | None:
    """Add the partition ``--partition KEY`` of ``argv`` (default ``sys.argv``) names to
    ``farm``'s job files when one job file of its watched folders has that key and the
    instance of ``DAGSTER_HOME`` lacks it; return that file, or None when nothing was
    added."""
    key = partition_argument(sys.argv if argv is None else argv)
    if key is None or not os.environ.get("DAGSTER_HOME"):
        return None
    found = [
        Path(entry.path)
        for entry in iter_job_files(farm.dirs())
        if partition_key_for(Path(entry.path)) == key
    ]
    if len(found) != 1:  # none, or several (the sensor's check names them)
        return None
    name = farm.job_files_partitions_name
    with DagsterInstance.get() as instance:
        if instance.has_dynamic_partition(name, key):
            return None
        instance.add_dynamic_partitions(name, [key])
    print(
        f"comfy-assets: added partition {key} of {name} from {found[0]} (the job file "
        "sensor had not added it yet)",
        file=sys.stderr,
    )
    return found[0]
