"""Running vLLM servers (or any OpenAI-compatible server that returns token ids), reached over HTTP."""

import dagster as dg


class VLLMResource(dg.ConfigurableResource):
    """Two kinds of server, started outside Dagster (``python -m eagle3_assets.engines.vllm.server``):

    - ``base_urls``: servers for generation (``/v1/chat/completions`` with ``return_token_ids``);
      ``endpoint: completions`` sends the locally rendered prompt ids instead of messages.
    - ``extraction_urls``: a server started for hidden-state extraction (the
      ``extract_hidden_states`` speculative method and a KV connector writing safetensors files);
      this process reads the files at the paths the server returns, so both must see the same
      filesystem (the vLLM engine's extract role, ``eagle3_assets/engines/vllm/roles.py``, reaches them).

    The model asked for is the target's ``served_name`` when the server lists it, else the one
    model the server serves (the target resource is the only place the model is named).
    """

    base_urls: list[str] = ["http://127.0.0.1:8000/v1"]
    extraction_urls: list[str] = ["http://127.0.0.1:8001/v1"]
    api_key: str = ""  # only if the server was started with --api-key
    endpoint: str = "chat"  # "chat" or "completions"
    connections_per_client: int = 10
    read_timeout_s: float = 900.0
    extraction_concurrency: int = 8  # requests in flight per extraction batch
    max_in_flight_per_url: int = 256  # each server's own gate, for all datasets of a run together

    def default_in_flight(self) -> int:
        return self.max_in_flight_per_url * max(1, len(self.base_urls))
