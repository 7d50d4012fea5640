"""Text to image on the fake: loaders, CLIPTextEncode, KSampler, VAEDecode, upscaling.

ComfyUI's default workflow (CheckpointLoaderSimple → CLIPTextEncode x2, EmptyLatentImage →
KSampler → VAEDecode → SaveImage, LoraLoader between loader and sampler if wanted) runs on
the fake and saves a solid image, as the fake's other nodes do: its size is the latent's,
its colour a hash of everything that changes a real picture (the model files and LoRA
strengths, both prompts' text, seed, steps, cfg, sampler, scheduler, denoise, size, the
VAE). The same inputs give the same bytes; a changed seed or prompt gives another colour.
ImageUpscaleWithModel passes the image on unchanged (the fake has no weights to read a
scale from).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from fake_comfy.nodes import Images, Latent


@dataclass(frozen=True)
class Weights:
    """A MODEL, CLIP, VAE or UPSCALE_MODEL: the files (and LoRA strengths) it came from."""

    kind: str
    files: tuple[str, ...]


@dataclass(frozen=True)
class Conditioning:
    """CLIPTextEncode's output: the text and the CLIP it was encoded with."""

    text: str
    clip: tuple[str, ...]


@dataclass(frozen=True)
class Sampled:
    """KSampler's LATENT: sizes in image pixels and a digest of what made it."""

    width: int
    height: int
    batch: int
    digest: str


def _f32(x: float) -> float:
    """A channel as float32 holds it (what the fake's images carry)."""
    return float(np.float32(x))


def _files(value: Any) -> tuple[str, ...]:
    return value.files if isinstance(value, Weights) else ()


def _digest(*parts: Any) -> str:
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _lora(inputs: dict[str, Any], target: str, strength: str) -> tuple[str, ...]:
    return (*_files(inputs.get(target)), f"{inputs['lora_name']}@{inputs[strength]}")


def compute(class_type: str, inputs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The outputs of a text-to-image node, or None for a node this module does not
    model (fake_comfy.nodes computes those)."""
    if class_type == "CheckpointLoaderSimple":
        ckpt = (str(inputs["ckpt_name"]),)
        return (Weights("MODEL", ckpt), Weights("CLIP", ckpt), Weights("VAE", ckpt))
    if class_type in ("UNETLoader", "CLIPLoader", "VAELoader", "UpscaleModelLoader"):
        kind = {"UNETLoader": "MODEL", "CLIPLoader": "CLIP", "VAELoader": "VAE"}
        name = next(
            inputs[n] for n in ("unet_name", "clip_name", "vae_name", "model_name") if n in inputs
        )
        return (Weights(kind.get(class_type, "UPSCALE_MODEL"), (str(name),)),)
    if class_type == "LoraLoader":
        return (
            Weights("MODEL", _lora(inputs, "model", "strength_model")),
            Weights("CLIP", _lora(inputs, "clip", "strength_clip")),
        )
    if class_type == "LoraLoaderModelOnly":
        return (Weights("MODEL", _lora(inputs, "model", "strength_model")),)
    if class_type == "CLIPTextEncode":
        return (Conditioning(str(inputs["text"]), _files(inputs.get("clip"))),)
    if class_type == "KSampler":
        latent = inputs.get("latent_image")
        if not isinstance(latent, Latent | Sampled):
            return None
        settings = {
            k: inputs.get(k)
            for k in ("seed", "steps", "cfg", "sampler_name", "scheduler", "denoise")
        }
        digest = _digest(
            _files(inputs.get("model")),
            repr(inputs.get("positive")),
            repr(inputs.get("negative")),
            settings,
            repr(latent),
        )
        return (Sampled(latent.width, latent.height, latent.batch, digest),)
    if class_type == "VAEDecode":
        samples = inputs.get("samples")
        if not isinstance(samples, Sampled):
            return None
        raw = bytes.fromhex(_digest(samples.digest, _files(inputs.get("vae")))[:6])
        pixel = (_f32(raw[0] / 0xFF), _f32(raw[1] / 0xFF), _f32(raw[2] / 0xFF))
        return (Images(samples.width, samples.height, samples.batch, pixel),)
    if class_type == "ImageUpscaleWithModel":
        image = inputs.get("image")
        return (image,) if isinstance(image, Images) else None
    return None
