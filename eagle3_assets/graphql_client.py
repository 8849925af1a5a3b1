"""A small GraphQL client for a running Dagster webserver: add dataset partitions, launch and
watch partition backfills. Used by ``eagle3 backfill`` and the UI tests."""

from __future__ import annotations

import json
import time

import httpx

DEFAULT_URL = "http://127.0.0.1:3000"
LOCATION = "eagle3_assets"
REPOSITORY = "__repository__"
PARTITIONS_DEF = "datasets"


class WebserverError(RuntimeError):
    pass


class DagsterWebserver:
    def __init__(self, url: str = DEFAULT_URL, timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, query: str, variables: dict | None = None) -> dict:
        try:
            r = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables or {}},
                           timeout=self.timeout)
        except httpx.TransportError as e:
            raise WebserverError(
                f"no Dagster webserver at {self.url} ({type(e).__name__}); start one with `eagle3 ui` or `make ui`, "
                f"or pass --url"
            ) from None
        if r.status_code != 200:
            raise WebserverError(f"{self.url}/graphql answered HTTP {r.status_code}: {r.text[:500]}")
        body = r.json()
        if body.get("errors"):
            raise WebserverError(f"GraphQL errors: {json.dumps(body['errors'])[:1000]}")
        return body["data"]

    def server_info(self) -> dict:
        r = httpx.get(f"{self.url}/server_info", timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def add_partition(self, dataset: str) -> None:
        data = self.query(
            """mutation($sel: RepositorySelector!, $def: String!, $key: String!) {
                 addDynamicPartition(repositorySelector: $sel, partitionsDefName: $def, partitionKey: $key) {
                   __typename ... on Error { message } } }""",
            {"sel": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}, "def": PARTITIONS_DEF,
             "key": dataset},
        )["addDynamicPartition"]
        if data["__typename"] not in ("AddDynamicPartitionSuccess", "DuplicateDynamicPartitionError"):
            raise WebserverError(f"adding partition {dataset!r}: {data.get('message', data['__typename'])}")

    def launch_backfill(self, datasets: list[str], assets: list[str], run_config: dict | None = None,
                        title: str | None = None) -> str:
        params = {
            "partitionNames": list(datasets),
            "assetSelection": [{"path": a.split("/")} for a in assets],
            "title": title or f"eagle3: {', '.join(datasets)}",
        }
        if run_config:
            params["runConfigData"] = run_config
        data = self.query(
            """mutation($params: LaunchBackfillParams!) {
                 launchPartitionBackfill(backfillParams: $params) {
                   __typename ... on LaunchBackfillSuccess { backfillId } ... on Error { message } } }""",
            {"params": params},
        )["launchPartitionBackfill"]
        if data["__typename"] != "LaunchBackfillSuccess":
            raise WebserverError(f"backfill not launched: {data['__typename']}: {data.get('message', '')}")
        return data["backfillId"]

    def backfill_status(self, backfill_id: str) -> dict:
        data = self.query(
            """query($id: String!) { partitionBackfillOrError(backfillId: $id) {
                 __typename ... on PartitionBackfill { id status runs { runId status } }
                 ... on Error { message } } }""",
            {"id": backfill_id},
        )["partitionBackfillOrError"]
        if data["__typename"] != "PartitionBackfill":
            raise WebserverError(f"backfill {backfill_id}: {data.get('message', data['__typename'])}")
        return data

    def wait_for_backfill(self, backfill_id: str, timeout: float = 600, poll: float = 2.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.backfill_status(backfill_id)
            runs_done = all(r["status"] in ("SUCCESS", "FAILURE", "CANCELED") for r in status["runs"])
            if status["status"] not in ("REQUESTED", "CANCELING") and runs_done:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"backfill {backfill_id} still {status['status']} after {timeout:.0f}s: {status}")
            time.sleep(poll)
