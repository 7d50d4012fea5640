"""The Dagster resources: the ComfyUI pool settings (``ComfyPoolResource``, a server each
``ServerConfig``) and the result store (``ResultStoreResource``); ``default_resources``
reads them from the environment (``COMFY_ASSETS_SERVERS``, ``COMFY_ASSETS_STORE``,
``COMFY_ASSETS_DB_URL``, ``COMFY_ASSETS_MEDIA_URL``).

A face: the resources and what each variable means are in ``comfy_assets.farm.resources``.
"""

from comfy_assets.farm.resources import (
    ComfyPoolResource,
    ResultStoreResource,
    ServerConfig,
    default_resources,
    env_or_default,
)

__all__ = [
    "ComfyPoolResource",
    "ResultStoreResource",
    "ServerConfig",
    "default_resources",
    "env_or_default",
]
