"""The Kubernetes manifests: the kustomize base and the cpu/gpu overlays, rendered the way
``kubectl apply -k`` renders them, validated offline against the Kubernetes schemas, and checked
for the wiring a schema cannot see (selectors, ports, probes, settings)."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonpatch
import pydantic
import pytest
import yaml
from advantage_service.config import Settings
from deploy_support import (
    BASE,
    OVERLAYS,
    Manifest,
    find,
    prometheus_rule_yaml,
    render,
    renderings,
    tool,
)

# The oldest Kubernetes minor release still maintained upstream, and the newest one the
# installed kubernetes-validate has schemas for.
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
# Custom resources of the Prometheus operator: Kubernetes' own schemas do not cover them, so
# they are validated against the operator's models instead (below).
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
RENDERINGS = ["base", *OVERLAYS]
POD_LABELS = {
    "app.kubernetes.io/name": "advantage-service",
    "app.kubernetes.io/component": "server",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Manifest]]:
    return renderings()


def deployment(docs: list[Manifest]) -> Manifest:
    return find(docs, "Deployment", "advantage-service")


def container(docs: list[Manifest]) -> dict[str, Any]:
    (main,) = deployment(docs)["spec"]["template"]["spec"]["containers"]
    return main


# ---- rendering and schemas ----------------------------------------------------------------------


def test_overlays_change_the_base_only_through_targeted_json_patches() -> None:
    for name, directory in OVERLAYS.items():
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        assert kustomization["resources"] == ["../../base"], name
        assert kustomization["patches"], name
        # render() refuses anything but RFC 6902 patches that select exactly one resource.
        render(directory)


def test_renderer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [%s]\ncommonLabels: {team: rl}\n" % (BASE / "pdb.yaml")
    )
    with pytest.raises(ValueError, match="commonLabels"):
        render(tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "resources: [%s]\npatches:\n- target: {kind: PodDisruptionBudget}\n"
        "  patch: 'spec: {minAvailable: 2}'\n" % (BASE / "pdb.yaml")
    )
    with pytest.raises(ValueError, match="RFC 6902"):
        render(tmp_path)


def test_overlay_patches_fail_loudly_when_the_base_moves(tmp_path: Path) -> None:
    """A `test` op guards each Deployment patch: a renamed container fails the render."""
    operations = yaml.safe_load((OVERLAYS["gpu"] / "deployment-patch.yaml").read_text())
    base = deployment(render(BASE))
    moved = copy.deepcopy(base)
    moved["spec"]["template"]["spec"]["containers"][0]["name"] = "renamed"
    jsonpatch.apply_patch(base, operations)
    with pytest.raises(jsonpatch.JsonPatchTestFailed):
        jsonpatch.apply_patch(moved, operations)


@pytest.mark.parametrize("name", RENDERINGS)
@pytest.mark.integration
def test_manifests_pass_kubernetes_validate_strict(
    name: str, rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    validator = tool("kubernetes-validate")
    assert validator, "kubernetes-validate is missing: install the dev extra"
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump_all(rendered[name], sort_keys=False))
    versions = [arg for v in KUBERNETES_VERSIONS for arg in ("-k", v)]
    result = subprocess.run(
        [validator, "--strict", *versions, str(path)], capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    # kubernetes-validate only warns (exit 0) when it has no schema: require a pass for every
    # built-in resource at every version, and tolerate a missing schema only for custom kinds.
    for doc in rendered[name]:
        resource = f"{doc['kind'].lower()}/{doc['metadata']['name']}"
        passed = re.findall(rf"INFO .* passed for resource {re.escape(resource)} against", output)
        if doc["kind"] in CUSTOM_KINDS:
            assert not passed
        else:
            assert len(passed) == len(KUBERNETES_VERSIONS), f"{resource} not validated:\n{output}"
    for line in output.splitlines():
        if line.startswith("WARN"):
            assert any(f"kind {kind} " in line for kind in CUSTOM_KINDS), line
        assert not line.startswith(("ERROR", "FATAL")), line


@pytest.mark.integration
def test_strict_validation_rejects_an_unknown_field(
    rendered: dict[str, list[Manifest]], tmp_path: Path
) -> None:
    """The negative control: strict mode is on and actually looks at the pod spec."""
    validator = tool("kubernetes-validate")
    assert validator
    bad = copy.deepcopy(deployment(rendered["base"]))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/x"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run(
        [validator, "--strict", "-k", KUBERNETES_VERSIONS[0], str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "'paht' was unexpected" in result.stdout


def _operator_models() -> dict[str, type[pydantic.BaseModel]]:
    from cloudcoil.models.prometheus_operator import v1

    return {"ServiceMonitor": v1.ServiceMonitor, "PrometheusRule": v1.PrometheusRule}


@pytest.mark.parametrize("name", RENDERINGS)
def test_custom_resources_validate_against_the_prometheus_operator_schema(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    """ServiceMonitor and PrometheusRule against models generated from the operator's CRD
    schemas (types, enums, duration patterns, required fields). The models ignore unknown
    fields, so strictness comes from a round trip: anything dropped was not in the schema."""
    models = _operator_models()
    customs = [d for d in rendered[name] if d["kind"] in CUSTOM_KINDS]
    assert {d["kind"] for d in customs} == CUSTOM_KINDS
    for doc in customs:
        model = models[doc["kind"]].model_validate(doc)
        assert model.model_dump(by_alias=True, exclude_unset=True, mode="json") == doc


def test_operator_schema_check_rejects_a_bad_duration_and_an_unknown_field(
    rendered: dict[str, list[Manifest]],
) -> None:
    models = _operator_models()
    monitor = copy.deepcopy(find(rendered["base"], "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(pydantic.ValidationError):
        models["ServiceMonitor"].model_validate(monitor)
    rule = copy.deepcopy(find(rendered["base"], "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["severity"] = "critical"
    dumped = (
        models["PrometheusRule"]
        .model_validate(rule)
        .model_dump(by_alias=True, exclude_unset=True, mode="json")
    )
    assert dumped != rule


def test_prometheusrule_mirrors_the_alert_rules_file() -> None:
    generated = prometheus_rule_yaml()
    assert (BASE / "prometheusrule.yaml").read_text() == generated, (
        "deploy/k8s/base/prometheusrule.yaml is stale; regenerate it with "
        "`.venv/bin/python tests/deploy/deploy_support.py prometheusrule "
        "> deploy/k8s/base/prometheusrule.yaml`"
    )


# ---- wiring -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", RENDERINGS)
def test_probes_check_readyz_and_healthz_on_the_http_port(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    main = container(rendered[name])
    ports = {p["name"]: p["containerPort"] for p in main["ports"]}
    assert ports == {"http": 8000, "grpc": 50051}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert main["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert main["resources"]["requests"]["cpu"] and main["resources"]["limits"]["memory"]


@pytest.mark.parametrize("name", RENDERINGS)
def test_configmap_holds_valid_service_settings(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    data = find(rendered[name], "ConfigMap", "advantage-service-config")["data"]
    fields = {f"ADV_{field.upper()}": field for field in Settings.model_fields}
    unknown = set(data) - set(fields)
    assert not unknown, f"not ADV_* settings of advantage_service.config: {sorted(unknown)}"
    settings = Settings(**{fields[key]: value for key, value in data.items()})
    assert settings.host == "0.0.0.0"
    assert (settings.http_port, settings.grpc_port) == (8000, 50051)
    assert settings.redis_url == "redis://advantage-redis:6379/0"
    assert find(rendered[name], "Service", "advantage-redis")["spec"]["ports"][0]["port"] == 6379
    # The pod reads every setting from this ConfigMap.
    assert {"configMapRef": {"name": "advantage-service-config"}} in container(rendered[name])[
        "envFrom"
    ]


@pytest.mark.parametrize("name", RENDERINGS)
def test_shutdown_fits_in_the_termination_grace_period(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    data = find(rendered[name], "ConfigMap", "advantage-service-config")["data"]
    pod = deployment(rendered[name])["spec"]["template"]["spec"]
    pre_stop = container(rendered[name])["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = float(data["ADV_SHUTDOWN_TIMEOUT_SECONDS"])
    assert pre_stop + drain < pod["terminationGracePeriodSeconds"]


@pytest.mark.parametrize("name", RENDERINGS)
def test_auth_tokens_come_from_a_mounted_secret(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    main = container(rendered[name])
    pod = deployment(rendered[name])["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "advantage-service-auth"
    assert volume["secret"]["optional"] is False, "without tokens the service would run open"
    (mount,) = [m for m in main["volumeMounts"] if m["name"] == volume["name"]]
    # A subPath mount never sees an updated Secret; the service reloads the file when it changes.
    assert "subPath" not in mount and mount["readOnly"] is True
    env = {e["name"]: e.get("value") for e in main["env"]}
    (item,) = volume["secret"]["items"]
    assert env["ADV_AUTH_TOKENS_FILE"] == f"{mount['mountPath']}/{item['path']}"
    # Referenced, never shipped: no Secret with a token in it lives in the repository.
    assert not [d for d in rendered[name] if d["kind"] == "Secret"]


@pytest.mark.parametrize("name", RENDERINGS)
def test_selectors_reach_the_pods_they_mean(name: str, rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered[name]
    pod_labels = deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert deployment(docs)["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert POD_LABELS.items() <= pod_labels.items()
    service = find(docs, "Service", "advantage-service")
    assert service["spec"]["selector"] == POD_LABELS
    assert {(p["name"], p["port"], p["targetPort"]) for p in service["spec"]["ports"]} == {
        ("http", 8000, "http"),
        ("grpc", 50051, "grpc"),
    }
    assert find(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == POD_LABELS
    hpa = find(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": "advantage-service",
    }
    assert 2 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb_min = find(docs, "PodDisruptionBudget")["spec"]["minAvailable"]
    assert pdb_min < hpa["minReplicas"], "the PDB would block every node drain"
    monitor = find(docs, "ServiceMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["endpoints"]] == ["http"]
    assert monitor["endpoints"][0]["path"] == "/metrics"


@pytest.mark.parametrize("name", RENDERINGS)
def test_only_the_service_reaches_redis(name: str, rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered[name]
    redis = find(docs, "StatefulSet", "advantage-redis")
    redis_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert redis["spec"]["serviceName"] == "advantage-redis"
    redis_service = find(docs, "Service", "advantage-redis")["spec"]
    assert redis_service["clusterIP"] == "None", "a StatefulSet's governing Service is headless"
    assert redis_service["selector"].items() <= redis_labels.items()
    policy = find(docs, "NetworkPolicy", "advantage-redis")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": POD_LABELS}}]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]


@pytest.mark.parametrize("name", RENDERINGS)
def test_pods_run_as_the_image_user_without_privileges(
    name: str, rendered: dict[str, list[Manifest]]
) -> None:
    pod = deployment(rendered[name])["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The Dockerfile's USER.
    assert pod["securityContext"]["runAsUser"] == 10001
    security = container(rendered[name])["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container(rendered[name])["volumeMounts"]}
    assert "/tmp" in mounts, "a read-only root needs a writable /tmp"


def test_cpu_overlay_runs_the_cpu_image_on_cpu(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["cpu"]
    main = container(docs)
    assert main["image"].endswith("-cpu")
    assert find(docs, "ConfigMap")["data"]["ADV_DEVICE"] == "cpu"
    threads = {e["name"]: e.get("value") for e in main["env"]}["OMP_NUM_THREADS"]
    assert threads == main["resources"]["requests"]["cpu"]
    assert "nvidia.com/gpu" not in main["resources"].get("limits", {})


def test_gpu_overlay_requests_a_gpu_on_gpu_nodes(rendered: dict[str, list[Manifest]]) -> None:
    docs = rendered["gpu"]
    main = container(docs)
    pod = deployment(docs)["spec"]["template"]["spec"]
    assert main["image"].endswith("-cuda")
    assert find(docs, "ConfigMap")["data"]["ADV_DEVICE"] == "cuda"
    assert main["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert main["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert find(docs, "HorizontalPodAutoscaler")["spec"]["maxReplicas"] <= 4
    # The base and the CPU overlay never schedule onto GPU nodes' taint.
    for name in ("base", "cpu"):
        assert "tolerations" not in deployment(rendered[name])["spec"]["template"]["spec"]
