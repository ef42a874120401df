"""The tokenizer side of images: each vision-language architecture's processor (HF's image
processor for the pixels, our own expansion of the prompt's placeholder into the model's token
layout), and `ImagePrompts`, which turns a prompt's token ids and its images into the ids the
scheduler runs (pad values at the image rows) and one `MultimodalItem` per image.

Preprocessed images are cached by content hash (bounded in bytes), so a repeated image costs a
decode and a hash, not a resize and normalization.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from PIL import Image

from srt.models.multimodal import MultimodalItem
from srt.multimodal.media import MediaError, MediaLimits, load_image

if TYPE_CHECKING:
    from srt.server_args import ServerArgs


@dataclass
class Processed:
    ids: list[int]  # the placeholder's expansion
    data: dict[str, torch.Tensor]  # what the model's encoder reads
    grid: tuple[int, int, int] | None = None  # M-RoPE: the rows' (frames, rows, columns)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.data.values()) + 8 * len(self.ids)


class Idefics3Images:
    """Idefics3 / SmolVLM: the image is split into a grid of tiles of the encoder's size (HF's image
    processor decides the grid), each tile `image_seq_len` `<image>` tokens after a
    `<fake_token_around_image><row_r_col_c>` marker, rows ended by a newline, then the whole image
    shrunk to one tile after `<global-img>` (an unsplit image is the global tile alone)."""

    def __init__(self, path: str, config, tokenizer):
        from transformers import Idefics3ImageProcessorPil

        self.tokenizer = tokenizer
        self.token_id = config.image_token_id
        vision = config.vision_config
        self.seq_len = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            self.pixels = Idefics3ImageProcessorPil.from_pretrained(path)
        else:  # the model's own tile size; images up to 4 x 4 tiles, as SmolVLM ships
            edge = vision.image_size
            self.pixels = Idefics3ImageProcessorPil(
                size={"longest_edge": 4 * edge}, max_image_size={"longest_edge": edge}
            )

    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.token_id)

    def process(self, image: Image.Image) -> Processed:
        out = self.pixels([[image]], return_tensors="pt", return_row_col_info=True)  # pyright: ignore[reportCallIssue]
        rows, cols = out["rows"][0][0], out["cols"][0][0]
        image_run = "<image>" * self.seq_len
        fake, glob = "<fake_token_around_image>", "<global-img>"
        text = "".join(
            "".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image_run}" for c in range(cols)) + "\n" for r in range(rows)
        )
        text += ("\n" if rows else "") + f"{fake}{glob}{image_run}{fake}"
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        data = {
            "pixel_values": out["pixel_values"][0].float().contiguous(),
            "pixel_attention_mask": out["pixel_attention_mask"][0].bool().contiguous(),
        }
        return Processed(ids, data)


class LlavaImages:
    """LLaVA (1.5): the image resized and center-cropped to the CLIP tower's square; its placeholder
    is repeated once per patch feature."""

    def __init__(self, path: str, config, tokenizer):
        from transformers import CLIPImageProcessorPil

        from srt.models.llava_vision import tokens_per_image

        self.tokenizer = tokenizer
        self.token_id = config.image_token_id
        self.count = tokens_per_image(config)
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            self.pixels = CLIPImageProcessorPil.from_pretrained(path)
        else:
            side = config.vision_config.image_size
            self.pixels = CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})

    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.token_id)

    def process(self, image: Image.Image) -> Processed:
        out = self.pixels(image, return_tensors="pt")
        return Processed([self.token_id] * self.count, {"pixel_values": out["pixel_values"].float().contiguous()})


class Qwen2VLImages:
    """Qwen2-VL: the image resized (keeping its aspect) to a multiple of patch x merge pixels within
    the processor's pixel bounds, cut into patches; one `<|image_pad|>` row per merge window. The
    rows' grid gives their M-RoPE positions."""

    def __init__(self, path: str, config, tokenizer):
        from transformers import Qwen2VLImageProcessorPil

        self.tokenizer = tokenizer
        self.token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        if os.path.isfile(os.path.join(path, "preprocessor_config.json")):
            self.pixels = Qwen2VLImageProcessorPil.from_pretrained(path)
        else:
            vc = config.vision_config
            self.pixels = Qwen2VLImageProcessorPil(
                patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=self.merge
            )

    def placeholder(self) -> str:
        return self.tokenizer.convert_ids_to_tokens(self.token_id)

    def process(self, image: Image.Image) -> Processed:
        out = self.pixels(images=[image], return_tensors="pt")
        grid = out["image_grid_thw"]
        t, h, w = (int(x) for x in grid[0])
        rows = t * h * w // self.merge**2
        data = {"pixel_values": out["pixel_values"].float().contiguous(), "image_grid_thw": grid.long()}
        return Processed([self.token_id] * rows, data, (t, h // self.merge, w // self.merge))


PROCESSORS = {
    "Qwen2VLForConditionalGeneration": Qwen2VLImages,
    "Idefics3ForConditionalGeneration": Idefics3Images,
    "LlavaForConditionalGeneration": LlavaImages,
}


class ImageCache:
    """Processed images by content hash, least recently used out past `capacity` bytes."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: OrderedDict[int, Processed] = OrderedDict()
        self.bytes = 0

    def get(self, key: int) -> Processed | None:
        if (hit := self.entries.get(key)) is not None:
            self.entries.move_to_end(key)
        return hit

    def put(self, key: int, value: Processed) -> None:
        size = value.nbytes
        if size > self.capacity or key in self.entries:
            return
        while self.bytes + size > self.capacity:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.nbytes
        self.entries[key] = value
        self.bytes += size


def content_key(image: Image.Image) -> int:
    """64 bits of a hash of the decoded pixels (the same picture in another file format is the same
    image; a different picture is, with overwhelming probability, a different key)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(bytes(image.getpalette() or ()))  # a palette image's colors are not in its pixels
    h.update(image.tobytes())
    return int.from_bytes(h.digest(), "little")


class ImagePrompts:
    """One model's image inputs: its processor, the limits, the processed-image cache."""

    def __init__(
        self, architecture: str, path: str, config, tokenizer, limits: MediaLimits, max_images: int, cache_bytes: int
    ):
        self.architecture = architecture
        self.processor = PROCESSORS[architecture](path, config, tokenizer)
        self.limits = limits
        self.max_images = max_images
        self.cache = ImageCache(cache_bytes)

    @property
    def token_id(self) -> int:
        return self.processor.token_id

    def expand(self, ids: list[int], sources: list, labels: list[str]) -> tuple[list[int], list[MultimodalItem]]:
        """The prompt with its i-th image placeholder expanded for sources[i] (pads at the image
        rows), and the images' items. Blocking (reads files and URLs, decodes, resizes): run it in
        a worker thread."""
        if len(sources) > self.max_images:
            raise MediaError(
                f"{labels[self.max_images]}: the request has {len(sources)} images, more than the limit of "
                f"{self.max_images} (--max-images-per-request)"
            )
        slots = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(slots) != len(sources):
            raise MediaError(
                f"the prompt has {len(slots)} image placeholder(s) ({self.processor.placeholder()!r}, token "
                f"{self.token_id}) for {len(sources)} image(s); put one placeholder where each image goes"
            )
        out: list[int] = []
        items: list[MultimodalItem] = []
        prev = 0
        for slot, src, label in zip(slots, sources, labels):
            image = load_image(src, label, self.limits)
            key = content_key(image)
            processed = self.cache.get(key)
            if processed is None:
                try:
                    processed = self.processor.process(image)
                except Exception as e:  # a processor's own refusal (an odd aspect ratio, a mode it cannot read)
                    raise MediaError(f"{label}: the image could not be preprocessed: {e}") from None
                self.cache.put(key, processed)
            out += ids[prev:slot]
            start = len(out)
            spans = _runs(processed.ids, self.token_id, start)
            item = MultimodalItem(
                key=key, token_id=self.token_id, spans=spans, data=processed.data, grid=processed.grid
            )
            out += [item.pad_value if t == self.token_id else t for t in processed.ids]
            items.append(item)
            prev = slot + 1
        out += ids[prev:]
        return out, items


def _runs(ids: list[int], token: int, offset: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `token` in ids, shifted by offset."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == offset + i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((offset + i, 1))
    return runs


def image_prompts_for(server_args: ServerArgs, tokenizer) -> ImagePrompts:
    """The served model's image inputs under the server's limits."""
    from srt.configs.model_config import load_hf_config

    path = server_args.model_path
    assert path is not None, "ServerArgs.model_path is required"
    config = load_hf_config(path)
    limits = MediaLimits(
        max_bytes=server_args.max_image_bytes,
        max_pixels=server_args.max_image_pixels,
        allow_remote=server_args.allow_remote_media,
        fetch_timeout=server_args.media_fetch_timeout,
    )
    archs = config.architectures or []
    assert archs, "ModelConfig.from_path refused a config without architectures at start-up"
    return ImagePrompts(
        archs[0],
        path,
        config,
        tokenizer,
        limits,
        server_args.max_images_per_request,
        server_args.mm_cache_size_mb << 20,
    )
