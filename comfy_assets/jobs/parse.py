"""Job files: JSONL, one job a line, validated whole before anything is submitted.

A line::

    {"id": "<lowercase UUID>", "workflow": "wf.json" | {...API format...},
     "set": {"<node id>.<input name>": value}, "shot": 3, "duration_s": 4.0, "optional": false,
     "inputs": {"<node id>.<input name>": "pictures/key.png"
                                        | {"job": "<job id>", "node": "9", "index": 0}},
     "take": 2}

An optional first non-blank line ``{"header": {"policy": "delivery" | "draft",
"duration_tolerance": 0.1, "priority": 0}}`` sets the film policy and the batch's
priority (an integer, higher first: docs/steering.md). Unknown fields are errors, so a typo
never passes silently. Every bad line is reported at once (``JobFileError``), and so are a
file with no jobs, a repeated ``id`` or ``shot``, and numbers JSON cannot carry (``NaN``,
``Infinity``, ``1e400``) anywhere in a line: ComfyUI would refuse them at POST time.

``inputs`` name a literal (not linked) node input of the workflow that ``set`` does not
set. A file value is a path relative to the job file, read and hashed once per load
(``comfy_assets.jobs.inputs`` says what is refused; ``InputRules`` sets the size limit and
whether links out of the job file's folder are followed). An object value takes the
``index``-th file (default 0) that node ``node`` of another job of the same file writes:
an unknown job or node, a job taking an input from itself and a cycle of chained jobs
(each line of it, naming the cycle by lines) are errors of the file. Each input's node
input holds a placeholder naming its content (``InputFile.placeholder``,
``InputFromJob.placeholder``), and upstream jobs get their prompt_id first, so a changed
input or a new take of an upstream job changes its dependants' prompt_ids too. ``take``
(an integer >= 1, default 1) is part of the prompt_id; take 1 keeps the prompt_id a job
line without ``take`` has.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from pathlib import Path
from typing import Any

from comfy_assets.jobs.chained import Chained, ChainResolution, build_job
from comfy_assets.jobs.inputs import DEFAULT_RULES, InputReader, InputRules, parse_upstream
from comfy_assets.jobs.model import (
    UUID_PATTERN,
    Header,
    Input,
    InputFile,
    InputFromJob,
    Job,
    JobFile,
    JobFileError,
    LineError,
    canonical_json,
    policy_problem,
    priority_problem,
)
from comfy_assets.jobs.regular_file import NotARegularFile, read_regular_file
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
    text_problems,
)
from comfy_assets.jobs.workflows import MAX_WORKFLOW_BYTES, WorkflowCache, api_format_problem

JOB_FIELDS = frozenset(
    {"id", "workflow", "set", "shot", "duration_s", "optional", "inputs", "take"}
)

HEADER_FIELDS = frozenset({"policy", "duration_tolerance", "priority"})


def load_job_file(
    path: Path, workflows: WorkflowCache | None = None, *, rules: InputRules | None = None
) -> JobFile:
    """Read and validate the JSONL job file at ``path``.

    Workflow paths are relative to the job file's folder; each file is read once, or
    once for every job file loaded with the same ``workflows`` (the sensor's tick).
    Input files are relative to it too, each read and hashed once per call, under
    ``rules`` (default ``InputRules()``: 64 MiB, no links out). ``jobs`` are in line
    order; a job taking an input from another job gets its prompt_id after that job's.
    Raises ``JobFileError`` listing every bad line (nothing is returned for a partly
    valid file), including a missing or unreadable file and a file without a single job
    line (both line 0, field "file"), bytes that are not UTF-8 (the line of the first, field
    "file"), a repeated ``id`` or ``shot`` (on the later line,
    naming the first) and a non-finite number anywhere in a line.
    """
    path = Path(path)
    where = str(path)
    data, text = _read_text(path)
    parser = _Parser(where, path.parent, workflows or WorkflowCache(), rules)
    header = Header()
    seen_ids: dict[str, int] = {}
    seen_shots: dict[int, int] = {}
    jobs: list[Job | Chained] = []
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
        _note_repeats(parser, obj, number, seen_ids, seen_shots)
        if job is not None:
            jobs.append(job)
    if job_lines == 0:
        # An empty batch would wait forever for jobs that never come.
        parser.error(0, "file", "no jobs in file")
    errors_before = len(parser.errors)
    done = parser.chain(jobs, seen_ids)
    if len(parser.errors) > errors_before:
        # Errors of chained inputs are found once every line is read: put them in place.
        parser.errors.sort(key=lambda e: e.line)
    if parser.errors:
        raise JobFileError(parser.errors)
    return JobFile(path=path, sha256=version_sha256(data, done), header=header, jobs=done)


def _read_text(path: Path) -> tuple[bytes, str]:
    """The job file's bytes and text; JobFileError (line 0, or the line of the first byte
    that is not UTF-8; field "file") when it cannot be read or decoded."""
    where = str(path)
    try:
        data = read_regular_file(path)
    except OSError as e:
        raise JobFileError([LineError(where, 0, "file", f"cannot read: {e.strerror}")]) from e
    except NotARegularFile as e:
        raise JobFileError([LineError(where, 0, "file", f"cannot read: it {e}")]) from e
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
    return data, text


def _note_repeats(
    parser: _Parser,
    obj: dict[str, Any],
    number: int,
    seen_ids: dict[str, int],
    seen_shots: dict[int, int],
) -> None:
    """Records line ``number``'s id and shot, or an error naming the first line that has
    the same one."""
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


def version_sha256(data: bytes, jobs: list[Job]) -> str:
    """The sha256 of a job file's version: of its bytes, and for a file whose jobs read
    input files, of each input's key, path and sha256 too, so that new bytes of a picture
    make a new version (a new Dagster run) although the job file did not change."""
    digest = hashlib.sha256(data)
    files = sorted(
        f"{job.id} {inp.key} {inp.path} {inp.sha256}"
        for job in jobs
        for inp in job.inputs
        if isinstance(inp, InputFile)
    )
    if files:
        digest.update(b"\0inputs\0" + "\n".join(files).encode())
    return digest.hexdigest()


def job_from_dict(
    obj: Any, *, base_dir: Path, source: str, line: int = 1, rules: InputRules | None = None
) -> Job:
    """Validate one job that did not come from a file (a queue message, say).

    ``obj`` has the fields of one job line; workflow and input file paths are relative to
    ``base_dir`` (input files read under ``rules``, default ``InputRules()``); ``source``
    and ``line`` name the origin in errors. A value of ``obj["inputs"]`` may also be an
    ``InputFile`` whose bytes were already checked (a queue message's inline bytes):
    its node input is checked, its bytes taken as they are. An input from another job is
    an error (there is no other job). Raises ``JobFileError`` listing this job's
    problems, including a non-finite float (``json.loads`` accepts ``NaN``).
    """
    parser = _Parser(source, Path(base_dir), WorkflowCache(), rules)
    if not isinstance(obj, dict):
        parser.error(line, "job", f"expected a JSON object, got {kind_of(obj)}")
    elif parser.sendable(obj, line):
        job = parser.job(obj, line)
        if job is not None and not parser.errors:
            done = parser.chain([job], {})
            if not parser.errors:
                return done[0]
    raise JobFileError(parser.errors)


# Takes are numbers people type and read: bounded like shot numbers, so a 32-bit
# column holds any of them.
MAX_TAKE = 2**31 - 1


class _Parser(ChainResolution):
    """Validates lines of one source, collecting every error instead of stopping."""

    def __init__(
        self, source: str, base_dir: Path, cache: WorkflowCache, rules: InputRules | None
    ) -> None:
        self.source = source
        self.base_dir = base_dir
        self.cache = cache
        self.rules = rules or DEFAULT_RULES
        self._reader: InputReader | None = None
        self.errors: list[LineError] = []
        # The line and workflow of each valid job id (the first, when repeated), for the
        # nodes of inputs taken from other jobs.
        self.workflows: dict[str, tuple[int, dict[str, Any]]] = {}

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
        return obj if self.sendable(obj, line) else None

    def sendable(self, obj: dict[str, Any], line: int) -> bool:
        """Record an error for each field of ``obj`` a server or the store could not take:
        a non-finite number (``finite``), a NUL or a lone surrogate in a string, a control
        character in a key (``strict_json.text_problems``). True if none."""
        finite = self.finite(obj, line)
        problems = text_problems(obj)
        for name, message in problems:
            self.error(line, name, message)
        return finite and not problems

    def finite(self, obj: dict[str, Any], line: int) -> bool:
        """Record an error for each field of ``obj`` holding a non-finite number (at any
        depth; ``set``, ``inputs`` and ``header`` entries are named one by one). True if none
        does."""
        errors_before = len(self.errors)
        for key, value in obj.items():
            if key in ("set", "header", "inputs") and isinstance(value, dict):
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
        if (problem := policy_problem(policy)) is not None:
            self.error(line, "header.policy", problem)
        tolerance = body.get("duration_tolerance", 0.1)
        if not is_number(tolerance) or not 0 <= tolerance <= 1:
            self.error(
                line,
                "header.duration_tolerance",
                f"expected a fraction from 0 to 1, got {quoted(tolerance)}",
            )
        priority = body.get("priority", 0)
        if (problem := priority_problem(priority)) is not None:
            self.error(line, "header.priority", problem)
        if len(self.errors) > errors_before:
            return None
        return Header(policy=policy, duration_tolerance=float(tolerance), priority=priority)

    def job(self, obj: dict[str, Any], line: int) -> Job | Chained | None:
        """A Job from one parsed line (a ``Chained`` when it takes inputs from other
        jobs: ``chain`` finishes it), or None after recording its errors."""
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
        take = obj.get("take", 1)
        # type() is int: not a bool (True == 1), and one check on the common path.
        if type(take) is not int or not 1 <= take <= MAX_TAKE:
            self.error(
                line, "take", f"expected an integer from 1 to {MAX_TAKE}, got {quoted(take)}"
            )
        overrides = obj.get("set", {})
        if not isinstance(overrides, dict):
            self.error(line, "set", f"expected an object, got {kind_of(overrides)}")
            overrides = {}
        workflow = self._workflow(obj, line)
        if workflow is not None:
            self._apply(workflow, overrides, line)
            if job_id is not None:
                self.workflows.setdefault(job_id, (line, workflow))
        inputs = self._inputs(obj["inputs"], workflow, overrides, line) if "inputs" in obj else ()
        if len(self.errors) > errors_before or workflow is None or job_id is None:
            return None
        fields = (
            job_id,
            line,
            workflow,
            overrides,
            shot,
            None if duration is None else float(duration),
            optional,
            take,
            inputs,
        )
        if inputs and any(isinstance(i, InputFromJob) for i in inputs):
            return Chained(*fields)
        return build_job(*fields)

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
            text = canonical_json(spec)  # ASCII only: a character is a byte
            if len(text) > MAX_WORKFLOW_BYTES:
                self.error(
                    line,
                    "workflow",
                    f"inline workflow is {len(text)} bytes as compact JSON, over the limit "
                    f"of {MAX_WORKFLOW_BYTES} bytes of a workflow file",
                )
                return None
            return json.loads(text)
        if not isinstance(spec, str) or not spec:
            self.error(line, "workflow", f"expected a file path or an object, got {quoted(spec)}")
            return None
        loaded = self.cache.get(self.base_dir, spec)
        if isinstance(loaded, str):
            self.error(line, "workflow", loaded)
            return None
        # json.loads of cached text: a deep copy, faster than copy.deepcopy.
        return json.loads(loaded.text)

    def _node_input(
        self, workflow: dict[str, Any], key: str, line: int, name: str
    ) -> tuple[dict[str, Any], str] | None:
        """The inputs of the node ``key`` names and the input's name, when ``key`` names
        an input of a node of ``workflow``; else None after recording why not (field
        ``name``)."""
        node_id, dot, input_name = key.partition(".")
        if not dot or not node_id or not input_name:
            self.error(line, name, "expected '<node id>.<input name>'")
            return None
        node = workflow.get(node_id)
        if node is None:
            nodes = ", ".join(sorted(workflow))
            self.error(line, name, f"unknown node {node_id!r} (workflow has {nodes})")
            return None
        inputs = node["inputs"]
        if input_name not in inputs:
            known = ", ".join(sorted(inputs)) or "none"
            label = f"node {node_id!r} ({node['class_type']})"
            self.error(line, name, f"{label} has no input {input_name!r} (inputs: {known})")
            return None
        return inputs, input_name

    def _linked(self, workflow: dict[str, Any], key: str, line: int, name: str, rule: str) -> None:
        """Record that the node input ``key`` is a link (``rule`` says what may be done)."""
        node_id, _, input_name = key.partition(".")
        node = workflow[node_id]
        source = node["inputs"][input_name][0]
        label = f"node {node_id!r} ({node['class_type']})"
        self.error(line, name, f"{label} input {input_name!r} is linked to node {source!r}; {rule}")

    def _apply(self, workflow: dict[str, Any], overrides: dict[str, Any], line: int) -> None:
        for key, value in overrides.items():
            name = f"set.{key}"
            target = self._node_input(workflow, key, line, name)
            if target is None:
                continue
            inputs, input_name = target
            if is_link(value):
                self.error(line, name, f"value {quoted(value)} is a link; set only literal values")
            elif is_link(inputs[input_name]):
                self._linked(workflow, key, line, name, "set only literal inputs")
            else:
                inputs[input_name] = value

    def _inputs(
        self,
        spec: Any,
        workflow: dict[str, Any] | None,
        overrides: dict[str, Any],
        line: int,
    ) -> tuple[Input, ...]:
        """The inputs of one line, checked against its resolved ``workflow`` (when it
        has one): every problem recorded, each on ``inputs.<key>``."""
        if not isinstance(spec, dict):
            self.error(line, "inputs", f"expected an object, got {kind_of(spec)}")
            return ()
        found: list[Input] = []
        for key, value in spec.items():
            name = f"inputs.{key}"
            errors_before = len(self.errors)
            if key in overrides:
                self.error(
                    line, name, f"{key!r} is also in 'set': a node input takes a value or a file"
                )
            elif workflow is not None:
                target = self._node_input(workflow, key, line, name)
                if target is not None and is_link(target[0][target[1]]):
                    rule = "an input replaces only a literal input"
                    self._linked(workflow, key, line, name, rule)
            else:
                node_id, dot, input_name = key.partition(".")
                if not dot or not node_id or not input_name:
                    self.error(line, name, "expected '<node id>.<input name>'")
            node_id, _, input_name = key.partition(".")
            item: Input
            if isinstance(value, InputFile):  # bytes already read and checked
                item = dataclasses.replace(value, key=key, node_id=node_id, input_name=input_name)
            elif isinstance(value, dict):
                upstream = parse_upstream(value)
                if isinstance(upstream, list):
                    for problem in upstream:
                        self.error(line, name, problem)
                    continue
                item = InputFromJob(key, node_id, input_name, *upstream)
            else:
                if self._reader is None:
                    self._reader = InputReader(self.base_dir, self.rules)
                read = self._reader.get(value)
                if isinstance(read, str):
                    self.error(line, name, read)
                    continue
                item = InputFile(
                    key,
                    node_id,
                    input_name,
                    value,
                    read.sha256,
                    read.size,
                    source=read.source,
                    opener=read.opener,
                )
            if len(self.errors) == errors_before:
                found.append(item)
        return tuple(found)
