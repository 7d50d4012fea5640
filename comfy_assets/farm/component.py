"""``comfy_assets.RenderFarm``: one render farm as a Dagster component.

In a Dagster project (``create-dagster project``, ``dg``), with comfy-assets installed::

    dg scaffold defs comfy_assets.RenderFarm draft

writes ``defs/draft/defs.yaml``; its ``attributes`` are this class's fields::

    type: comfy_assets.RenderFarm
    attributes:
      servers:
        - {name: gpu0, url: "http://127.0.0.1:8188"}
      job_dirs: [jobs/draft]
      store: store/draft
      db_url: "{{ env.DRAFT_DB_URL }}"
      key_prefix: [draft]

Each instance is one farm (``comfy_assets.farm.names.Farm``) built by
``comfy_assets.farm.defs.build_farm_defs``: its own asset keys (under ``key_prefix``),
partitions, checks, sensors, render job and resources, so two instances share nothing.
Relative folders are the project root's. ``dg list components`` shows the class through
the ``dagster_dg_cli.registry_modules`` entry point of comfy-assets.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any

import dagster as dg
from dagster.components import Scaffolder, ScaffoldRequest, scaffold_component
from dagster.components.resolved.errors import ResolutionException
from pydantic import ConfigDict, Field

from comfy_assets.comfy.servers import parse_servers
from comfy_assets.farm.defs import build_farm_defs
from comfy_assets.farm.names import farm_of
from comfy_assets.farm.resources import ComfyPoolResource, ResultStoreResource, ServerConfig
from comfy_assets.jobs.model import POLICIES
from comfy_assets.store.location import store_location

# A value that is one environment variable and nothing else: ``{{ env.NAME }}``.
_ONE_VARIABLE = re.compile(r"\{\{\s*env\.([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def _secret(context: dg.ResolutionContext, raw: Any) -> Any:
    """A value that may hold a password: ``{{ env.NAME }}`` alone becomes ``EnvVar(NAME)``,
    which Dagster reads at run time and the UI shows by its name, never its value (a
    resolved URL would show with its password); anything else resolves as usual. Raises
    ResolutionException for a variable that is not set, as a template would."""
    if isinstance(raw, str):
        match = _ONE_VARIABLE.fullmatch(raw.strip())
        if match is not None:
            name = match.group(1)
            if name not in os.environ:
                raise ResolutionException(f"Environment variable {name} is not set.")
            return dg.EnvVar(name)
    return context.resolve_value(raw)


# In the YAML a string; resolved, an EnvVar or the string (kept an EnvVar: pydantic would
# turn a str subclass into a plain str).
Secret = Annotated[
    dg.EnvVar | str, dg.Resolver(_secret, model_field_type=str, inject_before_resolve=False)
]
OptionalSecret = Annotated[
    dg.EnvVar | str | None,
    dg.Resolver(_secret, model_field_type=str | None, inject_before_resolve=False),
]
# dg.Model's own settings, and EnvVar values kept as they are.
_MODEL_CONFIG = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class RenderFarmServer(dg.Resolvable, dg.Model):
    """One ComfyUI server of the farm (one GPU)."""

    model_config = _MODEL_CONFIG

    name: str = Field(description="Its name in logs, leases and tables, e.g. gpu0.")
    url: Secret = Field(
        description="Its base URL, e.g. http://10.0.0.5:8188; with user:password@ for basic "
        "auth, give it as {{ env.VAR }} alone: the UI then shows the variable's name."
    )


class RenderFarmScaffolder(Scaffolder):
    """Writes a defs.yaml for a farm named after its folder: one server on this host,
    job files in ``jobs/<name>`` (the folder made, empty), the store in ``store/<name>``,
    keys under ``<name>``."""

    def scaffold(self, request: ScaffoldRequest[Any]) -> None:
        """Write ``defs.yaml`` in ``request.target_path``, and make the job folder it names
        under the project root (a folder that does not exist fails the farm's check)."""
        name = request.target_path.name.replace("-", "_")
        if request.project_root is not None:
            (request.project_root / "jobs" / name).mkdir(parents=True, exist_ok=True)
        scaffold_component(
            request,
            {
                "servers": [{"name": "gpu0", "url": "http://127.0.0.1:8188"}],
                "job_dirs": [f"jobs/{name}"],
                "store": f"store/{name}",
                "key_prefix": [name],
            },
        )


@dg.scaffold_with(RenderFarmScaffolder)
class RenderFarm(dg.Component, dg.Resolvable, dg.Model):
    """A farm of ComfyUI servers rendering the job files of its folders, exactly once, into
    its store: the assets job_files, renders, render_results, all_results and films under
    ``key_prefix``, with their checks, sensors and render job (see comfy_assets.farm.defs)."""

    model_config = _MODEL_CONFIG

    servers: list[RenderFarmServer] = Field(
        description="The ComfyUI servers, one per GPU; at most one prompt of ours on each."
    )
    job_dirs: list[str] = Field(
        description="The folders watched for job files (*.jsonl); relative to the project root."
    )
    store: str = Field(
        description="The result store's folder (outputs, results.csv, films; the SQLite "
        "database unless db_url), relative to the project root; or s3://BUCKET/PREFIX, "
        "an object store (then db_url is required)."
    )
    db_url: OptionalSecret = Field(
        default=None,
        description="The store's database URL (postgresql+psycopg://...); None: SQLite in "
        "the store folder. With a password, give it as {{ env.VAR }} alone: the UI then "
        "shows the variable's name.",
    )
    media_url: OptionalSecret = Field(
        default=None,
        description="Where a web server of yours serves the store folder; the UI then shows "
        "pictures inline and links the film.",
    )
    # None: each job file's header decides (delivery by default).
    policy: str | None = Field(None, description="delivery or draft for every film of the farm.")
    key_prefix: list[str] = Field(
        default_factory=list,
        description="The prefix of the farm's asset keys, sensor, job and resource names "
        "(e.g. [draft]: draft/renders, draft_render_job); two farms need two prefixes.",
    )
    # None: the groups job_files, renders and films (prefixed).
    group: str | None = Field(None, description="The group of every asset of the farm.")
    sensor_interval_s: int | None = Field(
        default=None,
        description="Seconds between two looks at the job folders; None: "
        "COMFY_ASSETS_SENSOR_INTERVAL_S, else 10.",
    )
    automation_interval_s: int = Field(10, description="Seconds between two automation ticks.")

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        """The farm's definitions. Raises ValueError for a bad key prefix, interval,
        policy, server list or store (an object store without db_url)."""
        if self.policy is not None and self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not self.servers:
            raise ValueError("servers: a farm needs at least one server")
        # Checked now as `run --server` checks them; a URL read from the environment at run
        # time ({{ env.VAR }} alone) is checked when the pool is made.
        given = [f"{s.name}={s.url}" for s in self.servers if not isinstance(s.url, dg.EnvVar)]
        if given:
            try:
                parse_servers(given)
            except ValueError as e:
                raise ValueError(f"servers: {e}") from None
        root = Path(context.project_root)
        farm = farm_of(
            key_prefix=self.key_prefix,
            group=self.group,
            job_dirs=[root / folder for folder in self.job_dirs],
            sensor_interval_s=self.sensor_interval_s,
            automation_interval_s=self.automation_interval_s,
        )
        comfy = ComfyPoolResource(
            servers=[ServerConfig(name=s.name, url=s.url) for s in self.servers],
            policy=self.policy,
        )
        try:
            location = store_location(self.store)
        except ValueError as e:
            raise ValueError(f"store: {e}") from None
        if self.db_url is None and not isinstance(location, Path):
            raise ValueError(
                f"store: {self.store} is an object store: give db_url, a database every "
                "host of the farm reaches (postgresql+psycopg://...)"
            )
        folder = str(root / location) if isinstance(location, Path) else location
        store = ResultStoreResource(folder=folder, db_url=self.db_url, media_url=self.media_url)
        return build_farm_defs(farm, comfy, store)
