"""kimi-mini's image processor, shipped as remote code under the class name Kimi-K2.5's
``preprocessor_config.json`` names (``kimi_k25_vision_processing.KimiK25VisionProcessor``).

Images only, sized as K2.5 sizes them: scale down until the image has at most
``in_patch_limit`` patches of ``patch_size`` and at most ``patch_limit_on_one_side`` patches on
a side, pad right and bottom to a multiple of ``merge_kernel_size * patch_size``, one token per
merged block. ``preprocess`` returns ``pixel_values`` [patches, 3, patch, patch] (row-major)
and ``grid_thws`` [images, 3]. Video chunks are not implemented (kimi-mini is served for text).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from transformers.image_processing_utils import BaseImageProcessor


class KimiK25VisionProcessor(BaseImageProcessor):
    model_type = "kimi_k25"

    def __init__(self, media_proc_cfg: dict | None = None, **kwargs):
        super().__init__(**kwargs)
        self.media_proc_cfg = dict(media_proc_cfg or {})
        merge = self.media_proc_cfg.get("merge_kernel_size", 2)
        self.media_proc_cfg["merge_kernel_size"] = int(merge[0] if isinstance(merge, (list, tuple)) else merge)
        self.num_frames_per_chunk = self.media_proc_cfg.get("temporal_merge_kernel_size", 4)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        config = {k: v for k, v in config_dict.items() if k not in kwargs and k != "auto_map"}
        return cls(media_proc_cfg=config.pop("media_proc_cfg", {}), **config, **kwargs)

    def to_dict(self) -> dict:
        out = super().to_dict()
        out["media_proc_cfg"] = self.media_proc_cfg
        return out

    def resize_config(self, width: int, height: int) -> dict:
        c = self.media_proc_cfg
        patch, side = c["patch_size"], c["patch_limit_on_one_side"]
        scale = min(1.0, math.sqrt(c["in_patch_limit"] / (max(1, width // patch) * max(1, height // patch))),
                    side * patch / width, side * patch / height)
        new_w = min(max(1, int(width * scale)), side * patch)
        new_h = min(max(1, int(height * scale)), side * patch)
        block = c["merge_kernel_size"] * patch
        pad_w, pad_h = -new_w % block, -new_h % block
        tokens = c.get("fixed_output_tokens") or ((new_w + pad_w) // block) * ((new_h + pad_h) // block)
        return {"new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h, "num_tokens": tokens}

    def media_tokens_calculator(self, media: dict) -> int:
        if media.get("type", "image") != "image":
            raise NotImplementedError("kimi-mini's processor handles images only")
        width, height = media["image"].size
        return self.resize_config(width, height)["num_tokens"]

    def preprocess(self, medias, return_tensors=None, **kwargs) -> BatchFeature:
        from PIL import Image

        c = self.media_proc_cfg
        patch = c["patch_size"]
        mean, std = np.asarray(c["image_mean"], np.float32), np.asarray(c["image_std"], np.float32)
        pixels, grids = [], []
        for media in medias if isinstance(medias, list) else [medias]:
            image = media["image"] if isinstance(media, dict) else media
            r = self.resize_config(*image.size)
            arr = np.asarray(image.convert("RGB").resize((r["new_width"], r["new_height"]), Image.Resampling.BICUBIC))
            arr = (arr.astype(np.float32) / 255.0 - mean) / std
            arr = np.pad(arr, ((0, r["pad_height"]), (0, r["pad_width"]), (0, 0)))
            gh, gw = arr.shape[0] // patch, arr.shape[1] // patch
            patches = arr.reshape(gh, patch, gw, patch, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, patch, patch)
            pixels.append(torch.from_numpy(np.ascontiguousarray(patches)))
            grids.append([1, gh, gw])
        return BatchFeature(data={"pixel_values": torch.cat(pixels), "grid_thws": torch.tensor(grids)},
                            tensor_type=return_tensors)
