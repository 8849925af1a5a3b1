"""The processor files of a Kimi-K2.5 checkpoint, for kimi-mini.

Engines read them before serving even text: vLLM's ``KimiK25ForConditionalGeneration`` builds
its image processor from ``preprocessor_config.json`` at start (its CPU build uses its own fused
processor over ``media_proc_cfg`` when numba is installed, else the checkpoint's remote code),
and SGLang loads the two remote-code classes the file names. The layout is K2.5's: an
``auto_map`` to ``kimi_k25_vision_processing.KimiK25VisionProcessor`` and
``kimi_k25_processor.KimiK25Processor``, no ``image_processor_type``, and ``media_proc_cfg``
with K2.5's values (from public K2.5-derived copies; the official file was not reachable). The
two classes are this project's own, small and image-only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HERE = Path(__file__).parent
REMOTE_CODE = ("kimi_k25_vision_processing.py", "kimi_k25_processor.py")
AUTO_MAP = {"AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
            "AutoProcessor": "kimi_k25_processor.KimiK25Processor"}
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384, "patch_size": 14, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2, "fixed_output_tokens": None, "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "sample_fps": 2.0,
    "max_num_frames_each_video": None, "temporal_merge_kernel_size": 4, "timestamp_mode": "hh:mm:ss.fff",
}


def write_processor(out_dir: Path) -> None:
    out_dir = Path(out_dir)
    config = {"auto_map": AUTO_MAP, "media_proc_cfg": MEDIA_PROC_CFG}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in REMOTE_CODE:
        shutil.copyfile(HERE / name, out_dir / name)
