"""Dagster resources: the ComfyUI pool settings and the result store.

One deployment differs from another by environment only:

- ``COMFY_ASSETS_SERVERS``: the pool, ``name=url`` pairs separated by commas
  (default ``gpu0=http://127.0.0.1:8188,gpu1=http://127.0.0.1:8189``).
- ``COMFY_ASSETS_STORE``: the result store's folder (default ``store``), or
  ``s3://BUCKET/PREFIX`` (an object store: ``COMFY_ASSETS_DB_URL`` is then required).
- ``COMFY_ASSETS_DB_URL``: the store's database URL (default: SQLite inside the folder).
- ``COMFY_ASSETS_MEDIA_URL``: where the store's folder is served over HTTP, if it is
  (``make demo`` serves it); the UI then shows the pictures inline and links the film.

When a variable is set, :func:`env_or_default` passes it as an ``EnvVar`` (the UI shows
the variable's name, not its value); when unset, the default is a plain value, because an
``EnvVar`` has no default and fails when its variable is missing. So a server URL with
``user:password@`` (sent as basic auth, shown nowhere: ``comfy.servers``) or a database
URL with a password belongs in the environment, not in Python or run config, which the
UI shows as written.
"""

import dataclasses
import os
from pathlib import Path
from typing import Any, TypedDict, overload

from dagster import Config, ConfigurableResource, EnvVar
from pydantic import Field

from comfy_assets.comfy.servers import ServerSpec, parse_servers
from comfy_assets.render.config import KNOBS, BatchConfig, knob_doc
from comfy_assets.store import DB_URL_ENV, NoLocalFolder, Store
from comfy_assets.store.location import local_folder

SERVERS_ENV = "COMFY_ASSETS_SERVERS"
STORE_ENV = "COMFY_ASSETS_STORE"
MEDIA_URL_ENV = "COMFY_ASSETS_MEDIA_URL"
DEFAULT_SERVERS = "gpu0=http://127.0.0.1:8188,gpu1=http://127.0.0.1:8189"
DEFAULT_STORE = "store"


def _knob(name: str) -> Any:
    """A config field with BatchConfig's default and description for its knob ``name``."""
    return Field(default=KNOBS[name].default, description=knob_doc(name))


@overload
def env_or_default(name: str, default: str) -> str: ...
@overload
def env_or_default(name: str, default: None) -> str | None: ...
def env_or_default(name: str, default: str | None) -> str | None:
    """Return ``EnvVar(name)`` when the variable is set, else ``default``."""
    return EnvVar(name) if name in os.environ else default


class ServerConfig(Config):
    """One ComfyUI server of the pool."""

    name: str = Field(description="The server's name in logs and tables, e.g. gpu0.")
    url: str = Field(description="Its base URL, e.g. http://127.0.0.1:8188.")


class ComfyPoolResource(ConfigurableResource):
    """The ComfyUI servers to render on and how hard to try (see ``BatchConfig``).

    The pool is ``servers`` when given (a list, set in Python or run config), else
    ``servers_spec`` parsed by ``parse_servers``. ``servers_spec`` exists because a list
    field can't take an ``EnvVar``: set it from ``COMFY_ASSETS_SERVERS``.
    """

    servers_spec: str = Field(
        default=DEFAULT_SERVERS,
        description="name=url pairs separated by commas, e.g. gpu0=http://host:8188",
    )
    servers: list[ServerConfig] = Field(
        default_factory=list, description="The pool as a list; overrides servers_spec."
    )
    # Defaults and descriptions are BatchConfig's own, so the CLI, the worker and Dagster
    # agree.
    attempts: int = _knob("attempts")
    base_delay_s: float = _knob("base_delay_s")
    max_delay_s: float = _knob("max_delay_s")
    jitter: bool = _knob("jitter")
    timeout_s: float = _knob("timeout_s")
    stall_factor: float | None = _knob("stall_factor")
    wedge_s: float = _knob("wedge_s")
    poll_s: float = _knob("poll_s")
    lease_s: float = _knob("lease_s")
    server_lease_s: float = _knob("server_lease_s")
    max_queue: int | None = _knob("max_queue")
    probe_timeout_s: float = _knob("probe_timeout_s")
    unhealthy_wait_s: float = _knob("unhealthy_wait_s")
    catch_up_s: float = _knob("catch_up_s")
    files_wait_s: float = _knob("files_wait_s")
    unreachable_timeout_s: float | None = _knob("unreachable_timeout_s")
    no_server_retries: int = Field(
        default=2,
        description="How many times a render stopped by unreachable_timeout_s is tried "
        "again (a minute apart) before its step fails.",
    )
    max_output_bytes: int = _knob("max_output_bytes")
    policy: str | None = _knob("policy")

    def server_specs(self) -> list[ServerSpec]:
        """Return the pool's servers."""
        if self.servers:
            return [ServerSpec(name=server.name, url=server.url) for server in self.servers]
        return parse_servers(self.servers_spec)

    def batch_config(self) -> BatchConfig:
        """Return the retry, timeout and lease settings for ``run_batch_sync``."""
        return BatchConfig(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(BatchConfig)}
        )


class ResultStoreResource(ConfigurableResource):
    """Where job states, outputs, results CSVs and dead letters are written."""

    folder: str = Field(
        default=DEFAULT_STORE,
        description="The store's folder, or s3://BUCKET/PREFIX (an object store; then "
        "db_url is required).",
    )
    db_url: str | None = Field(
        default=None, description="Database URL; None means SQLite inside the folder."
    )
    media_url: str | None = Field(
        default=None,
        description="The URL the store's folder is served at over HTTP (a web server "
        "of yours, read-only), e.g. http://media.internal/store; with it the UI shows "
        "each partition's pictures inline and links the film. None: pictures are "
        "thumbnails behind [Show Markdown], files are paths.",
    )

    @property
    def root(self) -> Path:
        """The store's folder as a path. Raises NoLocalFolder for an object store."""
        folder = local_folder(self.folder)
        if folder is None:
            raise NoLocalFolder(f"the store {self.folder} has no folder on this machine")
        return folder

    def open(self, *, retry_s: float | None = None) -> Store:
        """Open the store (a new connection pool; close it when done). ``retry_s``: how
        long a call waits out a database outage (``Store``'s default when None). Raises
        NoDatabase for an object store without ``db_url``."""
        if retry_s is None:
            return Store(self.folder, db_url=self.db_url)
        return Store(self.folder, db_url=self.db_url, retry_s=retry_s)


class DefaultResources(TypedDict):
    """``default_resources``: one farm's resources by their keys."""

    comfy: ComfyPoolResource
    result_store: ResultStoreResource


def default_resources() -> DefaultResources:
    """Resources configured from the environment (see the module docstring)."""
    return {
        "comfy": ComfyPoolResource(servers_spec=env_or_default(SERVERS_ENV, DEFAULT_SERVERS)),
        "result_store": ResultStoreResource(
            folder=env_or_default(STORE_ENV, DEFAULT_STORE),
            db_url=env_or_default(DB_URL_ENV, None),
            media_url=env_or_default(MEDIA_URL_ENV, None),
        ),
    }
