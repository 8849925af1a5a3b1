"""Start and stop a real SGLang server for the target, in the project's SGLang environment.

SGLang lives in its own virtual environment (``make sglang`` builds ``.venv-sglang``): its wheel pins a
CUDA torch and CUDA-only kernel packages. On a machine without a GPU the server runs SGLang's CPU
engine (``SGLANG_USE_CPU_ENGINE=1``) with what :mod:`eagle3_assets.engines.sglang.cpu` supplies on its
``PYTHONPATH``; on a GPU box the same class starts it with ``device="cuda"`` and nothing added.

``python -m eagle3_assets.engines.sglang.server --model DIR --port 30000`` starts one in the foreground
and prints the URL to give the ``sglang`` resource.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_assets.engines.process import ServerProcess, free_port
from eagle3_assets.engines.sglang.versions import require_supported_sglang
from eagle3_assets.engines.versions import EngineVersionError
from eagle3_assets.engines.vllm.server import PACKAGE_PARENT, ships_code
from eagle3_assets.processes import default_sigterm


class SGLangServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


def default_python() -> str:
    """The SGLang environment's interpreter: ``$EAGLE3_SGLANG_PYTHON``, else ``.venv-sglang`` in the repo."""
    return os.environ.get("EAGLE3_SGLANG_PYTHON") or str(PACKAGE_PARENT / ".venv-sglang" / "bin" / "python")


def sglang_available(python: str | None = None) -> bool:
    return Path(python or default_python()).is_file()


@functools.lru_cache(maxsize=8)
def installed_version(python: str) -> str:
    """The ``sglang`` version in that environment ('' when it has none)."""
    probe = "import importlib.metadata as m\ntry:\n    print(m.version('sglang'))\nexcept m.PackageNotFoundError:\n    pass"
    return subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()


def check_supported(python: str) -> str:
    """The environment's SGLang version, or :class:`EngineVersionError` when it is not the one the
    project supports (the server's internals the capture and the exports rely on change between releases)."""
    version = installed_version(python)
    if not version:
        raise EngineVersionError(f"no sglang in {python}: run `make sglang` (or set EAGLE3_SGLANG_PYTHON)")
    require_supported_sglang(version, python)
    return version


def serving_problem(version: str, model_dir: Path | str, drafter_dir: Path | str | None = None) -> str | None:
    """Why this SGLang cannot serve the target (and drafter export) before a server starts: a version
    too old for the target's family or for an MLA drafter (REQUIREMENTS in engines/sglang/versions.py), or a pairing it
    cannot serve."""
    import json

    from eagle3_assets.engines.versions import mla_draft_problem, pairing_problem, version_problem

    if drafter_dir is None:
        return None
    target = json.loads((Path(model_dir) / "config.json").read_text())
    drafter = json.loads((Path(drafter_dir) / "config.json").read_text())
    problem = version_problem("sglang", version, "eagle3", target)
    if problem is None and drafter.get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]:
        problem = mla_draft_problem("sglang", version)
    return problem or pairing_problem(target, drafter, engine="sglang")


