"""``raw_responses`` as users launch it for several datasets: one step, one in-flight gate.

A run carrying a partition range (what a single-run backfill launches, from the UI or
``eagle3 backfill``) materializes every dataset in one step against the loopback OpenRouter
server. Small on purpose: 3 datasets x 40 prompts through a gate of 30 stands for 8 x 10M tokens
through 2,000; what would break at that scale - datasets queued one behind another, a gate that
never fills, the key lost to a config override, an API run waiting for the GPU - breaks here too.
"""

import json

import dagster as dg
import pytest

from eagle3_assets.corpus.report import print_inventory
from eagle3_assets.definitions import DATA_ASSETS, DATA_CHECKS, default_resources
from eagle3_assets.generation.response_store import ResponseStore
from eagle3_assets.loopback import FaultPlan, OpenRouterApp, SyntheticGenerator, serve_in_thread
from eagle3_assets.loopback.observe import prefix_group
from eagle3_assets.partitions import datasets_partitions
from eagle3_assets.prompts.reader import Prompt
from eagle3_assets.prompts.table import write_prompt_table
from tests.support.dagster_helpers import checks_by_name

KEY = "sk-or-v1-scale-test-0123456789"
DATASETS = ["scale_a", "scale_b", "scale_c"]
RANGE = {"dagster/asset_partition_range_start": DATASETS[0], "dagster/asset_partition_range_end": DATASETS[-1]}


def write_prompts(layout, dataset: str, n: int) -> None:
    prompts = [Prompt(f"q{i}", [{"role": "user", "content": f"{dataset}: question {i}"}], i + 1) for i in range(n)]
    write_prompt_table(prompts, layout.prompt_table(dataset))


def add_partitions(instance, names) -> None:
    instance.add_dynamic_partitions(datasets_partitions.name, [n for n in names
                                                               if not instance.has_dynamic_partition("datasets", n)])


def generation_config(**extra) -> dict:
    return {"ops": {"raw_responses": {"config": {"backend": "openrouter", "max_new_tokens": 32, **extra}}}}


@pytest.fixture
def env_key(monkeypatch):
    monkeypatch.setenv("OPENROUTER_API_KEY", KEY)


def test_three_datasets_share_one_gate_in_one_step(layout, env_key):
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, latency_s=0.3, latency_jitter_s=0.3, group_of=prefix_group)
    for ds in DATASETS:
        write_prompts(layout, ds, 40)
    with serve_in_thread(app) as srv, dg.instance_for_test() as instance:
        add_partitions(instance, DATASETS)
        storage = instance.event_log_storage
        storage.set_concurrency_slots("gpu", 1)
        storage.claim_concurrency_slot("gpu", "a-gpu-job", "extract")  # the GPU is busy all along
        # the key is bound through EnvVar; overriding another field in run config must keep it
        run_config = {**generation_config(concurrency=30),
                      "resources": {"openrouter": {"config": {"base_url": srv.url + "/api/v1"}}}}
        result = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["raw_responses"], instance=instance,
                                resources=default_resources(), run_config=run_config, tags=RANGE,
                                raise_on_error=False)
        assert result.success
        stats = srv.stats()
        # one step served every dataset at once, through one gate that filled
        assert [e.step_key for e in result.all_events if e.event_type_value == "STEP_START"] == ["raw_responses"]
        assert stats["groups_seen"] == DATASETS and stats["groups_at_once_peak"] >= 2, stats["group_peaks"]
        assert stats["concurrency_peak"] >= 0.9 * 30, stats["concurrency_peak"]
        # the API run never waited for the GPU pool, which stayed with its holder
        assert {s.run_id for s in storage.get_concurrency_info("gpu").claimed_slots} == {"a-gpu-job"}
        # one materialization per dataset, each with its own figures
        mats = {m.partition: m.metadata for m in result.asset_materializations_for_node("raw_responses")}
        assert sorted(mats) == DATASETS
        for ds in DATASETS:
            assert mats[ds]["new_responses"].value == 40 and mats[ds]["unanswered"].value == 0
            assert mats[ds]["total_billed_usd"].value == pytest.approx(mats[ds]["total_cost_usd"].value)
            assert mats[ds]["run_in_flight_peak"].value >= 27 and mats[ds]["datasets_in_run"].value == 3
            store = ResponseStore(layout.responses_dir(ds))
            assert len({r["sample_id"] for r in store.rows()}) == 40 and store.last_run()["new_responses"] == 40
        assert sum(m["cost_usd_new"].value for m in mats.values()) == pytest.approx(stats["billed_usd"], abs=1e-12)
        # one dataset alone still works the same way (`dagster asset materialize --partition`)
        alone = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["raw_responses"], instance=instance,
                               resources=default_resources(), run_config=run_config, partition_key="scale_b")
        assert alone.asset_materializations_for_node("raw_responses")[0].metadata["skipped_already_done"].value == 40


