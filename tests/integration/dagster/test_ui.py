"""The UI as a person uses it: ``dagster dev`` on a free port, a real backfill over GraphQL,
then the asset graph and a check's page in a headless Chromium (marked ``browser``: skipped where
there is none, a failure under CI=true).

Marked ``ui``; deselect with ``-m 'not ui'``.
"""

from __future__ import annotations

import shutil

import pytest

from eagle3_assets.paths import REPO_ROOT
from tests.conftest import small_prompts, write_jsonl

pytestmark = pytest.mark.ui

DATASETS = ["ui_alpha", "ui_beta"]
ASSETS = ["prompts", "raw_responses", "token_ids", "inventory", "merged_corpus"]
GROUPS = ["prompts", "generation", "tokens", "corpus", "hidden_states", "drafter"]  # one per stage package
RUN_CONFIG = {"ops": {"raw_responses": {"config": {"max_new_tokens": 8, "batch_size": 4}}}}
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def ui(tmp_path_factory, model_dir):
    """``dagster dev`` on its own data root and instance; yields (server, layout, instance).
    EAGLE3_MODEL_CACHE (set by conftest) is inherited: the runs reuse the converted model."""
    from tests.support.dagster_dev import dagster_dev

    with dagster_dev(tmp_path_factory.mktemp("ui") / "data") as running:
        yield running.server, running.layout, running.instance


@pytest.fixture(scope="module")
def backfill(ui):
    """Two tiny datasets: their prompts, then a backfill from raw_responses through merged_corpus
    (as `eagle3 backfill` does, so that generation serves both in one run); the last one's status."""
    server, layout, _ = ui
    # Partitions first, then the files: the prompt-file sensor sees known datasets and stays out.
    for name in DATASETS:
        server.add_partition(name)
        write_jsonl(layout.prompt_source(name), small_prompts(3, prefix=f"{name}-"))
    first = server.launch_backfill(DATASETS, ["prompts"], title="ui test: prompts")
    assert server.wait_for_backfill(first, timeout=1200, poll=1.0)["status"] == "COMPLETED_SUCCESS"
    backfill_id = server.launch_backfill(DATASETS, ASSETS[1:], RUN_CONFIG, title="ui test")
    return server.wait_for_backfill(backfill_id, timeout=1200, poll=1.0)


def _step_window(instance, run_id: str, step: str) -> tuple[float, float]:
    from dagster import DagsterEventType

    start = end = None
    for rec in instance.all_logs(run_id):
        ev = rec.dagster_event
        if ev is None or ev.step_key != step:
            continue
        if ev.event_type == DagsterEventType.STEP_START:
            start = rec.timestamp
        elif ev.event_type in (DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE):
            end = rec.timestamp
    assert start is not None and end is not None, f"{step} did not start and end in run {run_id}"
    return start, end


def test_backfill_over_graphql_runs_every_partition_with_checks_and_generation_in_one_step(ui, backfill):
    from dagster import DagsterEventType

    _, layout, instance = ui
    assert backfill["status"] == "COMPLETED_SUCCESS", backfill
    runs = backfill["runs"]
    assert runs and all(r["status"] == "SUCCESS" for r in runs), runs
    partitions = set()
    checks = {}
    generation_runs = []
    for r in runs:
        run = instance.get_run_by_id(r["runId"])
        partitions.add(run.tags.get("dagster/partition"))
        for rec in instance.all_logs(r["runId"], of_type=DagsterEventType.ASSET_CHECK_EVALUATION):
            ev = rec.dagster_event.event_specific_data
            checks[(run.tags.get("dagster/partition"), ev.check_name)] = ev.passed
        if any(rec.dagster_event and rec.dagster_event.step_key == "raw_responses" for rec in instance.all_logs(r["runId"])):
            generation_runs.append(run)
    assert set(DATASETS) <= partitions, partitions
    for name in DATASETS:
        assert checks.get((name, "corpus_integrity")) is True, checks
        assert checks.get((name, "token_budget")) is True, checks
        assert layout.corpus(name).exists()
    # raw_responses has a single-run backfill policy: one run, one step, every dataset; it held the
    # `gpu` pool (local backend) and recorded one materialization per dataset with its own figures
    assert len(generation_runs) == 1, [r.run_id for r in generation_runs]
    gen = generation_runs[0]
    assert (gen.tags.get("dagster/asset_partition_range_start"), gen.tags.get("dagster/asset_partition_range_end")) \
        == (DATASETS[0], DATASETS[-1])
    _step_window(instance, gen.run_id, "raw_responses")
    assert any("holding a 'gpu' slot" in (rec.user_message or "") for rec in instance.all_logs(gen.run_id))
    mats = [rec.dagster_event.event_specific_data.materialization
            for rec in instance.all_logs(gen.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)]
    assert sorted(m.partition for m in mats) == DATASETS
    assert all(m.metadata["new_responses"].value == 3 and m.metadata["datasets_in_run"].value == 2 for m in mats)


