"""Small PNG plots embedded in asset metadata as Markdown images (the UI renders them)."""

from __future__ import annotations

import base64
import io


def png_markdown(fig, alt: str) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    return f"![{alt}](data:image/png;base64,{base64.b64encode(buf.getvalue()).decode('ascii')})"


def length_histogram(lengths_by_source: dict[str, list[int]], title: str, limit: int | None = None) -> str:
    """Completion-length histogram per source, as a Markdown image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for source, lengths in sorted(lengths_by_source.items()):
        if lengths:
            ax.hist(lengths, bins=30, alpha=0.6, label=f"{source} ({len(lengths)})")
    if limit:
        ax.axvline(limit, color="black", linestyle="--", linewidth=1, label="max tokens")
    ax.set_xlabel("completion tokens")
    ax.set_ylabel("responses")
    ax.set_title(title)
    ax.legend(fontsize=8)
    try:
        return png_markdown(fig, title)
    finally:
        plt.close(fig)