def test_unanswered_prompts_warn_and_are_listed_with_their_reason(layout, env_key, capsys):
    """One prompt fails for good (a 400); the run logs a warning, the inventory counts it missing,
    the completeness check lists it with its reason, and `eagle3 inventory` shows it."""
    app = OpenRouterApp(SyntheticGenerator(), api_key=KEY, faults=FaultPlan.from_strings(script="400"))
    write_prompts(layout, "holes", 6)
    with serve_in_thread(app) as srv, dg.instance_for_test() as instance:
        add_partitions(instance, ["holes"])
        run_config = {**generation_config(concurrency=1),
                      "resources": {"openrouter": {"config": {"base_url": srv.url + "/api/v1"}}}}
        gen = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["raw_responses"], instance=instance,
                             resources=default_resources(), run_config=run_config, partition_key="holes")
        assert gen.success  # a finished run with a hole still succeeds, but says so
        warnings = [e.user_message for e in instance.all_logs(gen.run_id) if e.level >= 30]
        assert any("1 samples still without a response" in w and "http_400" in w for w in warnings), warnings
        meta = gen.asset_materializations_for_node("raw_responses")[0].metadata
        assert meta["unanswered"].value == 1 and meta["errors"].value == 1
        inv = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["inventory"], instance=instance,
                             resources=default_resources(), partition_key="holes", raise_on_error=False)
        check = checks_by_name(inv)["responses_complete"]
        assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
        assert "1 prompts without a response (http_400: 1): q0" in check.description  # the prompt named, not only counted
        assert "q0" in check.metadata["prompts"].value
        assert inv.asset_materializations_for_node("inventory")[0].metadata["missing"].value == 1
        print_inventory(layout)
        out = capsys.readouterr().out
        assert "missing" in out and "billed $" in out
        assert "'remaining' is the budget inventory recorded when it last ran" in " ".join(out.split())
        row = json.loads(ResponseStore(layout.responses_dir("holes")).errors_path.read_text().splitlines()[0])
        assert row["prompt_id"] == "q0" and row["reason"] == "http_400"


@pytest.mark.parametrize("policy,passes", [("expected", True), ("strict", False)])
def test_budget_check_allows_the_expected_policy_its_one_percent(layout, policy, passes):
    """1,004 tokens against a budget of 1,000: within what the expected policy may end at, not strict's."""
    from eagle3_assets.resources import DatasetSettings

    write_prompts(layout, "over", 4)
    store = ResponseStore(layout.responses_dir("over"))
    with store.writer("openrouter") as w:
        w.write_batch([{"sample_id": f"s{i}", "prompt_id": f"q{i}", "source": "openrouter", "finish_reason": "stop",
                        "completion_tokens": 251 if i < 4 else 0, "cost_usd": 0.001} for i in range(4)])
    store.write_last_run({"budget_policy": policy, "stopped_reason": None})
    with dg.instance_for_test() as instance:
        add_partitions(instance, ["over"])
        res = {**default_resources(), "dataset_settings": DatasetSettings(budget_tokens={"over": 1000})}
        result = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["inventory"], instance=instance,
                                resources=res, partition_key="over", raise_on_error=False)
        check = checks_by_name(result)["token_budget"]
        assert check.passed is passes and "0.40% over" in check.description
        assert check.metadata["budget_overshoot"].value == 4


def test_budget_check_judges_the_budget_configured_now(layout):
    """The budget lowered after inventory ran: the check alone (no new inventory) judges the
    configured budget, names it and where it came from, and says what inventory had recorded."""
    from eagle3_assets.corpus.assets import inventory
    from eagle3_assets.corpus.checks import token_budget
    from eagle3_assets.resources import DatasetSettings

    write_prompts(layout, "later", 4)
    store = ResponseStore(layout.responses_dir("later"))
    with store.writer("openrouter") as w:
        w.write_batch([{"sample_id": f"s{i}", "prompt_id": f"q{i}", "source": "openrouter", "finish_reason": "stop",
                        "completion_tokens": 250, "cost_usd": 0.001} for i in range(4)])
    store.write_last_run({"budget_policy": "strict", "stopped_reason": None})
    with dg.instance_for_test() as instance:
        add_partitions(instance, ["later"])
        res = {**default_resources(), "dataset_settings": DatasetSettings(budget_tokens={"later": 2000})}
        first = dg.materialize([*DATA_ASSETS, *DATA_CHECKS], selection=["inventory"], instance=instance,
                               resources=res, partition_key="later", raise_on_error=False)
        assert checks_by_name(first)["token_budget"].passed
        lowered = {**default_resources(), "dataset_settings": DatasetSettings(default_budget_tokens=900)}
        alone = dg.materialize([inventory, token_budget], selection=dg.AssetSelection.checks(token_budget),
                               tags={"dagster/partition": "later"}, instance=instance, resources=lowered,
                               raise_on_error=False)
        check = checks_by_name(alone)["token_budget"]
        print(f"token_budget alone, budget lowered to 900: passed={check.passed}: {check.description}")
        assert not check.passed, check.description
        assert check.description.startswith("1,000 of 900 tokens used (budget from "
                                            "dataset_settings.default_budget_tokens) (11.11% over, strict policy); "
                                            "inventory recorded a budget of 2,000 when it ran (")
        assert check.description.endswith("), the configured 900 is the one judged")
        assert check.metadata["inventory_budget_tokens"].value == 2000
