"""The comfy-assets commands and the demo."""

import sys
from pathlib import Path

# A process started as `comfy-assets worker` (or `python -m comfy_assets.cli worker`: the
# package is imported while sys.argv[0] is still "-m") stops gracefully on SIGTERM from its
# first moment, before the command's imports (cli.worker_signals).
if sys.argv[1:2] == ["worker"] and (
    sys.argv[0] == "-m" or Path(sys.argv[0]).name == "comfy-assets"
):
    from comfy_assets.cli.worker_signals import hold_from_start

    hold_from_start()
