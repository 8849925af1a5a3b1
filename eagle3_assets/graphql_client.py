"""A small GraphQL client for a running Dagster webserver: add dataset partitions, launch and
watch partition backfills and ranged runs. Used by ``eagle3 backfill`` and the UI tests."""

from __future__ import annotations

import json
import time

import httpx

DEFAULT_URL = "http://127.0.0.1:3000"
LOCATION = "eagle3_assets"
REPOSITORY = "__repository__"
PARTITIONS_DEF = "datasets"
ASSET_JOB = "__ASSET_JOB"  # the implicit job the UI launches asset selections through
RANGE_START, RANGE_END = "dagster/asset_partition_range_start", "dagster/asset_partition_range_end"
FINISHED = ("SUCCESS", "FAILURE", "CANCELED")


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

    def wait_for_code_location(self, proc=None, timeout: float = 600) -> None:
        """Block until every code location has loaded (``dagster dev`` just started): raise at once
        if ``proc`` (the webserver's process) exits or a location fails to load."""
        query = """{ workspaceOrError { __typename ... on Workspace { locationEntries { name
                     locationOrLoadError { __typename } } } } }"""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise WebserverError(f"dagster dev exited with {proc.returncode}")
            try:
                entries = self.query(query)["workspaceOrError"]["locationEntries"]
            except WebserverError:
                entries = None  # not serving yet
            kinds = [(e["locationOrLoadError"] or {}).get("__typename") for e in entries or []]
            if "PythonError" in kinds:
                raise WebserverError(f"code location failed to load: {entries}")
            if kinds and all(k == "RepositoryLocation" for k in kinds):
                return
            time.sleep(1)
        raise TimeoutError(f"{self.url}: the code location did not load within {timeout:.0f}s")

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

    def partition_keys(self, asset: str = "raw_responses") -> list[str]:
        """The asset's partition keys in their order (dynamic partitions: the order they were added)."""
        nodes = self.query("""query($keys: [AssetKeyInput!]) { assetNodes(assetKeys: $keys) { partitionKeys } }""",
                           {"keys": [{"path": asset.split("/")}]})["assetNodes"]
        return nodes[0]["partitionKeys"] if nodes else []

    def launch_range_run(self, first: str, last: str, assets: list[str], run_config: dict | None = None,
                         tags: dict[str, str] | None = None) -> str:
        """One run over the partitions ``first`` .. ``last``: what the UI's *Pass partition ranges to
        single run* launches. It goes straight to the run queue, with no backfill daemon tick (up to
        30 s) in between; every asset selected must have a single-run backfill policy."""
        return self.launch_run(assets, run_config, {RANGE_START: first, RANGE_END: last, **(tags or {})})

    def launch_run(self, assets: list[str], run_config: dict | None = None, tags: dict[str, str] | None = None) -> str:
        """One run of ``assets`` (``tags`` choose the partition: ``dagster/partition``); its run id."""
        params = {
            "selector": {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "jobName": ASSET_JOB,
                         "assetSelection": [{"path": a.split("/")} for a in assets]},
            "runConfigData": run_config or {},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]},
        }
        data = self.query(
            """mutation($params: ExecutionParams!) {
                 launchRun(executionParams: $params) {
                   __typename ... on LaunchRunSuccess { run { runId } }
                   ... on RunConfigValidationInvalid { errors { message } }
                   ... on PythonError { message } ... on Error { message } } }""",
            {"params": params},
        )["launchRun"]
        if data["__typename"] != "LaunchRunSuccess":
            detail = data.get("message") or "; ".join(e["message"] for e in data.get("errors", []))
            raise WebserverError(f"run not launched: {data['__typename']}: {detail}")
        return data["run"]["runId"]

    def terminate_run(self, run_id: str) -> None:
        """What the UI's *Terminate* button does: the run's steps are interrupted where they run."""
        data = self.query(
            """mutation($id: String!) { terminateRun(runId: $id) {
                 __typename ... on TerminateRunFailure { message } ... on PythonError { message }
                 ... on Error { message } } }""",
            {"id": run_id},
        )["terminateRun"]
        if data["__typename"] != "TerminateRunSuccess":
            raise WebserverError(f"run {run_id} not terminated: {data['__typename']}: {data.get('message', '')}")

    def run_status(self, run_id: str) -> str:
        data = self.query(
            """query($id: ID!) { runOrError(runId: $id) { __typename ... on Run { status } ... on Error { message } } }""",
            {"id": run_id},
        )["runOrError"]
        if data["__typename"] != "Run":
            raise WebserverError(f"run {run_id}: {data.get('message', data['__typename'])}")
        return data["status"]

    def wait_for_run(self, run_id: str, timeout: float = 600, poll: float = 2.0) -> str:
        deadline = time.monotonic() + timeout
        while (status := self.run_status(run_id)) not in FINISHED:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {status} after {timeout:.0f}s")
            time.sleep(poll)
        return status

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
            runs_done = all(r["status"] in FINISHED for r in status["runs"])
            if status["status"] not in ("REQUESTED", "CANCELING") and runs_done:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(f"backfill {backfill_id} still {status['status']} after {timeout:.0f}s: {status}")
            time.sleep(poll)
