"""Job files: JSONL, one job a line, validated whole before anything is submitted.

A line::

    {"id": "<lowercase UUID>", "workflow": "wf.json" | {...API format...},
     "set": {"<node id>.<input name>": value}, "shot": 3, "duration_s": 4.0, "optional": false}

An optional first non-blank line ``{"header": {"policy": "delivery" | "draft",
"duration_tolerance": 0.1}}`` sets the film policy. Unknown fields are errors, so a typo
never passes silently. Every bad line is reported at once (``JobFileError``).

Each job gets an idempotency key: ``prompt_id = uuid5(NAMESPACE, f"{id}:{workflow_sha256}")``
where ``workflow_sha256`` hashes the canonical JSON of the resolved workflow. The same job
with the same inputs always gets the same prompt_id; any changed input gives a new one.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

# Fixed forever: changing it changes every prompt_id and so re-renders everything.
NAMESPACE = uuid.UUID("d20cb511-11c0-5807-a7e6-7f81477668c7")

Policy = Literal["delivery", "draft"]
POLICIES: tuple[str, ...] = ("delivery", "draft")
JOB_FIELDS = frozenset({"id", "workflow", "set", "shot", "duration_s", "optional"})
HEADER_FIELDS = frozenset({"policy", "duration_tolerance"})
# Loader inputs that name a model file; "clip_name1" (DualCLIPLoader) counts as clip_name.
MODEL_INPUTS = frozenset(
    {
        "ckpt_name",
        "unet_name",
        "lora_name",
        "vae_name",
        "clip_name",
        "control_net_name",
        "model_name",
    }
)

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_UI_MESSAGE = "is a UI workflow, not API format (export it with 'Export (API)')"


@dataclass(frozen=True)
class LineError:
    """One problem in a job file: ``path:line: field: message`` (line is 1-based)."""

    path: str
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.field}: {self.message}"


class JobFileError(ValueError):
    """A job file (or a queued job) was rejected; ``errors`` lists every problem found.

    ``str()`` gives all of them, one ``path:line: field: message`` per line.
    """

    def __init__(self, errors: list[LineError]) -> None:
        self.errors = list(errors)
        super().__init__("\n".join(str(e) for e in self.errors))


@dataclass(frozen=True)
class Header:
    """Film policy of a job file. ``duration_tolerance`` is a fraction (0.1 = 10 %)."""

    policy: Policy = "delivery"
    duration_tolerance: float = 0.1


@dataclass(frozen=True)
class Job:
    """One validated job.

    ``workflow`` is the resolved API-format workflow (this job's own deep copy, ``set``
    applied); ``workflow_sha256`` hashes its canonical JSON; ``prompt_id`` is the
    idempotency key sent to ComfyUI. ``line`` is the 1-based line in its file (or the
    position given by the queue). ``duration_s`` is expected seconds of video output.
    ``models`` are the sorted unique model file names the workflow loads (for affinity).
    """

    id: str
    line: int
    workflow: dict[str, Any] = field(compare=False, repr=False)
    workflow_sha256: str
    prompt_id: str
    set: dict[str, Any] = field(compare=False)
    shot: int | None = None
    duration_s: float | None = None
    optional: bool = False
    models: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobFile:
    """A loaded job file: ``sha256`` of its bytes, its header and its jobs in line order."""

    path: Path
    sha256: str
    header: Header
    jobs: list[Job]

    @property
    def policy(self) -> Policy:
        """The film policy: "delivery" (every shot required) or "draft"."""
        return self.header.policy


def canonical_json(obj: Any) -> str:
    """The JSON text that is hashed: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def prompt_id_for(job_id: str, workflow_sha256: str) -> str:
    """The idempotency key of ``job_id`` with that resolved workflow (lowercase UUID)."""
    return str(uuid.uuid5(NAMESPACE, f"{job_id}:{workflow_sha256}"))


