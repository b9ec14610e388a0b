"""The alert rules: promtool checks them and runs their unit tests; every alert reads only
metrics the service exports, and says what to do about it."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from advantage_service.observability.metrics import Metrics
from deploy_support import ALERTS, ALERTS_TEST, alert_rules, unknown_metrics

# The list: down, error ratio, p99 latency, saturation (overload refusals and a queue
# near capacity), store down, zero-signal groups.
REQUIRED_ALERTS = {
    "AdvantageServiceDown",
    "AdvantageServiceErrorRatioHigh",
    "AdvantageServiceLatencyP99High",
    "AdvantageServiceOverloaded",
    "AdvantageServiceQueueNearCapacity",
    "AdvantageStatsStoreDown",
    "AdvantageZeroSignalGroupRatioHigh",
}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (OS package prometheus; `make test-deps`)")
    return path


@pytest.mark.integration
def test_promtool_check_rules_passes() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


@pytest.mark.integration
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", ALERTS_TEST.name],
        cwd=ALERTS_TEST.parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_required_alerts_exist_with_severity_and_instructions() -> None:
    rules = alert_rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names)), "duplicate alert names"
    assert set(names) >= REQUIRED_ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        assert "for" in rule, f"{rule['alert']} would fire on one bad evaluation"


def test_every_alert_has_unit_tests_that_fire_it_and_keep_it_quiet() -> None:
    suite = yaml.safe_load(ALERTS_TEST.read_text())
    cases = [case for test in suite["tests"] for case in test.get("alert_rule_test", [])]
    fired = {case["alertname"] for case in cases if case.get("exp_alerts")}
    quiet = {case["alertname"] for case in cases if not case.get("exp_alerts")}
    names = {rule["alert"] for rule in alert_rules()}
    assert names <= fired, names - fired
    assert names <= quiet, names - quiet


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_metric_an_alert_reads_is_exported_by_the_service(rule: dict) -> None:
    exposition = Metrics().render().decode()
    assert not unknown_metrics(rule["expr"], exposition)
