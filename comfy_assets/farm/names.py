"""One render farm's names and places in Dagster: its asset keys, partitions, sensors,
job, resource keys, groups and watched folders.

Every Dagster object of comfy-assets is built from a ``Farm`` (``build_farm_defs``), so
two farms in one code location (a draft pool and a final pool, two ``RenderFarm``
components) have their own asset keys, partitions definitions, checks, sensors, job and
resources, and share nothing. The default farm (no key prefix) has the names of
``comfy_assets.definitions``: ``renders``, ``job_files``, ``render_job``,
``job_file_sensor``, the resources ``comfy`` and ``result_store``; a farm with key
prefix ``["draft"]`` has ``draft/renders``, the partitions ``draft_job_files``, the job
``draft_render_job``, the sensor ``draft_job_file_sensor``, the resources
``draft_comfy`` and ``draft_result_store``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dagster import AssetKey, DynamicPartitionsDefinition

from comfy_assets.farm.partitions import (
    JOB_FILES_ASSET,
    job_dirs_from_env,
    job_files_partitions,
    storyboard_partitions,
)

# A key prefix part: what Dagster accepts in an asset key and a name (sensor, job).
_PART = re.compile(r"[A-Za-z0-9_]+")


@dataclass(frozen=True)
class Farm:
    """One farm's names. ``key_prefix``: the asset keys' prefix (``()``: none, the names
    of ``comfy_assets.definitions``); each part letters, digits and ``_``. ``group``:
    the group of every asset (None: ``job_files``, ``renders`` and ``films``, prefixed).
    ``job_dirs``: the watched folders (None: ``COMFY_ASSETS_JOB_DIRS``, read when used).
    ``sensor_interval_s``: job_file_sensor's minimum interval (None: the environment's,
    ``COMFY_ASSETS_SENSOR_INTERVAL_S``); ``automation_interval_s``: the automation
    sensors'. Raises ValueError for a key prefix part Dagster would refuse."""

    key_prefix: tuple[str, ...] = ()
    group: str | None = None
    job_dirs: tuple[Path, ...] | None = None
    sensor_interval_s: int | None = None
    automation_interval_s: int = 10

    def __post_init__(self) -> None:
        for part in self.key_prefix:
            if not _PART.fullmatch(part):
                raise ValueError(
                    f"key_prefix: {part!r} is not a name of letters, digits and _ "
                    "(what Dagster accepts in asset keys, sensor and job names)"
                )
        for name, value in (
            ("sensor_interval_s", self.sensor_interval_s),
            ("automation_interval_s", self.automation_interval_s),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name}: expected a whole number of seconds >= 1, got {value}")

    @property
    def prefix(self) -> str:
        """What this farm's names start with: ``""``, or ``draft_`` for ``["draft"]``."""
        return "".join(f"{part}_" for part in self.key_prefix)

    def key(self, name: str) -> AssetKey:
        """The asset key of ``name`` (``renders``, ``films``, ...) in this farm."""
        return AssetKey([*self.key_prefix, name])

    def name(self, name: str) -> str:
        """A sensor's, job's, op's or resource's name in this farm."""
        return f"{self.prefix}{name}"

    def group_of(self, name: str) -> str:
        """The group of this farm's assets that would be in group ``name``."""
        return self.group if self.group is not None else self.name(name)

    @property
    def comfy_key(self) -> str:
        """The resource key of this farm's ComfyPoolResource."""
        return self.name("comfy")

    @property
    def store_key(self) -> str:
        """The resource key of this farm's ResultStoreResource."""
        return self.name("result_store")

    @functools.cached_property
    def job_files_partitions(self) -> DynamicPartitionsDefinition:
        """A partition per job file of the watched folders."""
        return self._partitions(job_files_partitions)

    @functools.cached_property
    def storyboard_partitions(self) -> DynamicPartitionsDefinition:
        """A partition per job file whose jobs have shot numbers: the films'."""
        return self._partitions(storyboard_partitions)

    def _partitions(self, default: DynamicPartitionsDefinition) -> DynamicPartitionsDefinition:
        """``default`` (``farm/partitions.py``) in the default farm; in a prefixed farm, its
        own dynamic partitions, named as ``default`` in this farm."""
        if not self.key_prefix:
            return default
        return DynamicPartitionsDefinition(name=self.name(_named(default)))

    @property
    def job_files_partitions_name(self) -> str:
        """The name of ``job_files_partitions`` (the instance's dynamic partitions)."""
        return _named(self.job_files_partitions)

    @property
    def storyboard_partitions_name(self) -> str:
        """The name of ``storyboard_partitions``."""
        return _named(self.storyboard_partitions)

    @property
    def job_files_key(self) -> AssetKey:
        """The key of the job files' asset (upstream of renders)."""
        return self.key(JOB_FILES_ASSET)

    def dirs(self) -> list[Path]:
        """The watched folders now."""
        return list(self.job_dirs) if self.job_dirs is not None else job_dirs_from_env()


def _named(partitions: DynamicPartitionsDefinition) -> str:
    """The name of ``partitions``: a farm's are all named (Dagster types it optional)."""
    if partitions.name is None:
        raise ValueError("a farm's dynamic partitions definition has no name")
    return partitions.name


DEFAULT_FARM = Farm()


def farm_of(
    key_prefix: Sequence[str] = (),
    group: str | None = None,
    job_dirs: Sequence[str | Path] | None = None,
    sensor_interval_s: int | None = None,
    automation_interval_s: int = 10,
) -> Farm:
    """A Farm from plain values (lists, strings), as a component's attributes give them."""
    return Farm(
        key_prefix=tuple(key_prefix),
        group=group,
        job_dirs=None if job_dirs is None else tuple(Path(d) for d in job_dirs),
        sensor_interval_s=sensor_interval_s,
        automation_interval_s=automation_interval_s,
    )