def test_single_run_launch_serves_a_range_of_datasets_in_one_run(ui, backfill, capsys):
    """``eagle3 backfill --single-run``: one run over the datasets' range, no backfill. After the
    backfill everything is on disk, so the run resumes to nothing new, yet records each dataset."""
    from dagster import DagsterEventType

    from eagle3_assets.cli import main

    server, layout, instance = ui
    rows_before = {n: len(layout.responses_dir(n).joinpath("local.jsonl").read_text().splitlines()) for n in DATASETS}
    assert main(["backfill", *DATASETS, "--assets", "raw_responses", "--single-run", "--url", server.url,
                 "--wait", "900"]) == 0
    out = capsys.readouterr().out
    run_id = out.split()[1].rstrip(":")
    run = instance.get_run_by_id(run_id)
    assert run.tags.get("dagster/backfill") is None
    assert (run.tags["dagster/asset_partition_range_start"], run.tags["dagster/asset_partition_range_end"]) \
        == (DATASETS[0], DATASETS[-1])
    mats = [rec.dagster_event.event_specific_data.materialization
            for rec in instance.all_logs(run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION)]
    assert sorted(m.partition for m in mats) == DATASETS
    assert all(m.metadata["new_responses"].value == 0 for m in mats)
    assert rows_before == {n: len(layout.responses_dir(n).joinpath("local.jsonl").read_text().splitlines())
                           for n in DATASETS}
    # only raw_responses runs several datasets in one run; the refusal says what to do instead
    assert main(["backfill", *DATASETS, "--assets", "token_ids", "--single-run", "--url", server.url]) == 2
    assert "--single-run launches raw_responses only" in capsys.readouterr().err


def _leftmost(page, text: str) -> float:
    """The left edge, in the graph, of the element showing exactly ``text`` (a group's header, or an
    asset of the same name inside it: the same column either way). The navigation tree on the left
    lists the groups too, alphabetically; the graph lies to its right, so the rightmost match is
    the graph's."""
    found = page.get_by_text(text, exact=True)
    boxes = [found.nth(i).bounding_box() for i in range(found.count())]
    return max(b["x"] for b in boxes if b)


def _dismiss_onboarding(page) -> None:
    """The first visit asks for a newsletter sign-up; a person clicks Skip."""
    skip = page.get_by_role("button", name="Skip")
    try:
        skip.wait_for(state="visible", timeout=5_000)
        skip.click()
    except Exception:  # noqa: BLE001 - no dialog this time
        pass


@pytest.mark.browser
def test_asset_graph_and_check_pages_in_a_browser(ui, backfill, tmp_path):
    chromium = CHROMIUM
    from playwright.sync_api import expect, sync_playwright

    server, _, _ = ui
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        # A fresh profile per test (Playwright passes it as --user-data-dir).
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True,
            viewport={"width": 1600, "height": 1000},
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page()
        page.set_default_timeout(60_000)
        try:
            page.goto(f"{server.url}/asset-groups")  # the global lineage: every group, as a person first sees it
            _dismiss_onboarding(page)
            for name in GROUPS:  # with six groups the global view shows them collapsed, assets inside
                expect(page.get_by_text(name, exact=True).last).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "asset-graph.png"))
            # one group per stage, laid out left to right in pipeline order
            lefts = [_leftmost(page, group) for group in GROUPS]
            assert lefts == sorted(lefts) and len(set(lefts)) == len(GROUPS), dict(zip(GROUPS, lefts))

            page.goto(f"{server.url}/assets/merged_corpus?view=checks")
            _dismiss_onboarding(page)
            expect(page.get_by_text("corpus_integrity").first).to_be_visible()
            page.get_by_text("corpus_integrity").first.click()
            expect(page.get_by_text("blocking").first).to_be_visible()
            expect(page.get_by_text("Passed", exact=True).first).to_be_visible()
            page.screenshot(path=str(ARTIFACTS / "check-corpus_integrity.png"))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "failure.png"))
            raise
        finally:
            browser.close()
