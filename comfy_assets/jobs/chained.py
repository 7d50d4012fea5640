"""Building a job file's Jobs: each from its resolved workflow (the sha256 that names it
and its prompt_id), and the jobs whose inputs are other jobs' outputs ("chained") once
their upstream jobs have their prompt_ids, upstream first. An input from the job itself,
from an unknown job or node, and a cycle of chained jobs are errors of the file."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, NamedTuple, cast

from comfy_assets.jobs.model import (
    Input,
    InputFromJob,
    Job,
    canonical_json,
    prompt_id_for,
)
from comfy_assets.jobs.strict_json import quoted
from comfy_assets.jobs.workflows import model_names


class JobFields(NamedTuple):
    """The checked fields of one job line, in ``build_job``'s order."""

    id: str
    line: int
    workflow: dict[str, Any]
    overrides: dict[str, Any]
    shot: int | None
    duration_s: float | None
    optional: bool
    take: int
    inputs: tuple[Input, ...]


def build_job(fields: JobFields) -> Job:
    """The Job: each input's placeholder put into its node input (of ``fields.workflow``,
    changed), then hashed."""
    workflow = fields.workflow
    for item in fields.inputs:
        workflow[item.node_id]["inputs"][item.input_name] = item.placeholder
    text = canonical_json(workflow)
    sha = hashlib.sha256(text.encode()).hexdigest()
    return Job(
        id=fields.id,
        line=fields.line,
        workflow=workflow,
        workflow_sha256=sha,
        prompt_id=prompt_id_for(fields.id, sha, fields.take),
        set=fields.overrides,
        shot=fields.shot,
        duration_s=fields.duration_s,
        optional=fields.optional,
        models=model_names(workflow),
        inputs=fields.inputs,
        take=fields.take,
    )


class Chained(JobFields):
    """A valid job line with inputs from other jobs: everything a Job needs but the
    prompt_ids of its upstream jobs (and so its own)."""

    def upstreams(self) -> list[InputFromJob]:
        return [i for i in self.inputs if isinstance(i, InputFromJob)]

    def job(self, prompt_ids: Mapping[str, str]) -> Job:
        inputs = tuple(
            dataclasses.replace(i, upstream_prompt_id=prompt_ids[i.job])
            if isinstance(i, InputFromJob)
            else i
            for i in self.inputs
        )
        return build_job(self._replace(inputs=inputs))


