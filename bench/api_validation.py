"""What checking a ``POST /v1/jobs`` body against its model (``api/models.py``,
pydantic) costs beside the rest of its validation (the job-file parser, the inputs
decoded and hashed): microseconds per body, for a small job and one with a 1 MiB input.
Prints ``small_model_us``, ``small_validation_us`` (the model's check included),
``large_model_us`` and ``large_validation_us``.

```text
.venv/bin/python bench/api_validation.py [--repeat 2000]
```
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comfy_assets.api.submission import model_problems, parse_submission

WORKFLOW = json.loads((Path(__file__).parent.parent / "data/workflows/image.json").read_text())


def _per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    picture = base64.b64encode(os.urandom(1024**2)).decode()
    small = {"id": str(uuid.uuid4()), "workflow": copy.deepcopy(WORKFLOW), "set": {"1.color": 1}}
    large = {**small, "set": {}, "inputs": {"1.width": f"data:image/png;base64,{picture}"}}
    for name, body, repeat in (
        ("small", small, args.repeat),
        ("large", large, max(1, args.repeat // 100)),
    ):
        model_us = _per_call_us(lambda body=body: model_problems(body), repeat)
        whole_us = _per_call_us(
            lambda body=body: parse_submission(
                body, partition="bench", max_input_bytes=2 * 1024**2, max_message_bytes=4 * 1024**2
            ),
            repeat,
        )
        print(f"{name}_model_us={model_us:.1f}")
        print(f"{name}_validation_us={whole_us:.1f}")


if __name__ == "__main__":
    main()
