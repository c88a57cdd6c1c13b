"""The shipped Prometheus alert rules and Grafana dashboard: they load, every series they name is one that
``platform/metrics.py`` really exports (counters only under ``rate``/``increase``), their thresholds agree with the
Prefect automations' defaults, and promtool runs the rules' unit tests (``infra/prometheus/alerts.test.yaml``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY

from ddiloco.flows.alerts import AlertPolicy
from ddiloco.platform import metrics
from ddiloco.platform.liveness import CUT_OFF, Verdict

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "infra" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "infra" / "prometheus" / "alerts.test.yaml"
DASHBOARD = ROOT / "infra" / "grafana" / "ddiloco.json"
NAME = re.compile(r"\bddiloco_[a-z0-9_]+")
COUNTED = re.compile(r"\b(?:rate|increase|irate)\(\s*(ddiloco_[a-z0-9_]+)")


def exported() -> dict[str, str]:
    """Every sample name a learner and a synchronizer serve, with its family's type (counter, gauge, histogram)."""
    probe = "names-probe"
    metrics.observe_pass(probe, "h", active=True, pending=0, versions=0, newest_at=0.0)
    metrics.observe_merge(probe, 0.1, [1])
    metrics.observe_rejections(probe, [(1, "staleness 9 > 4")])
    metrics.observe_regions(probe, {"r": {"alive": 1}}, {"r": Verdict(CUT_OFF, "")})
    figures = metrics.LearnerFigures(step=1, tokens=1, tokens_per_s=1.0, loss=1.0, upload_queue=0, sent_bytes=0,
                                     received_bytes=0, last_version=0, model_flops_per_s=1.0, mfu=0.5)
    families = [*REGISTRY.collect(), *metrics.LearnerCollector(probe, "l", lambda: figures).collect()]
    return {s.name: f.type for f in families if f.name.startswith("ddiloco_") for s in f.samples if not s.name.endswith("_created")}


def rules() -> list[dict]:
    return [r for group in yaml.safe_load(RULES.read_text())["groups"] for r in group["rules"]]


def dashboard_queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_series_named_is_exported_and_counters_alone_are_rated(source: str):
    series = exported()
    exprs = [r["expr"] for r in rules()] if source == "alerts" else dashboard_queries()
    assert exprs
    for expr in exprs:
        names = NAME.findall(expr)
        unknown = [n for n in names if n not in series]
        assert not unknown, f"{source}: {expr!r} names series metrics.py does not export: {unknown}"
        for name in COUNTED.findall(expr):
            assert series[name] in ("counter", "histogram"), f"{source}: rate/increase of the gauge {name} in {expr!r}"


def test_the_rules_say_what_they_page_for_and_match_the_prefect_automations():
    loaded = {r["alert"]: r for r in rules()}
    assert set(loaded) >= {"DdilocoNoNewVersion", "DdilocoLossNotFinite", "DdilocoLossExploding", "DdilocoRejectionRateHigh",
                           "DdilocoLearnerRelaunchLoop", "DdilocoThroughputDrop"}
    for name, rule in loaded.items():
        assert rule["labels"]["severity"] in ("page", "warning"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    # The same defaults as `ddiloco deploy --notify-block`'s automations: one alert, whichever system sends it.
    policy = AlertPolicy()
    assert re.search(r">\s*(\d+)\s*$", loaded["DdilocoNoNewVersion"]["expr"]).group(1) == str(int(policy.stall_minutes * 60))
    assert re.search(r">\s*(\d+)\s*$", loaded["DdilocoLearnerRelaunchLoop"]["expr"].strip()).group(1) == str(policy.relaunches_per_hour)


def test_the_dashboard_loads_with_unique_panels_over_the_run_variable():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) and dash["uid"] == "ddiloco-run"
    assert [v["name"] for v in dash["templating"]["list"]] == ["datasource", "run"]
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"] and all('run="$run"' in t["expr"] for t in panel["targets"]), panel["title"]


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = "promtool not found (Debian: apt-get install prometheus); the rules' unit tests did not run"
        if os.environ.get("DDILOCO_REQUIRE_PROMTOOL") == "1":
            pytest.fail(message + " (DDILOCO_REQUIRE_PROMTOOL=1)", pytrace=False)
        pytest.skip(message)
    return found


def test_promtool_accepts_the_rules_and_each_fires_on_its_test_series_and_only_there():
    promtool = _promtool()
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"] if t["exp_alerts"]}
    assert tested == {r["alert"] for r in rules()}, "every rule has a unit test in which it fires"
    check = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60, check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([promtool, "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0 and "SUCCESS" in run.stdout, run.stdout + run.stderr
