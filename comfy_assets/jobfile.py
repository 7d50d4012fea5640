"""Job files: JSONL, one job a line, validated whole before anything is submitted.

A line::

    {"id": "<lowercase UUID>", "workflow": "wf.json" | {...API format...},
     "set": {"<node id>.<input name>": value}, "shot": 3, "duration_s": 4.0, "optional": false}

An optional first non-blank line ``{"header": {"policy": "delivery" | "draft",
"duration_tolerance": 0.1}}`` sets the film policy. Unknown fields are errors, so a typo
never passes silently. Every bad line is reported at once (``JobFileError``), and so are a
file with no jobs, a repeated ``id`` or ``shot``, and numbers JSON cannot carry (``NaN``,
``Infinity``, ``1e400``) anywhere in a line: ComfyUI would refuse them at POST time.

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

# Values quoted in errors are cut to this many characters (a whole workflow is no help).
_SHOWN_CHARS = 80

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


def is_job_id(text: str) -> bool:
    """True for a lowercase hyphenated UUID, the only form a job id takes."""
    return _UUID.fullmatch(text) is not None


def canonical_json(obj: Any) -> str:
    """The JSON text that is hashed: sorted keys, no spaces, ASCII only."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def prompt_id_for(job_id: str, workflow_sha256: str) -> str:
    """The idempotency key of ``job_id`` with that resolved workflow (lowercase UUID)."""
    return str(uuid.uuid5(NAMESPACE, f"{job_id}:{workflow_sha256}"))


def load_job_file(path: Path, workflows: WorkflowCache | None = None) -> JobFile:
    """Read and validate the JSONL job file at ``path``.

    Workflow paths are relative to the job file's folder; each file is read once, or
    once for every job file loaded with the same ``workflows`` (the sensor's tick).
    Raises ``JobFileError`` listing every bad line (nothing is returned for a partly
    valid file), including a missing or unreadable file and a file without a single job
    line (both line 0, field "file"), a repeated ``id`` or ``shot`` (on the later line,
    naming the first) and a non-finite number anywhere in a line.
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

    parser = _Parser(where, path.parent, workflows or WorkflowCache())
    header = Header()
    seen_ids: dict[str, int] = {}
    seen_shots: dict[int, int] = {}
    jobs: list[Job] = []
    job_lines = 0  # non-blank lines that are not the header, valid or not
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
        job_lines += 1
        if obj is None:
            continue
        job = parser.job(obj, number)
        job_id = obj.get("id")
        if isinstance(job_id, str):
            if job_id in seen_ids:
                parser.error(number, "id", f"{job_id} repeated; first on line {seen_ids[job_id]}")
            else:
                seen_ids[job_id] = number
        shot = obj.get("shot")
        if _is_shot(shot):
            # Two jobs for one shot: the film would have to pick one, so neither is taken.
            if shot in seen_shots:
                parser.error(number, "shot", f"{shot} repeated; first on line {seen_shots[shot]}")
            else:
                seen_shots[shot] = number
        if job is not None:
            jobs.append(job)
    if job_lines == 0:
        # An empty batch would wait forever for jobs that never come.
        parser.error(0, "file", "no jobs in file")
    if parser.errors:
        raise JobFileError(parser.errors)
    return JobFile(path=path, sha256=hashlib.sha256(data).hexdigest(), header=header, jobs=jobs)


def job_from_dict(obj: Any, *, base_dir: Path, source: str, line: int = 1) -> Job:
    """Validate one job that did not come from a file (a queue message, say).

    ``obj`` has the fields of one job line; workflow paths are relative to ``base_dir``;
    ``source`` and ``line`` name the origin in errors. Raises ``JobFileError`` listing
    this job's problems, including a non-finite float (``json.loads`` accepts ``NaN``).
    """
    parser = _Parser(source, Path(base_dir), WorkflowCache())
    if not isinstance(obj, dict):
        parser.error(line, "job", f"expected a JSON object, got {_kind(obj)}")
    elif parser.finite(obj, line):
        job = parser.job(obj, line)
        if job is not None and not parser.errors:
            return job
    raise JobFileError(parser.errors)


# --- internals ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Workflow:
    """A validated API-format workflow: its canonical text (for cheap deep copies)."""

    text: str


class WorkflowCache:
    """Workflow files read once: 10,000 jobs sharing a file parse it once, and so do
    5,000 job files loaded with the same cache. It never looks at a file again: keep
    one only as long as the files can be taken as unchanged (one sensor tick)."""

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
        except ValueError as e:  # a NUL in the path: no file can have that name
            return f"cannot read workflow file {str(path)!r}: {e}"
        try:
            obj = json.loads(raw, parse_float=_parse_float, parse_constant=_NonFinite)
        except json.JSONDecodeError as e:
            return f"workflow file {path} is not JSON: {e.msg} at line {e.lineno}"
        except ValueError as e:  # an integer of more than 4300 digits
            return f"workflow file {path} is not usable JSON: {e}"
        text = _first_non_finite(obj)
        if text is not None:
            nodes = obj.items() if isinstance(obj, dict) else ()
            node = next((f" node {k!r}" for k, v in nodes if _first_non_finite(v)), "")
            return f"workflow file {path}{node} holds {text}; {_FINITE_HINT}"
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


def _is_shot(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json(value: Any) -> str:
    """``value`` as JSON spells it (``true``, ``null``, ``"text"``), cut to a readable length."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


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


