"""A fake ComfyUI v0.8.0 server (aiohttp) for testing comfy-assets; see fake_comfy.fake."""

from fake_comfy.fake import FakeComfy

__all__ = ["FakeComfy"]
