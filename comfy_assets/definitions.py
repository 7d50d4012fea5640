"""The Dagster definitions of comfy-assets (``workspace.yaml``, ``[tool.dagster]``,
``[tool.dg]``): one render farm, the default one (``comfy_assets.farm.names.DEFAULT_FARM``: no
key prefix), configured by the environment (``comfy_assets.resources``:
``COMFY_ASSETS_SERVERS``, ``COMFY_ASSETS_STORE``, ``COMFY_ASSETS_DB_URL``,
``COMFY_ASSETS_MEDIA_URL``, ``COMFY_ASSETS_JOB_DIRS``). What the farm holds is in
``comfy_assets.farm.defs``; a project of yours takes one farm or more as ``RenderFarm``
components instead (``comfy_assets.farm.component``).
"""

from __future__ import annotations

from comfy_assets import assets
from comfy_assets.farm.defs import build_farm_defs
from comfy_assets.farm.names import DEFAULT_FARM
from comfy_assets.resources import default_resources

_resources = default_resources()
defs = build_farm_defs(
    DEFAULT_FARM,
    comfy=_resources["comfy"],
    result_store=_resources["result_store"],
    # The module's own objects, which tests and callers import from comfy_assets.assets.
    assets=assets.FarmAssets(
        assets.job_files,
        assets.job_files_valid,
        assets.renders,
        assets.render_results,
        assets.all_results,
        assets.films,
    ),
)
