"""Execution errors that belong to the server, not to the prompt: the one list.

ComfyUI v0.8.0 reports any exception a node raises as an ordinary ``execution_error``
(``execution.py``, ``execute``: ``exception_type`` is ``full_type_name`` of the class,
``module.QualName`` or a bare builtin name; ``exception_message`` is ``"{ex}\\n{tips}"``).
Nothing in the message says whose fault it was; the causes below say it at first sight,
because the same prompt on another host does not raise them: the GPU, its driver, the
output disk or a node pack of that host is broken. Each entry names its source.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InfraCause:
    """One cause: ``name`` for people, ``types`` the exception types it comes as (empty:
    any type), ``pattern`` searched in the message (case-insensitive; None: the type
    alone decides), ``source`` where the shape comes from."""

    name: str
    types: frozenset[str]
    pattern: re.Pattern[str] | None
    source: str


def _cause(name: str, types: tuple[str, ...], pattern: str | None, source: str) -> InfraCause:
    compiled = re.compile(pattern, re.IGNORECASE) if pattern is not None else None
    return InfraCause(name, frozenset(types), compiled, source)


_OS_ERRORS = ("OSError", "PermissionError", "IOError")

INFRA_CAUSES: tuple[InfraCause, ...] = (
    _cause(
        "CUDA error",
        (),
        r"\bCUDA error\b|CUDA driver|CUDA-capable device|cudaErrorIllegalAddress"
        r"|illegal memory access",
        # torch raises RuntimeError (torch.AcceleratorError from 2.8) with
        # "CUDA error: an illegal memory access was encountered" (c10/cuda/CUDAException.h);
        # the context is unusable until the process restarts.
        "PyTorch c10/cuda/CUDAException.h (C10_CUDA_CHECK message)",
    ),
    _cause(
        "accelerator error",
        ("torch.AcceleratorError",),
        None,
        "PyTorch 2.8 torch.AcceleratorError (raised for CUDA/XPU runtime errors)",
    ),
    _cause(
        "device-side assert",
        (),
        r"device-side assert",
        "PyTorch: 'device-side assert triggered' (TORCH_USE_CUDA_DSA)",
    ),
    _cause("cuDNN error", (), r"\bcuDNN error\b|CUDNN_STATUS_", "PyTorch ATen cudnn/Exceptions.h"),
    _cause("cuBLAS error", (), r"\bCUBLAS_STATUS_", "PyTorch ATen cuda/CUDABlas.cpp"),
    _cause("NCCL error", (), r"\bNCCL error\b|ncclUnhandledCudaError", "PyTorch ProcessGroupNCCL"),
    _cause("ECC error", (), r"\bECC error\b", "CUDA: 'uncorrectable ECC error encountered'"),
    _cause(
        "output disk full",
        _OS_ERRORS,
        r"\[Errno 28\]|No space left on device",
        "recorded: comfyui-recorded/v0.8.0/full_disk.json (OSError, [Errno 28])",
    ),
    _cause(
        "output disk read-only",
        _OS_ERRORS,
        r"\[Errno 30\]|Read-only file system",
        "POSIX EROFS as Python words it: OSError '[Errno 30] Read-only file system'",
    ),
    _cause(
        "output not writable",
        _OS_ERRORS,
        r"\[Errno 13\]|Permission denied",
        "POSIX EACCES as Python words it: PermissionError '[Errno 13] Permission denied'",
    ),
    _cause(
        "node pack fails to import",
        ("ImportError", "ModuleNotFoundError"),
        None,
        "a node listed in /object_info whose code imports a module the host lacks "
        "(execution.py reports the ImportError as an execution_error)",
    ),
)


def infra_cause(
    exception_type: str, exception_message: str, prompt_text: Collection[str] = ()
) -> InfraCause | None:
    """The cause in ``INFRA_CAUSES`` that an execution_error's ``exception_type`` and
    ``exception_message`` match (ComfyUI's fields, as in execution_error.json), or None
    when the error may be the prompt's. An out-of-memory error is not here: it is the
    prompt's size on that GPU (``ExecutionError.is_oom``).

    ``prompt_text``: the strings the prompt itself carries (``prompt_strings``). ComfyUI
    copies inputs into its messages (SaveImage's refusal of a ``filename_prefix`` outside
    the output folder names the folder; an OSError names the file), so a match that one
    of them holds too (digits aside: a prefix's ``%height%`` becomes a number) is no
    evidence against the server: a job could otherwise quarantine every server it meets
    by naming a file "CUDA error" or "[Errno 2%height%]"."""
    message = exception_message or ""
    for cause in INFRA_CAUSES:
        if cause.types and exception_type not in cause.types:
            continue
        if cause.pattern is None:
            return cause
        for match in cause.pattern.finditer(message):
            found = _canonical(match.group(0))
            if not any(found in text for text in prompt_text):
                return cause
    return None


# The variables a save node's filename_prefix may hold, each replaced by a number before
# the file is named (v0.8.0 folder_paths.py, get_save_image_path's compute_vars).
_SAVE_VARS = re.compile(r"%(?:width|height|year|month|day|hour|minute|second)%", re.IGNORECASE)
_DIGITS = re.compile(r"[0-9]+")


def _canonical(text: str) -> str:
    """``text`` lowercased, each run of digits one "0": a prompt's ``[Errno 2%height%]``
    and the ``[Errno 28]`` it becomes compare equal."""
    return _DIGITS.sub("0", text.lower())


def prompt_strings(workflow: Mapping[str, Any]) -> list[str]:
    """Every string value among an API-format workflow's node inputs (the values a job's
    ``set`` and inputs give it included), for ``infra_cause``: lowercased, a save node's
    variables (``%height%``, ...) taken for the numbers they become, each run of digits
    one "0"."""
    found: list[str] = []
    stack: list[Any] = [node.get("inputs") for node in workflow.values() if isinstance(node, dict)]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            found.append(_canonical(_SAVE_VARS.sub("0", value)))
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return found
