"""The bare pattern users compare us with: ComfyUI's own script_examples/websockets_api_example.py.

One socket, then per prompt: POST /prompt, read the socket until ``executing`` with
``node: null`` for that prompt, GET /history/{prompt_id}, GET /view for each output, write
the bytes to a file. No store, no retries, no checks: the floor a runner's cost is
measured against (bench/overhead.py).

    python bench/bare_client.py URL PROMPTS.json OUT_DIR

PROMPTS.json: a list of API-format prompts, posted one after the other.
"""

from __future__ import annotations

import json
import sys
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from websockets.sync.client import connect


def main(url: str, prompts_path: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(Path(prompts_path).read_text())
    client_id = str(uuid.uuid4())
    ws_url = url.replace("http://", "ws://") + f"/ws?clientId={client_id}"
    with connect(ws_url, max_size=None) as ws:
        for prompt in prompts:
            prompt_id = str(uuid.uuid4())
            body = {"prompt": prompt, "client_id": client_id, "prompt_id": prompt_id}
            request = urllib.request.Request(f"{url}/prompt", data=json.dumps(body).encode())
            urllib.request.urlopen(request).read()
            while True:
                message = ws.recv()
                if isinstance(message, str):
                    data = json.loads(message)
                    if data["type"] == "executing":
                        d = data["data"]
                        if d["node"] is None and d["prompt_id"] == prompt_id:
                            break
            with urllib.request.urlopen(f"{url}/history/{prompt_id}") as response:
                history = json.loads(response.read())[prompt_id]
            for node_output in history["outputs"].values():
                for image in node_output.get("images", []):
                    query = urllib.parse.urlencode(
                        {
                            "filename": image["filename"],
                            "subfolder": image["subfolder"],
                            "type": image["type"],
                        }
                    )
                    with urllib.request.urlopen(f"{url}/view?{query}") as response:
                        (out / f"{prompt_id}-{image['filename']}").write_bytes(response.read())


if __name__ == "__main__":
    main(*sys.argv[1:4])
