"""Shared fixtures: an isolated data root per test, one converted copy of the real model."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from eagle3_assets.paths import REPO_ROOT, DataLayout  # noqa: E402

# The converted model is shared with `make demo` so it is dequantized once per checkout.
MODEL_CACHE = Path(os.environ.get("EAGLE3_MODEL_CACHE") or REPO_ROOT / "data" / "models")
os.environ["EAGLE3_MODEL_CACHE"] = str(MODEL_CACHE)


def pytest_report_header(config):
    from eagle3_assets.target.vllm_server import default_python, vllm_available

    if vllm_available():
        lines = [f"vllm: {default_python()}: tests marked vllm start real vLLM servers"]
    else:
        lines = ["vllm: no environment (run `make vllm`): tests marked vllm are SKIPPED"]
    return [*lines, slurm_report_line()]


# ---- SLURM (tests marked slurm): a real one-node cluster for the session --------------------------
# Skipped where Debian's slurm-wlm/munge are missing or cannot start (not root); under CI=true that
# is a failure instead, so a CI box that lost its scheduler cannot pass by skipping.


def slurm_report_line() -> str:
    from eagle3_assets.testing.slurm_cluster import missing_binaries

    missing = missing_binaries()
    if missing:
        return f"slurm: not installed ({', '.join(missing)}; apt-get install slurm-wlm munge): tests marked slurm are SKIPPED"
    return "slurm: installed: tests marked slurm start a private one-node cluster (munged, slurmctld, slurmd)"


def _skip_or_fail(reason: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged, slurmctld and slurmd under a private folder; SLURM_CONF points every command at them."""
    from eagle3_assets.testing.slurm_cluster import SlurmClusterError, missing_binaries, start, stop

    missing = missing_binaries()
    if missing:
        _skip_or_fail(f"SLURM is not installed ({', '.join(missing)}): apt-get install slurm-wlm munge")
    try:
        cluster = start(tmp_path_factory.mktemp("slurm"))
    except SlurmClusterError as exc:
        _skip_or_fail(f"SLURM cannot start here: {exc}")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        stop(cluster)
        if old is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = old


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from eagle3_assets.target.embedded import ensure_default_model

    return ensure_default_model(MODEL_CACHE)


@pytest.fixture(scope="session")
def kimi_mini_dir() -> Path:
    """The kimi-mini target, built once into the shared model cache (about 20 s)."""
    from eagle3_assets.target.kimi_mini import ensure_kimi_mini

    return ensure_kimi_mini(MODEL_CACHE)


@pytest.fixture(scope="session")
def target_tokenizer(model_dir):
    from eagle3_assets.tokens.tokenizer import TargetTokenizer

    return TargetTokenizer.load(model_dir)


@pytest.fixture(scope="session")
def embedded(model_dir):
    from eagle3_assets.target.embedded import EmbeddedModel

    return EmbeddedModel(model_dir)


@pytest.fixture
def layout(tmp_path, monkeypatch) -> DataLayout:
    root = tmp_path / "data"
    monkeypatch.setenv("EAGLE3_HOME", str(root))
    return DataLayout(root)


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def small_prompts(n: int, prefix: str = "q") -> list[dict]:
    """Prompts the 135M model answers in a few tokens, so most responses end on a stop token."""
    return [
        {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"What is {i + 2}+{i + 3}? Answer with a number only."}]}
        for i in range(n)
    ]


@pytest.fixture
def serve():
    """Start loopback servers in threads (``serve(app)`` returns one); all are stopped at the end."""
    from eagle3_assets.testing.loopback import serve_in_thread

    started = []

    def start(app):
        srv = serve_in_thread(app)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="module")
def one_torch_thread():
    """This process keeps one core and leaves the other to a server it started."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