def load_job_file(path: Path) -> JobFile:
    """Read and validate the JSONL job file at ``path``.

    Workflow paths are relative to the job file's folder; each file is read once.
    Raises ``JobFileError`` listing every bad line (nothing is returned for a partly
    valid file), including a missing or unreadable file (line 0, field "file").
    """
    path = Path(path)
    where = str(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise JobFileError([LineError(where, 0, "file", f"cannot read: {e.strerror}")]) from e
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise JobFileError([LineError(where, 0, "file", f"not UTF-8: {e.reason}")]) from e

    parser = _Parser(where, path.parent, _WorkflowCache())
    header = Header()
    seen_ids: dict[str, int] = {}
    jobs: list[Job] = []
    first = True
    # split("\n"), not splitlines(): JSON strings may hold U+2028 and friends.
    for number, raw in enumerate(text.split("\n"), start=1):
        raw = raw.strip()
        if not raw:
            continue
        obj = parser.parse_line(raw, number)
        if isinstance(obj, dict) and "header" in obj:
            if first:
                header = parser.header(obj, number) or header
            else:
                parser.error(number, "header", "the header must be the first non-blank line")
            first = False
            continue
        first = False
        if obj is None:
            continue
        job = parser.job(obj, number)
        job_id = obj.get("id")
        if isinstance(job_id, str):
            if job_id in seen_ids:
                parser.error(number, "id", f"{job_id} repeated; first on line {seen_ids[job_id]}")
            else:
                seen_ids[job_id] = number
        if job is not None:
            jobs.append(job)
    if parser.errors:
        raise JobFileError(parser.errors)
    return JobFile(path=path, sha256=hashlib.sha256(data).hexdigest(), header=header, jobs=jobs)


def job_from_dict(obj: Any, *, base_dir: Path, source: str, line: int = 1) -> Job:
    """Validate one job that did not come from a file (a queue message, say).

    ``obj`` has the fields of one job line; workflow paths are relative to ``base_dir``;
    ``source`` and ``line`` name the origin in errors. Raises ``JobFileError`` listing
    this job's problems.
    """
    parser = _Parser(source, Path(base_dir), _WorkflowCache())
    if not isinstance(obj, dict):
        parser.error(line, "job", f"expected a JSON object, got {_kind(obj)}")
    else:
        job = parser.job(obj, line)
        if job is not None and not parser.errors:
            return job
    raise JobFileError(parser.errors)


# --- internals ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Workflow:
    """A validated API-format workflow: its canonical text (for cheap deep copies)."""

    text: str


class _WorkflowCache:
    """Workflow files read once per load: 10,000 jobs sharing a file parse it once."""

    def __init__(self) -> None:
        # Keyed by the raw string: building a Path per line costs more than the rest.
        self._by_spec: dict[tuple[Path, str], _Workflow | str] = {}

    def get(self, base_dir: Path, spec: str) -> _Workflow | str:
        """The workflow at ``base_dir / spec`` or an error message."""
        key = (base_dir, spec)
        found = self._by_spec.get(key)
        if found is None:
            found = self._by_spec[key] = self._load(base_dir / spec)
        return found

    @staticmethod
    def _load(path: Path) -> _Workflow | str:
        try:
            raw = path.read_text(encoding="utf-8-sig")
        except FileNotFoundError:
            return f"workflow file not found: {path}"
        except (OSError, UnicodeDecodeError) as e:
            return f"cannot read workflow file {path}: {e}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            return f"workflow file {path} is not JSON: {e.msg} at line {e.lineno}"
        problem = _api_format_problem(obj)
        if problem:
            return f"workflow file {path} {problem}"
        return _Workflow(canonical_json(obj))


def _api_format_problem(obj: Any) -> str | None:
    """Why ``obj`` is not an API-format workflow, or None if it is."""
    if not isinstance(obj, dict):
        return f"is not API format: expected a JSON object of nodes, got {_kind(obj)}"
    if "nodes" in obj and "links" in obj:
        return _UI_MESSAGE
    if not obj:
        return "is not API format: it has no nodes"
    for node_id, node in obj.items():
        if not isinstance(node, dict):
            return f"is not API format: node {node_id!r} is {_kind(node)}, not an object"
        if not isinstance(node.get("class_type"), str):
            return f"is not API format: node {node_id!r} has no class_type"
        if not isinstance(node.get("inputs"), dict):
            return f"is not API format: node {node_id!r} has no inputs object"
    return None


def _is_link(value: Any) -> bool:
    """ComfyUI's API format writes a link as ``["<node id>", <output index>]``."""
    return (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
    )


def _kind(value: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of two equal keys; a repeated "set" key is a typo to report.
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


_decoder = json.JSONDecoder(object_pairs_hook=_no_duplicates)


def _models(workflow: Mapping[str, Any]) -> tuple[str, ...]:
    names: set[str] = set()
    for node in workflow.values():
        for name, value in node["inputs"].items():
            if isinstance(value, str) and name.rstrip("0123456789") in MODEL_INPUTS:
                names.add(value)
    return tuple(sorted(names))


class _Parser:
    """Validates lines of one source, collecting every error instead of stopping."""

    def __init__(self, source: str, base_dir: Path, cache: _WorkflowCache) -> None:
        self.source = source
        self.base_dir = base_dir
        self.cache = cache
        self.errors: list[LineError] = []

    def error(self, line: int, name: str, message: str) -> None:
        self.errors.append(LineError(self.source, line, name, message))

    def parse_line(self, raw: str, line: int) -> dict[str, Any] | None:
        try:
            obj = _decoder.decode(raw)
        except _DuplicateKey as e:
            self.error(line, str(e), "key repeated in this line")
            return None
        except json.JSONDecodeError as e:
            self.error(line, "json", f"not JSON: {e.msg} at column {e.colno}")
            return None
        if not isinstance(obj, dict):
            self.error(line, "json", f"expected a JSON object, got {_kind(obj)}")
            return None
        return obj

    def header(self, obj: dict[str, Any], line: int) -> Header | None:
        errors_before = len(self.errors)
        for key in obj:
            if key != "header":
                self.error(line, key, "unknown field in the header line (only 'header')")
        body = obj["header"]
        if not isinstance(body, dict):
            self.error(line, "header", f"expected an object, got {_kind(body)}")
            return None
        self._unknown_fields(body, HEADER_FIELDS, line, prefix="header.")
        policy = body.get("policy", "delivery")
        if policy not in POLICIES:
            self.error(line, "header.policy", f"expected 'delivery' or 'draft', got {policy!r}")
        tolerance = body.get("duration_tolerance", 0.1)
        if not _is_number(tolerance) or not 0 <= tolerance <= 1:
            self.error(
                line,
                "header.duration_tolerance",
                f"expected a fraction from 0 to 1, got {tolerance!r}",
            )
        if len(self.errors) > errors_before:
            return None
        return Header(policy=policy, duration_tolerance=float(tolerance))

    def job(self, obj: dict[str, Any], line: int) -> Job | None:
        """A Job from one parsed line, or None after recording its errors."""
        errors_before = len(self.errors)
        self._unknown_fields(obj, JOB_FIELDS, line)
        job_id = self._job_id(obj, line)
        shot = obj.get("shot")
        if shot is not None and (not isinstance(shot, int) or isinstance(shot, bool) or shot < 0):
            self.error(line, "shot", f"expected an integer >= 0, got {shot!r}")
        duration = obj.get("duration_s")
        if duration is not None and not (_is_number(duration) and duration > 0):
            self.error(line, "duration_s", f"expected a number of seconds > 0, got {duration!r}")
        optional = obj.get("optional", False)
        if not isinstance(optional, bool):
            self.error(line, "optional", f"expected true or false, got {optional!r}")
        overrides = obj.get("set", {})
        if not isinstance(overrides, dict):
            self.error(line, "set", f"expected an object, got {_kind(overrides)}")
            overrides = {}
        workflow = self._workflow(obj, line)
        if workflow is not None:
            self._apply(workflow, overrides, line)
        if len(self.errors) > errors_before or workflow is None or job_id is None:
            return None
        text = canonical_json(workflow)
        sha = hashlib.sha256(text.encode()).hexdigest()
        return Job(
            id=job_id,
            line=line,
            workflow=workflow,
            workflow_sha256=sha,
            prompt_id=prompt_id_for(job_id, sha),
            set=overrides,
            shot=shot,
            duration_s=None if duration is None else float(duration),
            optional=optional,
            models=_models(workflow),
        )

    def _unknown_fields(
        self, obj: dict[str, Any], known: frozenset[str], line: int, prefix: str = ""
    ) -> None:
        for key in obj:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = (
                    f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(known))}"
                )
                self.error(line, prefix + key, f"unknown field ({hint})")

    def _job_id(self, obj: dict[str, Any], line: int) -> str | None:
        if "id" not in obj:
            self.error(line, "id", "missing")
            return None
        job_id = obj["id"]
        if not isinstance(job_id, str):
            self.error(line, "id", f"expected a UUID string, got {_kind(job_id)}")
            return None
        if _UUID.fullmatch(job_id):
            return job_id
        if _UUID.fullmatch(job_id.lower()):
            self.error(line, "id", f"UUID must be lowercase: {job_id!r}")
        else:
            self.error(line, "id", f"not a lowercase hyphenated UUID: {job_id!r}")
        return None

    def _workflow(self, obj: dict[str, Any], line: int) -> dict[str, Any] | None:
        """A fresh deep copy of the job's workflow, or None after recording the error."""
        if "workflow" not in obj:
            self.error(line, "workflow", "missing")
            return None
        spec = obj["workflow"]
        if isinstance(spec, dict):
            problem = _api_format_problem(spec)
            if problem:
                self.error(line, "workflow", f"inline workflow {problem}")
                return None
            return json.loads(canonical_json(spec))
        if not isinstance(spec, str) or not spec:
            self.error(line, "workflow", f"expected a file path or an object, got {spec!r}")
            return None
        loaded = self.cache.get(self.base_dir, spec)
        if isinstance(loaded, str):
            self.error(line, "workflow", loaded)
            return None
        # json.loads of cached text: a deep copy, faster than copy.deepcopy.
        return json.loads(loaded.text)

    def _apply(self, workflow: dict[str, Any], overrides: dict[str, Any], line: int) -> None:
        for key, value in overrides.items():
            name = f"set.{key}"
            node_id, dot, input_name = key.partition(".")
            if not dot or not node_id or not input_name:
                self.error(line, name, "expected '<node id>.<input name>'")
                continue
            node = workflow.get(node_id)
            if node is None:
                nodes = ", ".join(sorted(workflow))
                self.error(line, name, f"unknown node {node_id!r} (workflow has {nodes})")
                continue
            inputs = node["inputs"]
            label = f"node {node_id!r} ({node['class_type']})"
            if input_name not in inputs:
                known = ", ".join(sorted(inputs)) or "none"
                self.error(line, name, f"{label} has no input {input_name!r} (inputs: {known})")
                continue
            if _is_link(value):
                self.error(line, name, f"value {value!r} is a link; set only literal values")
                continue
            if _is_link(inputs[input_name]):
                self.error(
                    line,
                    name,
                    f"{label} input {input_name!r} is linked to node "
                    f"{inputs[input_name][0]!r}; set only literal inputs",
                )
                continue
            inputs[input_name] = value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
