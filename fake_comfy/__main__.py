"""`python -m fake_comfy --port P [--host H] [--script ok,500,hang] [--busy N]
[--prompt-seconds S] [--output-dir D] [--input-dir D]
[--models a.safetensors,loras:b.safetensors] [--model-load-s S] [--resident N]`

Prints `fake_comfy listening on http://HOST:PORT` (flushed) once it listens (port 0 picks
a free port) and exits 0 on Ctrl+C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from fake_comfy.fake import FakeComfy


def _port(text: str) -> int:
    """An argparse ``type``: a TCP port, 0 to 65535 (0 picks a free one)."""
    port = int(text) if text.strip().isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return port


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fake_comfy", description=__doc__)
    parser.add_argument("--port", type=_port, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--script", default="", help="comma-separated words, e.g. ok,500,hang")
    parser.add_argument(
        "--busy", type=int, default=0, help="prompts of another client queued first"
    )
    parser.add_argument("--prompt-seconds", type=float, default=0.01, help="seconds per node")
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    parser.add_argument(
        "--input-dir",
        default=None,
        help="where uploads go and LoadImage reads (default: a temporary folder)",
    )
    parser.add_argument(
        "--models",
        default="",
        help="comma-separated model files its loaders list (FOLDER:NAME for one folder: "
        "checkpoints, loras, vae, diffusion_models, text_encoders, controlnet, "
        "upscale_models; a bare name is in every folder)",
    )
    parser.add_argument(
        "--model-load-s",
        type=float,
        default=0.0,
        help="seconds a loader takes for a model file not loaded",
    )
    parser.add_argument(
        "--resident", type=int, default=1, help="model files kept loaded (least recently used goes)"
    )
    parser.add_argument(
        "--default-word",
        default="ok",
        help="the script word of every prompt once --script is used up (disk: every prompt "
        "fails with a full output disk; cuda: with a CUDA fault; error: with an IndexError)",
    )
    parser.add_argument("--log-level", default="WARNING")
    return parser.parse_args(argv)


async def _serve(fake: FakeComfy, port: int, host: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with fake.serve(port=port, host=host) as url:
        print(f"fake_comfy listening on {url}", flush=True)
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    """Runs the fake until SIGINT / SIGTERM; returns the exit status (0)."""
    args = _parse(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s"
    )
    words = [w for w in args.script.split(",") if w.strip()]
    try:
        fake = FakeComfy(
            script=words,
            prompt_seconds=args.prompt_seconds,
            busy=args.busy,
            output_dir=args.output_dir,
            input_dir=args.input_dir,
            models=[m for m in args.models.split(",") if m.strip()],
            model_load_s=args.model_load_s,
            resident=args.resident,
            default_word=args.default_word,
        )
    except ValueError as ex:
        print(f"fake_comfy: {ex}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(fake, args.port, args.host))
    except OSError as ex:  # the port is taken, the host is not ours: say so, no traceback
        print(
            f"fake_comfy: cannot listen on {args.host}:{args.port}: {ex.strerror}", file=sys.stderr
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
