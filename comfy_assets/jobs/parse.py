"""Job files: JSONL, one job a line, validated whole before anything is submitted.

A line::

    {"id": "<lowercase UUID>", "workflow": "wf.json" | {...API format...},
     "set": {"<node id>.<input name>": value}, "shot": 3, "duration_s": 4.0, "optional": false}

An optional first non-blank line ``{"header": {"policy": "delivery" | "draft",
"duration_tolerance": 0.1}}`` sets the film policy. Unknown fields are errors, so a typo
never passes silently. Every bad line is reported at once (``JobFileError``), and so are a
file with no jobs, a repeated ``id`` or ``shot``, and numbers JSON cannot carry (``NaN``,
``Infinity``, ``1e400``) anywhere in a line: ComfyUI would refuse them at POST time.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

from comfy_assets.jobs.model import (
    POLICIES,
    UUID_PATTERN,
    Header,
    Job,
    JobFile,
    JobFileError,
    LineError,
    canonical_json,
    prompt_id_for,
)
from comfy_assets.jobs.strict_json import (
    FINITE_HINT,
    MAX_SHOT,
    DuplicateKey,
    decoder,
    first_non_finite,
    is_link,
    is_number,
    is_shot,
    kind_of,
    loads_bounded,
    quoted,
)
from comfy_assets.jobs.workflows import WorkflowCache, api_format_problem, model_names

JOB_FIELDS = frozenset({"id", "workflow", "set", "shot", "duration_s", "optional"})

HEADER_FIELDS = frozenset({"policy", "duration_tolerance"})


def load_job_file(path: Path, workflows: WorkflowCache | None = None) -> JobFile:
    """Read and validate the JSONL job file at ``path``.

    Workflow paths are relative to the job file's folder; each file is read once, or
    once for every job file loaded with the same ``workflows`` (the sensor's tick).
    Raises ``JobFileError`` listing every bad line (nothing is returned for a partly
    valid file), including a missing or unreadable file and a file without a single job
    line (both line 0, field "file"), bytes that are not UTF-8 (the line of the first, field
    "file"), a repeated ``id`` or ``shot`` (on the later line,
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
        # The line of the first byte that is not UTF-8, and its column in bytes (1-based);
        # e.start counts from after a BOM, as e.object does.
        line = e.object.count(b"\n", 0, e.start) + 1
        column = e.start - (e.object.rfind(b"\n", 0, e.start) + 1) + 1
        raise JobFileError(
            [LineError(where, line, "file", f"not UTF-8 at byte {column} of the line: {e.reason}")]
        ) from e

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
        if is_shot(shot):
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
        parser.error(line, "job", f"expected a JSON object, got {kind_of(obj)}")
    elif parser.finite(obj, line):
        job = parser.job(obj, line)
        if job is not None and not parser.errors:
            return job
    raise JobFileError(parser.errors)


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
            obj = loads_bounded(decoder.decode, raw)
        except DuplicateKey as e:
            self.error(line, str(e), "key repeated in this line")
            return None
        except json.JSONDecodeError as e:
            self.error(line, "json", f"not JSON: {e.msg} at column {e.colno}")
            return None
        except ValueError as e:  # an integer of more than 4300 digits, TooDeep
            self.error(line, "json", f"not usable JSON: {e}")
            return None
        if not isinstance(obj, dict):
            self.error(line, "json", f"expected a JSON object, got {kind_of(obj)}")
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
                text = first_non_finite(inner)
                if text is None:
                    continue
                if isinstance(inner, dict | list):
                    self.error(line, name, f"holds {text}; {FINITE_HINT}")
                else:
                    self.error(line, name, f"expected a finite number, got {text} ({FINITE_HINT})")
        return len(self.errors) == errors_before

    def header(self, obj: dict[str, Any], line: int) -> Header | None:
        errors_before = len(self.errors)
        for key in obj:
            if key != "header":
                self.error(line, key, "unknown field in the header line (only 'header')")
        body = obj["header"]
        if not isinstance(body, dict):
            self.error(line, "header", f"expected an object, got {kind_of(body)}")
            return None
        self._unknown_fields(body, HEADER_FIELDS, line, prefix="header.")
        policy = body.get("policy", "delivery")
        if policy not in POLICIES:
            self.error(
                line, "header.policy", f'expected "delivery" or "draft", got {quoted(policy)}'
            )
        tolerance = body.get("duration_tolerance", 0.1)
        if not is_number(tolerance) or not 0 <= tolerance <= 1:
            self.error(
                line,
                "header.duration_tolerance",
                f"expected a fraction from 0 to 1, got {quoted(tolerance)}",
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
        if shot is not None and not is_shot(shot):
            self.error(
                line, "shot", f"expected an integer from 0 to {MAX_SHOT}, got {quoted(shot)}"
            )
        duration = obj.get("duration_s")
        if duration is not None and not (is_number(duration) and duration > 0):
            self.error(
                line, "duration_s", f"expected a number of seconds > 0, got {quoted(duration)}"
            )
        optional = obj.get("optional", False)
        if not isinstance(optional, bool):
            self.error(line, "optional", f"expected true or false, got {quoted(optional)}")
        overrides = obj.get("set", {})
        if not isinstance(overrides, dict):
            self.error(line, "set", f"expected an object, got {kind_of(overrides)}")
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
            models=model_names(workflow),
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
            self.error(line, "id", f"expected a UUID string, got {kind_of(job_id)}")
            return None
        if UUID_PATTERN.fullmatch(job_id):
            return job_id
        if UUID_PATTERN.fullmatch(job_id.lower()):
            self.error(line, "id", f"UUID must be lowercase: {quoted(job_id)}")
        else:
            self.error(line, "id", f"not a lowercase hyphenated UUID: {quoted(job_id)}")
        return None

    def _workflow(self, obj: dict[str, Any], line: int) -> dict[str, Any] | None:
        """A fresh deep copy of the job's workflow, or None after recording the error."""
        if "workflow" not in obj:
            self.error(line, "workflow", "missing")
            return None
        spec = obj["workflow"]
        if isinstance(spec, dict):
            problem = api_format_problem(spec)
            if problem:
                self.error(line, "workflow", f"inline workflow {problem}")
                return None
            return json.loads(canonical_json(spec))
        if not isinstance(spec, str) or not spec:
            self.error(line, "workflow", f"expected a file path or an object, got {quoted(spec)}")
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
            if is_link(value):
                self.error(line, name, f"value {quoted(value)} is a link; set only literal values")
                continue
            if is_link(inputs[input_name]):
                self.error(
                    line,
                    name,
                    f"{label} input {input_name!r} is linked to node "
                    f"{inputs[input_name][0]!r}; set only literal inputs",
                )
                continue
            inputs[input_name] = value
