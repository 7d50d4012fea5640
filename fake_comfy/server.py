"""aiohttp routes of the fake, answering as ComfyUI v0.8.0 does (data/recorded/*.json).

Content types: JSON answers are `application/json; charset=utf-8`; /interrupt, /free,
POST /queue and POST /history answer 200 with an empty body and no content type; a body
that is not JSON gets the 500 text/plain page (validation_errors.json); /view serves
files with their mimetype (image/png, video/mp4) and 404 / 400 / 403 as in basics.json;
POST /upload/image answers as upload.json (fake_comfy.upload).
"""

from __future__ import annotations

import asyncio
import json
import logging
import mimetypes
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler

from fake_comfy import recorded
from fake_comfy.graph import is_link
from fake_comfy.inputs import with_listed_files
from fake_comfy.script import busy_count
from fake_comfy.upload import store_upload
from fake_comfy.validate import MalformedPrompt, validate_prompt

if TYPE_CHECKING:
    from fake_comfy.fake import FakeComfy

log = logging.getLogger(__name__)

FAKE_KEY: web.AppKey[FakeComfy] = web.AppKey("fake_comfy")

# execution.SENSITIVE_EXTRA_DATA_KEYS: never stored in the queue or history.
_SENSITIVE = ("auth_token_comfy_org", "api_key_comfy_org")
INLINE_VIEW_BYTES = 1 << 20  # /view answers files up to this size from memory


def _text_500() -> web.Response:
    return web.Response(status=500, text=recorded.TEXT_500)


def _empty_200() -> web.Response:
    return web.Response(status=200)


async def _json_body(request: web.Request) -> Any:
    """The parsed body; raises ValueError when it is not JSON (the caller answers 500)."""
    raw = await request.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as ex:
        raise ValueError(f"{request.method} {request.path}: body is not JSON: {ex}") from ex


def _bad_request(error: dict[str, Any], node_errors: dict[str, Any]) -> web.Response:
    return web.json_response({"error": error, "node_errors": node_errors}, status=400)


def _depends_on(prompt: dict[str, Any], node: str, target: str) -> bool:
    """Whether `node` is `target` or needs it through links."""
    seen: set[str] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current == target:
            return True
        if current in seen or current not in prompt:
            continue
        seen.add(current)
        stack.extend(v[0] for v in prompt[current].get("inputs", {}).values() if is_link(v))
    return False


