"""The default farm's Dagster assets: ``job_files`` (with its check ``job_files_valid``),
``renders``, ``render_results``, ``all_results`` and ``films``, as
``comfy_assets.definitions`` has them.

A face: what an asset does, and how one farm's assets are built (``build_assets``), is in
``comfy_assets.farm.assets``.
"""

from comfy_assets.farm.assets import FarmAssets, build_assets
from comfy_assets.farm.names import DEFAULT_FARM

__all__ = [
    "FarmAssets",
    "all_results",
    "build_assets",
    "films",
    "job_files",
    "job_files_valid",
    "render_results",
    "renders",
]

job_files, job_files_valid, renders, render_results, all_results, films = build_assets(DEFAULT_FARM)
