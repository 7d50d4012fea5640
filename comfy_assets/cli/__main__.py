"""``python -m comfy_assets.cli``: the same as ``comfy-assets``."""

import sys

from comfy_assets.cli.main import main

sys.exit(main())
