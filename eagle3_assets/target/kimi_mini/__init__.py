"""``kimi-mini``: a Kimi-K2.5-shaped target the project builds itself (see ``model.py`` and
``tokenizer.py``), cached under the models directory like the SmolLM2 conversion."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

NAME = "Kimi-K2.5-mini"
VERSION = "5"  # bump when the builder's output changes in a way its files do not show


def builder_stamp(folder: Path | None = None) -> str:
    """What a cached copy was built by: the version and a digest of every file of this package
    (template, tokenizer code, BPE corpus, model builder), so an edited builder never leaves a
    stale cached copy in use."""
    h = hashlib.sha256()
    for f in sorted((folder or Path(__file__).parent).iterdir()):
        if f.is_file() and f.suffix in {".py", ".jinja", ".txt"}:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return f"kimi-mini builder v{VERSION} {h.hexdigest()[:16]}"


def ensure_kimi_mini(models_dir: Path) -> Path:
    """The cached ``kimi-mini`` directory, built on first use (atomically: a temporary sibling
    renamed into place, so a crash or a concurrent builder never leaves half a checkpoint)."""
    out = Path(models_dir) / NAME
    stamp = out / "SOURCE"
    if stamp.is_file() and stamp.read_text().strip() == builder_stamp():
        return out
    from eagle3_assets.target.kimi_mini.model import write_model
    from eagle3_assets.target.kimi_mini.processor import write_processor
    from eagle3_assets.target.kimi_mini.tokenizer import write_tokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        facts = write_tokenizer(tmp)
        write_model(tmp, facts["text_ids"])
        write_processor(tmp)
        tmp.chmod(0o755)
        (tmp / "SOURCE").write_text(builder_stamp() + "\n")
        old = out.with_name(out.name + f".old-{tmp.name[-8:]}")
        if out.exists():
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "SOURCE").is_file():
                raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