class ChainResolution:
    """How the parser finishes chained jobs (a part of ``parse.LineParser``): it records
    errors with ``error`` and knows each valid job's line and workflow (``workflows``)."""

    workflows: dict[str, tuple[int, dict[str, Any]]]

    def error(self, line: int, name: str, message: str) -> None:
        raise NotImplementedError

    def chain(self, entries: list[Job | Chained], ids: Mapping[str, int]) -> list[Job]:
        """``entries`` with each ``Chained`` made a Job, upstream jobs first (so each
        dependant's placeholders hold its upstream's prompt_id). ``ids`` maps the job ids
        of the source to their line. Records an error for each input from itself, from an
        unknown job or node, and each input of a line in a cycle of chained jobs; a job
        that cannot be finished (its upstream is bad) is left out, as the source has
        errors then."""
        chained = {e.id: e for e in entries if isinstance(e, Chained)}
        if not chained:
            return cast(list[Job], entries)
        prompt_ids = {e.id: e.prompt_id for e in entries if isinstance(e, Job)}
        waits = self._waits(chained, ids)
        finished, left = _finish_in_order(chained, waits, prompt_ids)
        self._cycles({job_id: waits[job_id] & left.keys() for job_id in left}, chained)
        done: list[Job] = []
        for entry in entries:
            if isinstance(entry, Chained):
                made = finished.get(entry.id)
                if made is not None and made.line == entry.line:
                    done.append(made)
            else:
                done.append(entry)
        return done

    def _waits(self, chained: Mapping[str, Chained], ids: Mapping[str, int]) -> dict[str, set[str]]:
        """Each chained job whose inputs are all sound -> the chained jobs it waits for;
        records an error for each input that is not."""
        waits: dict[str, set[str]] = {}
        for job in chained.values():
            ups: set[str] | None = set()
            for item in job.upstreams():
                problem = self._upstream_problem(job, item, ids)
                if problem is not None:
                    self.error(job.line, f"inputs.{item.key}", problem)
                    ups = None
                elif ups is not None and item.job in chained:
                    ups.add(item.job)
            if ups is not None:
                waits[job.id] = ups
        return waits

    def _upstream_problem(
        self, job: Chained, item: InputFromJob, ids: Mapping[str, int]
    ) -> str | None:
        if item.job == job.id:
            return f"takes an input from its own job ({item.job}): a job cannot wait for itself"
        if item.job not in ids:
            return f"no job {quoted(item.job)} in this file"
        upstream = self.workflows.get(item.job)
        if upstream is not None and item.node not in upstream[1]:
            line, workflow = upstream
            nodes = ", ".join(sorted(workflow))
            return (
                f"job {item.job} (line {line}) has no node {item.node!r} (its workflow has {nodes})"
            )
        return None

    def _cycles(self, graph: dict[str, set[str]], chained: Mapping[str, Chained]) -> None:
        """An error on every input of every line in a cycle of ``graph`` (job -> the
        jobs it waits for), naming the cycle by its lines."""
        for cycle in strongly_connected(graph):
            members = set(cycle)
            lines = {job_id: chained[job_id].line for job_id in cycle}
            inside = {job_id: sorted(graph[job_id] & members) for job_id in cycle}
            simple = all(len(ups) == 1 for ups in inside.values())
            errors: list[tuple[int, str, str]] = []
            for job_id in cycle:
                if simple:
                    path = [job_id]
                    while len(path) <= len(cycle):
                        path.append(inside[path[-1]][0])
                    shown = " -> ".join(f"line {lines[x]}" for x in path)
                    what = f"a cycle of chained jobs: {shown} (each takes an input from the next)"
                else:
                    shown = ", ".join(str(n) for n in sorted(lines.values()))
                    what = f"a cycle of chained jobs: lines {shown} take inputs from each other"
                for item in chained[job_id].upstreams():
                    if item.job in members:
                        errors.append((lines[job_id], f"inputs.{item.key}", what))
            for line, name, what in sorted(errors):
                self.error(line, name, what)


def strongly_connected(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` (node -> the nodes it points to; targets outside it are
    ignored): each strongly connected component of more than one node, in the order
    Tarjan's algorithm closes them. Iterative, so a chain of any length is fine."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        work = [(root, iter(sorted(graph[root])))]
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in graph:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component: list[str] = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(component)
    return found


def _finish_in_order(
    chained: Mapping[str, Chained], waits: dict[str, set[str]], prompt_ids: dict[str, str]
) -> tuple[dict[str, Job], dict[str, int]]:
    """Kahn's order: a job is finished once every job it waits for is. Returns (the
    finished jobs by id, the jobs left unfinished, those in or behind a cycle, with how
    many jobs each still waits for);
    ``prompt_ids`` gains the finished jobs' prompt ids."""
    dependants: dict[str, list[str]] = {}
    for job_id, ups in waits.items():
        for up in ups:
            dependants.setdefault(up, []).append(job_id)
    left = {job_id: len(ups) for job_id, ups in waits.items()}
    ready = [job_id for job_id, count in left.items() if count == 0]
    finished: dict[str, Job] = {}
    while ready:
        job_id = ready.pop()
        del left[job_id]
        job = chained[job_id]
        if all(i.job in prompt_ids for i in job.upstreams()):
            finished[job_id] = job.job(prompt_ids)
            prompt_ids[job_id] = finished[job_id].prompt_id
        for dependant in dependants.get(job_id, ()):
            if dependant in left:
                left[dependant] -= 1
                if left[dependant] == 0:
                    ready.append(dependant)
    return finished, left
