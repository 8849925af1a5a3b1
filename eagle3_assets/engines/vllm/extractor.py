"""Hidden states through a running vLLM server (its ``extract_hidden_states`` speculative method).

The server (``python -m eagle3_assets.engines.vllm.server extract``) runs the target and, per
request, a KV connector writes ``<storage>/<request id>.safetensors`` holding ``token_ids`` [S] and
``hidden_states`` [S, n_layers, H] (float32, layers in ascending id order), after the response is
sent, while it holds an exclusive lock on ``<file>.lock``. This client sends each corpus sequence as the prompt (token ids
through ``/v1/completions``, one token generated, so the file covers exactly the sequence), waits
for the lock to be released, reads the file, checks its ids against the sequence, deletes it, and returns
the same :class:`Features` as the local extractor.

Layer numbering: vLLM's id k is the residual stream after k decoder layers (transformers
``hidden_states[k]``, 0 = embeddings); this project's id k is the output of decoder layer k, so it
asks vLLM for ``k + 1``. The final state EAGLE-3 stores is post-norm (the lm_head input); vLLM's id
``L`` (the layer count) is the last layer's output *before* the final norm, so the client applies the
target's final RMSNorm (weight and epsilon read from the checkpoint) in float32.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eagle3_assets.engines.roles import Features, check_features, check_rows
from eagle3_assets.target import layers as hidden_layers
from eagle3_assets.target.config import read_config, text_config

LOCK_SUFFIX = ".lock"


class VLLMExtractionError(RuntimeError):
    pass


def vllm_layer_ids(layer_ids: Sequence[int], n_layers: int) -> list[int]:
    """What the server must capture, in vLLM's numbering: the aux layers (ours + 1) and the last
    layer's pre-norm output (``n_layers``), ascending as vLLM stores them."""
    return [*hidden_layers.to_speculators_ids(list(layer_ids)), int(n_layers)]