def _below_min(prompt: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The first literal numeric input with a minimum, reported as just below it."""
    info = recorded.object_info()
    for node_id, node in prompt.items():
        for name, spec in info[node["class_type"]]["input"].get("required", {}).items():
            extra = spec[1] if len(spec) > 1 else {}
            if spec[0] not in ("INT", "FLOAT") or "min" not in extra:
                continue
            if is_link(node["inputs"].get(name)):
                continue
            value = extra["min"] - 1
            return node_id, {
                "type": "value_smaller_than_min",
                "message": f"Value {value} smaller than min of {extra['min']}",
                "details": name,
                "extra_info": {"input_name": name, "input_config": spec, "received_value": value},
            }
    return None


def _invented_errors(prompt: dict[str, Any], outputs: list[str]) -> dict[str, Any]:
    """node_errors for the `invalid` word, in the recorded shape (validation_errors.json):
    the first numeric input with a minimum reported below it, else a missing input."""
    found = _below_min(prompt)
    if found is not None:
        node_id, error = found
    else:
        node_id = outputs[0]
        class_type = prompt[node_id]["class_type"]
        name = next(iter(recorded.object_info()[class_type]["input"]["required"]))
        error = {
            "type": "required_input_missing",
            "message": "Required input is missing",
            "details": name,
            "extra_info": {"input_name": name},
        }
    dependents = [o for o in outputs if _depends_on(prompt, o, node_id)]
    return {
        node_id: {
            "errors": [error],
            "dependent_outputs": dependents,
            "class_type": prompt[node_id]["class_type"],
        }
    }


async def post_prompt(request: web.Request) -> web.Response:
    """POST /prompt: consumes one script word, validates, queues.

    200 {"prompt_id", "number", "node_errors"}; 400 {"error", "node_errors"}; 500 text.
    """
    fake = request.app[FAKE_KEY]
    word = fake.script.take()
    try:
        body = await _json_body(request)
    except ValueError as ex:
        log.warning("fake_comfy: %s (script word %s)", ex, word)
        return _text_500()
    if not isinstance(body, dict):
        log.warning("fake_comfy: POST /prompt body is not a JSON object (script word %s)", word)
        return _text_500()
    prompt_id = str(body.get("prompt_id", uuid.uuid4()))
    fake.records.posted(prompt_id)
    fake.notify()
    log.debug("fake_comfy: POST /prompt %s, script word %s", prompt_id, word)
    if word == "500":
        return _text_500()
    session = fake.session
    fake.executor.enqueue_busy(busy_count(word))
    number = session.take_number(body)
    if "prompt" not in body:
        error = {
            "type": "no_prompt",
            "message": recorded.MSG_NO_PROMPT,
            "details": recorded.MSG_NO_PROMPT,
            "extra_info": {},
        }
        return _bad_request(error, {})
    prompt = body["prompt"]
    try:
        valid = validate_prompt(
            prompt,
            body.get("partial_execution_targets"),
            fake.models.object_info(),
            folders=fake.folders,
        )
    except MalformedPrompt as ex:
        log.warning("fake_comfy: POST /prompt %s: %s", prompt_id, ex)
        return _text_500()
    if not valid.ok:
        assert valid.error is not None
        return _bad_request(valid.error, valid.node_errors)
    outputs = list(valid.outputs)
    node_errors = dict(valid.node_errors)
    failed = {
        "type": "prompt_outputs_failed_validation",
        "message": recorded.MSG_FAILED_VALIDATION,
        "details": "",
        "extra_info": {},
    }
    if word == "invalid":
        return _bad_request(failed, _invented_errors(prompt, outputs))
    if word == "partial":
        dropped = outputs.pop(0)
        reason = recorded.partial_node_error()
        node_errors[dropped] = {
            "errors": [reason],
            "dependent_outputs": [dropped],
            "class_type": prompt[dropped]["class_type"],
        }
        if not outputs:  # every output failed: the real server answers 400
            return _bad_request(failed, node_errors)
    extra_data = dict(body["extra_data"]) if isinstance(body.get("extra_data"), dict) else {}
    if "client_id" in body:
        extra_data["client_id"] = body["client_id"]
    for key in _SENSITIVE:
        extra_data.pop(key, None)
    extra_data["create_time"] = int(time.time() * 1000)
    item = session.item(
        number,
        prompt_id=prompt_id,
        prompt=prompt,
        extra_data=extra_data,
        outputs=outputs,
        word=word,
        posted=time.time(),
    )
    fake.executor.enqueue(item)
    return web.json_response({"prompt_id": prompt_id, "number": number, "node_errors": node_errors})


async def get_prompt(request: web.Request) -> web.Response:
    """GET /prompt: {"exec_info": {"queue_remaining": N}} (basics.json)."""
    fake = request.app[FAKE_KEY]
    return web.json_response({"exec_info": {"queue_remaining": fake.session.remaining()}})


async def get_queue(request: web.Request) -> web.Response:
    """GET /queue: {"queue_running": [item], "queue_pending": [items in heap order]}."""
    session = request.app[FAKE_KEY].session
    running = [session.running.as_list()] if session.running is not None else []
    pending = [item.as_list() for item in session.queue]
    return web.json_response({"queue_running": running, "queue_pending": pending})


async def post_queue(request: web.Request) -> web.Response:
    """POST /queue: {"clear": true} empties the pending queue, {"delete": [prompt_id]}
    removes pending items (not a running one: interrupt_reconnect.json)."""
    fake = request.app[FAKE_KEY]
    try:
        body = await _json_body(request)
    except ValueError as ex:
        log.warning("fake_comfy: %s", ex)
        return _text_500()
    session = fake.session
    if body.get("clear"):
        session.queue.clear()
        fake.hub.status(session.remaining())
    for prompt_id in body.get("delete", []):
        if session.delete(prompt_id):
            fake.hub.status(session.remaining())
    fake.notify()
    return _empty_200()


async def get_history(request: web.Request) -> web.Response:
    """GET /history?max_items=N&offset=K: {prompt_id: entry} (oldest first)."""
    session = request.app[FAKE_KEY].session
    query = request.rel_url.query
    max_items = int(query["max_items"]) if "max_items" in query else None
    offset = int(query["offset"]) if "offset" in query else -1
    return web.json_response(session.history_page(max_items, offset))


async def get_history_item(request: web.Request) -> web.Response:
    """GET /history/{prompt_id}: {prompt_id: entry}, or {} when unknown (basics.json)."""
    session = request.app[FAKE_KEY].session
    prompt_id = request.match_info["prompt_id"]
    entry = session.history.get(prompt_id)
    return web.json_response({prompt_id: entry} if entry is not None else {})


async def post_history(request: web.Request) -> web.Response:
    """POST /history: {"clear": true} and/or {"delete": [prompt_id]}."""
    fake = request.app[FAKE_KEY]
    try:
        body = await _json_body(request)
    except ValueError as ex:
        log.warning("fake_comfy: %s", ex)
        return _text_500()
    if body.get("clear"):
        fake.session.history.clear()
    for prompt_id in body.get("delete", []):
        fake.session.history.pop(prompt_id, None)
    return _empty_200()


async def post_interrupt(request: web.Request) -> web.Response:
    """POST /interrupt [{"prompt_id"}]: flags an interrupt, which lands before the next
    node. Naming a prompt that is not running does nothing. Always 200, empty body."""
    session = request.app[FAKE_KEY].session
    try:
        body = await _json_body(request)
    except ValueError:
        body = {}  # the real server treats an empty / non-JSON body as a global interrupt
    prompt_id = body.get("prompt_id") if isinstance(body, dict) else None
    if prompt_id:
        if session.running is not None and session.running.prompt_id == prompt_id:
            session.interrupt.set()
        else:
            log.info("fake_comfy: prompt %s is not running, interrupt skipped", prompt_id)
    else:
        session.interrupt.set()
    return _empty_200()


async def post_free(request: web.Request) -> web.Response:
    """POST /free: 200, empty body. ``free_memory: true`` resets the node output cache
    between two prompts (at once when idle; cache_replay.json); ``unload_models``, true
    or (absent) as ``free_memory``, unloads the models (main.py prompt_worker)."""
    try:
        body = await _json_body(request)
    except ValueError as ex:
        log.warning("fake_comfy: %s", ex)
        return _text_500()
    if isinstance(body, dict) and (body.get("free_memory") or body.get("unload_models")):
        free_memory = bool(body.get("free_memory"))
        unload = bool(body.get("unload_models")) or free_memory
        request.app[FAKE_KEY].executor.request_free(free_memory, unload)
    return _empty_200()


async def get_view(request: web.Request) -> web.StreamResponse:
    """GET /view?filename=&subfolder=&type=: the file, or 400 (`..` or a leading `/` in
    the filename, unknown type), 403 (subfolder escaping the folder), 404 (missing)."""
    fake = request.app[FAKE_KEY]
    query = request.rel_url.query
    if "filename" not in query:
        return web.Response(status=404)
    filename = query["filename"]
    base: str | None = None
    for tag, folder in (("[output]", fake.output), ("[input]", fake.input), ("[temp]", fake.temp)):
        if filename.endswith(tag):
            filename, base = filename[: -len(tag) - 1], str(folder.root)
    if not filename or filename[0] == "/" or ".." in filename:
        return web.Response(status=400)
    if base is None:
        folder = {"output": fake.output, "input": fake.input, "temp": fake.temp}.get(
            query.get("type", "output")
        )
        if folder is None:
            return web.Response(status=400)
        base = str(folder.root)
    if "subfolder" in query:
        full = os.path.join(base, query["subfolder"])
        if os.path.commonpath((os.path.abspath(full), base)) != base:
            return web.Response(status=403)
        base = full
    filename = os.path.basename(filename)
    path = os.path.join(base, filename)
    if not os.path.isfile(path):
        return web.Response(status=404)
    content_type = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    if content_type in {
        "text/html",
        "text/html-sandboxed",
        "application/xhtml+xml",
        "text/javascript",
        "text/css",
    }:
        content_type = "application/octet-stream"
    headers = {"Content-Disposition": f'filename="{filename}"', "Content-Type": content_type}
    if os.path.getsize(path) <= INLINE_VIEW_BYTES:
        # A small file read here: FileResponse's thread hops cost more CPU than the read.
        with open(path, "rb") as f:
            return web.Response(body=f.read(), headers=headers)
    return web.FileResponse(path, headers=headers)


async def get_ws(request: web.Request) -> web.WebSocketResponse:
    """GET /ws?clientId=: greets with `status` + `sid`, and `executing` without prompt_id
    when this client's prompt is running (interrupt_reconnect.json)."""
    fake = request.app[FAKE_KEY]
    ws = web.WebSocketResponse()
    await ws.prepare(request)
    sid = request.rel_url.query.get("clientId", "") or uuid.uuid4().hex
    fake.hub.register(sid, ws, request.transport)
    try:
        session = fake.session
        await fake.hub.send_direct(
            ws,
            "status",
            {"status": {"exec_info": {"queue_remaining": session.remaining()}}, "sid": sid},
        )
        if session.client_id == sid and session.last_node_id is not None:
            await fake.hub.send_direct(ws, "executing", {"node": session.last_node_id})
        async for _ in ws:
            pass  # the fake ignores what clients send
    except ConnectionError as ex:
        log.debug("fake_comfy: socket %s went away: %s", sid, ex)
    finally:
        fake.hub.unregister(sid, ws)
    return ws


async def get_object_info(request: web.Request) -> web.Response:
    """GET /object_info: the recorded subset of node classes (basics.json), LoadImage and
    LoadVideo listing the files at the top of the input folder (upload.json), the model
    loaders listing this fake's files (fake_comfy.models)."""
    fake = request.app[FAKE_KEY]
    folder = fake.input.root
    info = fake.models.object_info()
    return web.json_response({k: with_listed_files(k, v, folder) for k, v in info.items()})


async def get_object_info_node(request: web.Request) -> web.Response:
    """GET /object_info/{node_class}: {node_class: info}, or {} when unknown."""
    name = request.match_info["node_class"]
    info = request.app[FAKE_KEY].models.object_info()
    if name not in info:
        return web.json_response({})
    folder = request.app[FAKE_KEY].input.root
    return web.json_response({name: with_listed_files(name, info[name], folder)})


async def post_upload_image(request: web.Request) -> web.Response:
    """POST /upload/image: stores an input file (fake_comfy.upload, upload.json). 200
    {"name", "subfolder", "type"}; 400 with an empty body; 500 text/plain."""
    fake = request.app[FAKE_KEY]
    try:
        post = await request.post()
    except ValueError as ex:  # a malformed multipart body: unhandled in ComfyUI too
        log.warning("fake_comfy: POST /upload/image: %s", ex)
        return _text_500()
    folders = {
        "input": str(fake.input.root),
        "temp": str(fake.temp.root),
        "output": str(fake.output.root),
    }
    async with fake.upload_lock:
        try:
            answer = await asyncio.to_thread(store_upload, post, folders)
        except (ValueError, OSError, AttributeError, TypeError) as ex:
            # What ComfyUI's handler raises there reaches aiohttp: its 500 page.
            log.warning("fake_comfy: POST /upload/image: %s", ex)
            return _text_500()
    if answer.body is None:
        return web.Response(status=answer.status)
    fake.records.uploaded(answer.prompt_name)
    fake.notify()
    return web.json_response(answer.body)


async def get_system_stats(request: web.Request) -> web.Response:
    """GET /system_stats: the recorded body (basics.json)."""
    return web.json_response(recorded.system_stats())


async def get_fake_stats(request: web.Request) -> web.Response:
    """GET /fake/stats: {"prompts": {id: {"posted", "executed"}}, "runs": [...],
    "requests": {...}, "model_loads": {file: [...]}} (FakeComfy.stats)."""
    return web.json_response(request.app[FAKE_KEY].stats)


@web.middleware
async def _count_request(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Counts the request in the fake's records (``requests`` of /fake/stats); a request
    whose client went away before its body was read gets no answer but a log line."""
    route = request.match_info.route.resource
    path = route.canonical if route is not None else request.path
    request.app[FAKE_KEY].records.request(f"{request.method} {path}")
    try:
        return await handler(request)
    except ConnectionResetError as ex:
        # The client went away mid-request (a cut socket): nobody is left to answer.
        log.info("fake_comfy: %s %s: %s", request.method, request.path, ex)
        return web.Response(status=400)


def build_app(fake: FakeComfy) -> web.Application:
    """The aiohttp application serving `fake`."""
    app = web.Application(client_max_size=100 * 1024 * 1024, middlewares=[_count_request])
    app[FAKE_KEY] = fake
    app.add_routes(
        [
            web.get("/system_stats", get_system_stats),
            web.get("/queue", get_queue),
            web.post("/queue", post_queue),
            web.get("/prompt", get_prompt),
            web.post("/prompt", post_prompt),
            web.get("/history", get_history),
            web.post("/history", post_history),
            web.get("/history/{prompt_id}", get_history_item),
            web.post("/interrupt", post_interrupt),
            web.post("/free", post_free),
            web.get("/view", get_view),
            web.post("/upload/image", post_upload_image),
            web.get("/ws", get_ws),
            web.get("/object_info", get_object_info),
            web.get("/object_info/{node_class}", get_object_info_node),
            web.get("/fake/stats", get_fake_stats),
        ]
    )
    return app