@dataclass
class SGLangServer(ServerProcess):
    """One ``sglang.launch_server`` process. Use as a context manager, or ``start()`` / ``stop()``.

    The defaults are those that start on a 2-core CPU: float32 (greedy output equal to the project's
    own float32 decoding), torch-native attention, no CUDA graphs, a 4096-token KV pool.
    """

    model_dir: Path | str
    python: str = ""
    port: int = 0  # 0: a free port
    host: str = "127.0.0.1"
    device: str = "cpu"
    dtype: str = "float32"
    max_total_tokens: int = 4096
    attention_backend: str = "torch_native"  # on a CPU; "intel_amx" for SGLang's EAGLE worker (see docs/sglang.md)
    return_hidden_states: bool = False
    drafter_dir: Path | str | None = None  # an SGLang EAGLE-3 export: speculate with it (chain of speculative_steps)
    speculative_steps: int = 3
    speculative_topk: int = 1  # > 1: a draft tree of speculative_draft_tokens nodes per step
    speculative_draft_tokens: int = 0
    extra_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    workdir: Path | str | None = None  # private caches and the log; default a new temp folder
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _own_workdir: bool = field(default=False, init=False, repr=False)
    engine = "SGLang"
    error = SGLangServerError
    ready_probe_timeout_s = 60.0

    def __post_init__(self):
        self.python = self.python or default_python()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return Path(self.workdir) / "server.log"

    def command(self) -> list[str]:
        cmd = [self.python, "-m", "sglang.launch_server", "--model-path", str(Path(self.model_dir).resolve()),
               "--host", self.host, "--port", str(self.port), "--device", self.device, "--dtype", self.dtype,
               "--max-total-tokens", str(self.max_total_tokens), "--skip-server-warmup"]
        if self.device == "cpu":
            cmd += ["--disable-cuda-graph", "--mem-fraction-static", "0.1"] + self._cpu_attention_args()
        if self.return_hidden_states:
            cmd.append("--enable-return-hidden-states")
        if ships_code(self.model_dir):  # Kimi-K2.5's tokenizer and processor are remote code
            cmd.append("--trust-remote-code")
        if self.drafter_dir is not None:
            cmd += eagle3_args(Path(self.drafter_dir).resolve(), self.speculative_steps, self.speculative_topk,
                               self.speculative_draft_tokens)
        return cmd + list(self.extra_args)

    def _cpu_attention_args(self) -> list[str]:
        if self.attention_backend != "intel_amx":
            return ["--attention-backend", self.attention_backend]
        # SGLang swaps a base ``--attention-backend intel_amx`` for torch_native on a CPU without AMX
        # (overrides._attention_backend_platform_fallbacks); the split prefill/decode settings it reads
        # first are left as given, and its CPU kernels are the project's (engines/sglang/cpu), not AMX's.
        return ["--attention-backend", "torch_native", "--prefill-attention-backend", "intel_amx",
                "--decode-attention-backend", "intel_amx"]

    def environment(self) -> dict:
        from eagle3_assets.engines.sglang.cpu import server_environment

        work = Path(self.workdir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                    "TMPDIR": str(work / "tmp"), "HF_HOME": str(work / "hf"), "XDG_CACHE_HOME": str(work / "cache"),
                    "OUTLINES_CACHE_DIR": str(work / "outlines"), "SGLANG_DISABLE_REQUEST_LOGGING": "1"})
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env = server_environment(env)
        env.update({k: str(v) for k, v in self.env.items()})
        return env

    def start(self) -> SGLangServer:
        if not Path(self.python).is_file():
            raise SGLangServerError(f"no SGLang environment at {self.python}: run `make sglang` "
                                    "(or set EAGLE3_SGLANG_PYTHON)")
        version = check_supported(self.python)
        problem = serving_problem(version, self.model_dir, self.drafter_dir)
        if problem:
            raise EngineVersionError(problem)
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="eagle3-sglang-")
            self._own_workdir = True
        for sub in ("tmp", "hf", "cache", "outlines"):
            (Path(self.workdir) / sub).mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.environment(), cwd=str(self.workdir), start_new_session=True,
                                          preexec_fn=default_sigterm)  # stopped with SIGTERM (stop_group)
        return self

    def ready_url(self) -> str:
        return self.base_url + "/health_generate"  # a real one-token generation: 60-80 s from start on 2 idle cores


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Start an SGLang server for the target (foreground).")
    ap.add_argument("--model", required=True, help="the target's model directory")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--return-hidden-states", action="store_true")
    args = ap.parse_args(argv)
    server = SGLangServer(args.model, port=args.port, device=args.device, dtype=args.dtype,
                          return_hidden_states=args.return_hidden_states)
    with server:
        print(f"SGLang {installed_version(server.python)} ready: {server.base_url} (log {server.log_path})", flush=True)
        try:
            while server._proc is not None and server._proc.poll() is None:
                time.sleep(1.0)
        except KeyboardInterrupt:
            pass
    return 0


def eagle3_args(export_dir, k: int, topk: int = 1, draft_tokens: int = 0) -> list[str]:
    """The flags that make an SGLang server speculate with the EAGLE-3 export in ``export_dir``:
    ``k`` draft steps, by default a chain (top-k 1, ``k + 1`` tokens verified: the drafts and the
    step's own token); with ``topk`` > 1 a tree of ``draft_tokens`` nodes (root included)."""
    if topk > 1 and draft_tokens < 2:
        raise ValueError(f"a draft tree (topk {topk}) needs draft_tokens, the nodes verified per step")
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(export_dir),
            "--speculative-num-steps", str(k), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens if topk > 1 else k + 1)]


if __name__ == "__main__":
    raise SystemExit(main())
