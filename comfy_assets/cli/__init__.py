"""The comfy-assets commands and the demo."""
