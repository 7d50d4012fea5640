"""``python -m comfy_assets.cli``: the same as ``comfy-assets``."""

from comfy_assets.cli.main import entry

entry()