def read_final_norm(model_dir: Path | str):
    """The target's final RMSNorm weight (float32) and epsilon, read from its safetensors files."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    text = text_config(read_config(model_dir))
    eps = text.get("rms_norm_eps")
    if eps is None:
        raise ValueError(f"{model_dir}/config.json has no rms_norm_eps: the vLLM backend normalizes the final "
                         "state with an RMSNorm and cannot for this architecture")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {k: model_dir / f for k, f in weight_map.items()}
    else:
        files = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                files.update({k: f for k in st.keys()})
    names = sorted((k for k in files if k.endswith("model.norm.weight") or k == "norm.weight"), key=len)
    if not names:
        raise ValueError(f"{model_dir}: no final norm weight (model.norm.weight) in the checkpoint")
    with safe_open(str(files[names[0]]), framework="pt") as st:
        weight = st.get_tensor(names[0]).to(torch.float32)
    return weight, float(eps)


def rms_norm(x, weight, eps: float):
    import torch

    x = x.to(torch.float32)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def wait_unlocked(path: Path, timeout_s: float) -> None:
    """Until the connector has written the file. The server creates ``<file>.lock`` and holds an
    exclusive ``flock`` on it before it returns the path, and releases it once the file is
    complete; a shared lock taken here therefore succeeds only then."""
    import fcntl

    lock = path.with_name(path.name + LOCK_SUFFIX)
    deadline = time.monotonic() + timeout_s
    delay = 0.002
    while True:
        try:
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:
            fd = None  # a server without the lock protocol (use_synchronization_lock false)
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                locked = False
            except BlockingIOError:
                locked = True
            finally:
                os.close(fd)
        else:
            locked = False
        if not locked and path.exists():
            return
        if time.monotonic() > deadline:
            raise VLLMExtractionError(f"{path}: the server did not finish writing it within {timeout_s:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def features_from_file(path: Path, ids: Sequence[int], n_aux: int, norm_weight, eps: float) -> Features:
    """aux [T, n_aux*H] and post-norm last [T, H] from one connector file, checked against ``ids``."""
    from safetensors.torch import load_file

    data = load_file(str(path))
    got = data["token_ids"].tolist()
    if got != list(ids):
        raise VLLMExtractionError(f"{path.name}: the server stored {len(got)} token ids that differ from the "
                                  f"{len(ids)} sent (was include_output_tokens set, or a tokenizer applied?)")
    states = data["hidden_states"]  # [T, n_aux + 1, H]
    if states.dim() != 3 or states.shape[1] != n_aux + 1:
        raise VLLMExtractionError(f"{path.name}: hidden_states {tuple(states.shape)}; the server must capture "
                                  f"{n_aux} aux layers + the last layer (start it with vllm_layer_ids)")
    t, _, h = states.shape
    return Features(states[:, :n_aux].reshape(t, n_aux * h), rms_norm(states[:, n_aux], norm_weight, eps))


class VLLMExtractor:
    """EAGLE-3 features from a vLLM extraction server; same contract as ``LocalExtractor``.

    ``base_urls``: the servers' ``/v1`` roots (several share the rows round-robin). Every server
    must have been started with ``vllm_layer_ids(layer_ids, L)`` (``VLLMServer(role="extract")``
    does it) and its storage folder must be visible here under the paths it returns.
    ``concurrency``: requests in flight (vLLM batches them into one forward step).
    """

    def __init__(self, base_urls, model_dir: Path | str, *, layer_ids: list[int] | None = None, model: str = "",
                 preferred_model: str = "",
                 api_key: str | None = None, concurrency: int = 8, read_timeout_s: float = 900.0,
                 file_timeout_s: float = 600.0, target: dict | None = None):
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("VLLMExtractor needs at least one base URL")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.model_dir = Path(model_dir)
        text = text_config(read_config(self.model_dir))
        self.hidden_size = int(text["hidden_size"])
        self.num_layers = int(text["num_hidden_layers"])
        self.vocab_size = int(text["vocab_size"])
        self.layer_ids = hidden_layers.resolve_layer_ids(self.num_layers, layer_ids)
        self.vllm_layer_ids = vllm_layer_ids(self.layer_ids, self.num_layers)
        self.norm_weight, self.eps = read_final_norm(self.model_dir)
        self.model = model
        self.preferred_model = preferred_model  # the target's served name, used when the server lists it
        self._api_key = api_key
        self.concurrency = max(1, int(concurrency))
        self.read_timeout_s = read_timeout_s
        self.file_timeout_s = file_timeout_s
        self._target = target
        self._client = None
        self._max_len: int | None = None
        self._next = 0
        self.files_read = 0

    def describe(self) -> dict:
        from eagle3_assets.target.identity import target_identity

        return {
            "target": self._target or target_identity(self.model_dir),
            "layers": hidden_layers.convention(self.layer_ids, self.num_layers),
            "backend": {
                "name": "vllm", "servers": self.base_urls, "model": self.model,
                "vllm_layer_ids": self.vllm_layer_ids,
                "mapping": "project id k (output of decoder layer k) = vLLM id k+1 (state after k+1 layers); "
                           f"final = RMSNorm(vLLM id {self.num_layers}) with the target's norm weight, "
                           f"eps {self.eps}, in float32",
            },
        }

    # -- HTTP -----------------------------------------------------------------------------
    def _connect(self):
        import httpx

        if self._client is not None:
            return self._client
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        client = httpx.Client(headers=headers, timeout=httpx.Timeout(self.read_timeout_s, connect=30.0),
                              limits=httpx.Limits(max_connections=self.concurrency * len(self.base_urls)))
        for url in self.base_urls:
            try:
                r = client.get(url + "/models")
            except httpx.HTTPError as e:
                client.close()
                raise VLLMExtractionError(f"{url}/models: {type(e).__name__}: {e} (is the extraction server up?)") from None
            if r.status_code != 200:
                client.close()
                raise VLLMExtractionError(f"{url}/models answered {r.status_code}")
            cards = r.json().get("data") or []
            names = [c.get("id") for c in cards]
            if self.model and self.model not in names:
                client.close()
                raise VLLMExtractionError(f"{url} serves {names}, not {self.model!r}")
            if not self.model and self.preferred_model in names:
                self.model = self.preferred_model
            if not self.model:
                if len(names) != 1:
                    client.close()
                    raise VLLMExtractionError(f"{url} serves {names}: name the model to use")
                self.model = names[0]
            lens = [c.get("max_model_len") for c in cards if c.get("id") == self.model and c.get("max_model_len")]
            if lens:
                self._max_len = min(lens + ([self._max_len] if self._max_len else []))
        self._client = client
        return client

    def _one(self, url: str, ids: list[int]) -> Features:
        client = self._client
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
        for attempt in range(1, 6):
            try:
                r = client.post(url + "/completions", json=body)
            except Exception as e:  # noqa: BLE001 - transport errors are retried, then reported
                if attempt == 5:
                    raise VLLMExtractionError(f"{url}/completions: {type(e).__name__}: {e}") from None
                time.sleep(0.5 * 2**attempt)
                continue
            if r.status_code >= 500 and attempt < 5:
                time.sleep(0.5 * 2**attempt)
                continue
            break
        if r.status_code != 200:
            raise VLLMExtractionError(f"{url}/completions answered {r.status_code} for a {len(ids)}-token sequence: "
                                      f"{r.text[:300]}")
        data = r.json()
        params = data.get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise VLLMExtractionError("the reply carries no kv_transfer_params.hidden_states_path: the server was not "
                                      "started for extraction (python -m eagle3_assets.engines.vllm.server extract)")
        path = Path(path)
        try:
            wait_unlocked(path, self.file_timeout_s)
            feat = features_from_file(path, ids, hidden_layers.N_AUX, self.norm_weight, self.eps)
        finally:
            path.unlink(missing_ok=True)  # the server never deletes its files
            path.with_name(path.name + LOCK_SUFFIX).unlink(missing_ok=True)
        self.files_read += 1
        return feat

    def extract(self, rows: Sequence[Sequence[int]]) -> list[Features]:
        client = self._connect()
        del client
        # the server generates one token after the sequence, so it needs one position more
        check_rows(rows, vocab_size=self.vocab_size, max_len=self._max_len - 1 if self._max_len else None)
        urls = [self.base_urls[(self._next + i) % len(self.base_urls)] for i in range(len(rows))]
        self._next += len(rows)
        lists = [[int(t) for t in r] for r in rows]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(rows))) as pool:
            feats = list(pool.map(self._one, urls, lists))
        check_features(feats, [len(r) for r in rows], self.hidden_size)
        return feats

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
