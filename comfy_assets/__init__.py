"""comfy-assets: ComfyUI as a production batch-rendering service orchestrated by Dagster.

``comfy_assets.RenderFarm`` is the Dagster component (``comfy_assets.farm.component``),
imported on first use so the command line does not load Dagster.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RenderFarm"]


def __getattr__(name: str) -> Any:
    if name == "RenderFarm":
        from comfy_assets.farm.component import RenderFarm

        return RenderFarm
    raise AttributeError(f"module 'comfy_assets' has no attribute {name!r}")


def __dir__() -> list[str]:
    # dg lists a registry module's components by dir() and getattr().
    return sorted([*globals(), "RenderFarm"])
