"""Facts copied from the recordings of a real ComfyUI v0.8.0 (data/recorded/*.json).

The JSON files beside this package (`fake_comfy/data/`) hold the long fragments verbatim:
`object_info.json` (the /object_info subset of basics.json, plus LoadVideo,
GetVideoComponents, ImageFromBatch and RepeatImageBatch as v0.8.0's source
defines them: comfy_api/latest/_io.py get_v1_info of comfy_extras/nodes_video.py and
nodes_images.py at fc0cb10b), `model_nodes.json` (the model
loaders and the upscale node, written from the v0.8.0 source's INPUT_TYPES and schemas as
server.py `node_info` shows them, with empty file lists: not recorded, the recording
server had no models) and `recorded_fragments.json`
(system_stats, the IndexError of execution_error.json, the node error of a dropped output
from validation_errors.json, the OSError of full_disk.json). Short strings live here as constants.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path
from typing import Any

_DATA = Path(__file__).with_name("data")

# validation_errors.json, "body is not JSON": aiohttp's page for an unhandled exception.
TEXT_500 = "500 Internal Server Error\n\nServer got itself in trouble"

# ComfyUI's tip appended to an OOM's message (execution.py, README fact 9); it cannot be
# recorded on a CPU, so the `oom` word synthesises the message around it.
OOM_TIPS = (
    "This error means you ran out of memory on your GPU.\n\n"
    "TIPS: If the workflow worked before you might have accidentally set the batch_size "
    "to a large number."
)
OOM_EXCEPTION_TYPE = "torch.OutOfMemoryError"
OOM_TORCH_MESSAGE = (
    "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
    "Currently allocated     : 21.73 GiB\n"
    "Requested               : 3.00 GiB\n"
    "Device limit            : 23.52 GiB\n"
    "Free (according to CUDA): 18.44 MiB\n"
    "PyTorch limit (set by user-supplied memory fraction)\n"
    "                        : 17179869184.00 GiB"
)
OOM_TRACEBACK_TAIL = [
    '  File "/opt/ComfyUI/comfy/model_management.py", line 1172, in cast_to\n'
    "    r = torch.empty_like(weight, dtype=dtype, device=device)\n"
    "        ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
]

# A CUDA fault as PyTorch 2.8+ raises it (c10/cuda/CUDAException.h; not recordable on a
# CPU): the `cuda` word. ComfyUI writes full_type_name of the class and "{ex}\n{tips}".
CUDA_EXCEPTION_TYPE = "torch.AcceleratorError"
CUDA_MESSAGE = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n"
)

# Messages of _validate_prompt (validation_errors.json).
MSG_FAILED_VALIDATION = "Prompt outputs failed validation"
MSG_NO_OUTPUTS = "Prompt has no outputs"
MSG_NO_PROMPT = "No prompt provided"


@cache
def _object_info() -> dict[str, Any]:
    with (_DATA / "object_info.json").open(encoding="utf-8") as f:
        info = json.load(f)
    # The model loaders, and SaveImageWebsocket: the model-free node of ComfyUI's
    # custom_nodes/ that reports a step per image (progress.json).
    for extra in ("model_nodes.json", "custom_nodes.json"):
        with (_DATA / extra).open(encoding="utf-8") as f:
            for name, node in json.load(f).items():
                info.setdefault(name, node)
    return info


@cache
def _fragments() -> dict[str, Any]:
    with (_DATA / "recorded_fragments.json").open(encoding="utf-8") as f:
        return json.load(f)


def object_info() -> dict[str, Any]:
    """The /object_info subset: {class_type: node definition} (basics.json; see the
    module docstring), and the model loaders of model_nodes.json (their file lists
    empty). The file combos of LoadImage and LoadVideo are empty here: the server lists
    its input folder in them (fake_comfy.inputs).

    Shared and cached: callers must not mutate it.
    """
    return _object_info()


def system_stats() -> dict[str, Any]:
    """A fresh copy of the recorded /system_stats body (basics.json)."""
    return copy.deepcopy(_fragments()["system_stats"])


def index_error() -> dict[str, Any]:
    """`exception_message`, `exception_type`, `traceback` of the recorded IndexError
    (execution_error.json, ImageToMask with channel alpha on an RGB image)."""
    return copy.deepcopy(_fragments()["index_error"])


def full_disk_error() -> dict[str, Any]:
    """`exception_message`, `exception_type`, `traceback` of the recorded full output
    disk (full_disk.json: OSError "[Errno 28] No space left on device" in SaveImage)."""
    return copy.deepcopy(_fragments()["full_disk_error"])


def tensor_repr() -> str:
    """How ComfyUI printed a linked IMAGE input in `current_inputs` (execution_error.json)."""
    return _fragments()["index_error_tensor_repr"]


def partial_node_error() -> dict[str, Any]:
    """The error of an output dropped from a 200 answer (validation_errors.json,
    "link to a missing node"): `exception_during_validation` with a KeyError."""
    return copy.deepcopy(_fragments()["partial_node_error"])
