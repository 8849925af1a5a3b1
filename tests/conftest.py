"""Shared fixtures: an isolated data root per test, one converted copy of the real model; and
what tests need that a machine may lack (``NEEDS``), skipped by ``make test``, fatal under CI."""

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from eagle3_assets.paths import REPO_ROOT, DataLayout  # noqa: E402

# Session fixtures: the small drafters several engine tests share, each trained once per session, and
# the demo recipe's datasets the demo drafter's tests train on, generated once per session.
pytest_plugins = ["tests.support.shared_drafters", "tests.support.demo_data"]

# The converted model is shared with `make demo` so it is dequantized once per checkout.
MODEL_CACHE = Path(os.environ.get("EAGLE3_MODEL_CACHE") or REPO_ROOT / "data" / "models")
os.environ["EAGLE3_MODEL_CACHE"] = str(MODEL_CACHE)


def _vllm() -> str | None:
    from eagle3_assets.engines.vllm.server import default_python, vllm_available

    return default_python() if vllm_available() else None


def _sglang() -> str | None:
    from eagle3_assets.engines.sglang.server import default_python, sglang_available

    return default_python() if sglang_available() else None


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None
    return _chromium()


def _browser_missing() -> str:
    if not _chromium():
        return "no Chromium browser on PATH (apt-get install -y chromium)"
    return "playwright is not installed (pip install -e '.[test]')"


def _gpu() -> str | None:
    import torch

    return f"cuda ({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else None


def _slurm() -> str | None:
    from tests.support.slurm_cluster import missing_binaries

    return None if missing_binaries() else shutil.which("slurmctld")


def _slurm_missing() -> str:
    from tests.support.slurm_cluster import missing_binaries

    return f"SLURM is not installed ({', '.join(missing_binaries())}): apt-get install slurm-wlm munge"


def _mount() -> str | None:
    from tests.support.small_fs import can_mount

    return can_mount()


@dataclass(frozen=True)
class Need:
    find: Callable[[], str | None]  # where the thing is, or None
    missing: str | Callable[[], str]  # what is missing and what to do about it
    ci_has: bool = True  # False: CI's machines never have it, so its tests are skipped under CI=true too

    def why(self) -> str:
        return self.missing() if callable(self.missing) else self.missing


# What tests marked with each key need. A plain `make test` skips them when it is missing and says
# so; under CI=true a missing one fails each such test with the reason, so CI cannot pass by skipping.
# Another kind joins with one line here (and its marker in pyproject.toml).
NEEDS = {
    "vllm": Need(_vllm, "no vLLM environment (.venv-vllm): run `make vllm`"),
    "sglang": Need(_sglang, "no SGLang environment (.venv-sglang): run `make sglang`"),
    "browser": Need(_browser, _browser_missing),
    "slurm": Need(_slurm, _slurm_missing),
    "gpu": Need(_gpu, "no CUDA GPU visible to torch (CI has none)", ci_has=False),
    "mount": Need(_mount, "cannot mount a small tmpfs here (a full disk for real needs root or CAP_SYS_ADMIN)"),
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


_FOUND = pytest.StashKey[dict]()


def _found(config, name: str) -> str | None:
    cache = config.stash.setdefault(_FOUND, {})
    if name not in cache:
        cache[name] = NEEDS[name].find()
    return cache[name]


def pytest_report_header(config):
    lines = []
    for name, need in NEEDS.items():
        where = _found(config, name)
        if where:
            lines.append(f"{name}: {where}: tests marked {name} run")
        else:
            then = "FAIL (CI=true)" if in_ci() and need.ci_has else "are SKIPPED"
            lines.append(f"{name}: {need.why()}: tests marked {name} {then}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before any fixture starts (a server, a webserver): skip, or under CI fail, what cannot run here."""
    for name, need in NEEDS.items():
        if item.get_closest_marker(name) is not None and not _found(item.config, name):
            if in_ci() and need.ci_has:
                pytest.fail(f"CI=true and this test needs {name}: {need.why()}", pytrace=False)
            pytest.skip(f"{need.why()} (tests marked {name})")


def _skip_or_fail(reason: str):
    if in_ci():
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


# A real one-node SLURM for the session (tests marked slurm); it may be installed and still not
# start (not root): skipped then, or under CI=true failed.
@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """munged, slurmctld and slurmd under a private folder; SLURM_CONF points every command at them."""
    from tests.support.slurm_cluster import SlurmClusterError, missing_binaries, start, stop

    if missing_binaries():
        _skip_or_fail(_slurm_missing())
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
    from eagle3_assets.target.tokenizer import TargetTokenizer

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
    from eagle3_assets.loopback import serve_in_thread

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