_FINITE_HINT = "ComfyUI accepts finite numbers only: no NaN, Infinity or beyond 1.8e308"


class _NonFinite:
    """A number JSON cannot carry, as written in the file (``NaN``, ``-Infinity``,
    ``1e400``): kept as a marker so the error can name it and its field."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _first_non_finite(value: Any) -> str | None:
    """The first non-finite number inside ``value`` (any depth) as written, or None.

    Finds the decoder's markers and also real ``nan``/``inf`` floats (a dict that came
    from ``json.loads`` rather than from a job file).
    """
    if isinstance(value, _NonFinite):
        return value.text
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)  # NaN, Infinity, -Infinity
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return None
    for item in value:
        text = _first_non_finite(item)
        if text is not None:
            return text
    return None


_decoder = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_float=_parse_float, parse_constant=_NonFinite
)


def _models(workflow: Mapping[str, Any]) -> tuple[str, ...]:
    names: set[str] = set()
    for node in workflow.values():
        for name, value in node["inputs"].items():
            if isinstance(value, str) and name.rstrip("0123456789") in MODEL_INPUTS:
                names.add(value)
    return tuple(sorted(names))


class _Parser:
    """Validates lines of one source, collecting every error instead of stopping."""

    def __init__(self, source: str, base_dir: Path, cache: WorkflowCache) -> None:
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
        except ValueError as e:  # an integer of more than 4300 digits
            self.error(line, "json", f"not usable JSON: {e}")
            return None
        if not isinstance(obj, dict):
            self.error(line, "json", f"expected a JSON object, got {_kind(obj)}")
            return None
        return obj if self.finite(obj, line) else None

    def finite(self, obj: dict[str, Any], line: int) -> bool:
        """Record an error for each field of ``obj`` holding a non-finite number (at any
        depth; ``set`` and ``header`` entries are named one by one). True if none does."""
        errors_before = len(self.errors)
        for key, value in obj.items():
            if key in ("set", "header") and isinstance(value, dict):
                fields = [(f"{key}.{sub}", inner) for sub, inner in value.items()]
            else:
                fields = [(key, value)]
            for name, inner in fields:
                text = _first_non_finite(inner)
                if text is None:
                    continue
                if isinstance(inner, dict | list):
                    self.error(line, name, f"holds {text}; {_FINITE_HINT}")
                else:
                    self.error(line, name, f"expected a finite number, got {text} ({_FINITE_HINT})")
        return len(self.errors) == errors_before

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
            self.error(
                line, "header.policy", f'expected "delivery" or "draft", got {_json(policy)}'
            )
        tolerance = body.get("duration_tolerance", 0.1)
        if not _is_number(tolerance) or not 0 <= tolerance <= 1:
            self.error(
                line,
                "header.duration_tolerance",
                f"expected a fraction from 0 to 1, got {_json(tolerance)}",
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
        if shot is not None and not _is_shot(shot):
            self.error(line, "shot", f"expected an integer >= 0, got {_json(shot)}")
        duration = obj.get("duration_s")
        if duration is not None and not (_is_number(duration) and duration > 0):
            self.error(
                line, "duration_s", f"expected a number of seconds > 0, got {_json(duration)}"
            )
        optional = obj.get("optional", False)
        if not isinstance(optional, bool):
            self.error(line, "optional", f"expected true or false, got {_json(optional)}")
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
            self.error(line, "id", f"UUID must be lowercase: {_json(job_id)}")
        else:
            self.error(line, "id", f"not a lowercase hyphenated UUID: {_json(job_id)}")
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
            self.error(line, "workflow", f"expected a file path or an object, got {_json(spec)}")
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
                self.error(line, name, f"value {_json(value)} is a link; set only literal values")
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
