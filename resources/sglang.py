"""A running SGLang server (or several, for data parallelism), reached over HTTP."""

import dagster as dg


class SGLangResource(dg.ConfigurableResource):
    """``POST /generate`` with locally rendered prompt ids; ``output_ids`` kept as returned.
    Start the servers outside Dagster (or try `python -m eagle3_assets.loopback sglang`).

    ``skip_special_tokens``, ``spaces_between_special_tokens`` and ``no_stop_trim`` are SGLang's
    sampling options that shape the returned ``text`` (never ``output_ids``). The text is only
    used to calibrate re-tokenization, so the defaults ask for the text closest to the ids: special
    tokens kept, no spaces inserted around added tokens (Kimi's ``<think>``/``</think>``), the stop
    token trimmed. SGLang's own defaults (true, true, false) make Kimi rows drift from their ids.

    ``max_in_flight_per_url`` is each server's own gate: a run keeps that many requests in flight
    on every base URL, for all its datasets together."""

    base_urls: list[str] = ["http://127.0.0.1:30000"]
    api_key: str = ""  # only if the server was started with --api-key
    health_check: bool = True
    # SGLang before 0.5.23 could leak the prompt tail into output_ids (sgl-project/sglang#10896); the
    # supported 0.5.23 does not (tests/integration/sglang/test_sglang_engine.py), so the repair is for older servers only
    repair_prefix_bug: bool = False
    max_in_flight_per_url: int = 256
    connections_per_client: int = 10
    read_timeout_s: float = 900.0
    skip_special_tokens: bool = False
    spaces_between_special_tokens: bool = False
    no_stop_trim: bool = False

    def text_options(self) -> dict:
        return {"skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "no_stop_trim": self.no_stop_trim}

    def default_in_flight(self) -> int:
        return self.max_in_flight_per_url * max(1, len(self.base_urls))
