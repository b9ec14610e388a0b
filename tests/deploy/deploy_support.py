"""Helpers for the deployment tests: paths, a kustomize renderer for the subset the manifests use,
and the PrometheusRule that mirrors the alert rules.

The renderer supports exactly what ``deploy/k8s`` uses (``resources`` and RFC 6902 ``patches``
with a ``target``) and refuses anything else, so the documents it returns are the ones
``kubectl apply -k`` applies. Run as a script to regenerate the PrometheusRule:

    .venv/bin/python tests/deploy/deploy_support.py prometheusrule \
        > deploy/k8s/base/prometheusrule.yaml
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
BASE = K8S / "base"
OVERLAYS = {"cpu": K8S / "overlays" / "cpu", "gpu": K8S / "overlays" / "gpu"}
PROMETHEUS = DEPLOY / "prometheus"
ALERTS = PROMETHEUS / "alerts.yaml"
ALERTS_TEST = PROMETHEUS / "alerts_test.yaml"
GRAFANA = DEPLOY / "grafana"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DOCS = ROOT / "docs" / "deploy.md"
VENV_BIN = Path(sys.executable).parent

# kustomization fields and patch-target fields the renderer implements.
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "resources", "patches"}
PATCH_FIELDS = {"path", "patch", "target"}
TARGET_FIELDS = {"group", "version", "kind", "name"}

Manifest = dict[str, Any]


def tool(name: str) -> str | None:
    """An executable from the virtual environment running the tests, else from PATH."""
    candidate = VENV_BIN / name
    if candidate.exists():
        return str(candidate)
    return shutil.which(name)


def load_documents(path: Path) -> list[Manifest]:
    """The non-empty YAML documents of one file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def group_version(manifest: Manifest) -> tuple[str, str]:
    """(group, version) of a manifest's apiVersion; the core group is ''."""
    api_version = str(manifest["apiVersion"])
    group, _, version = api_version.rpartition("/")
    return group, version


def resource_id(manifest: Manifest) -> tuple[str, str, str]:
    group, _ = group_version(manifest)
    return group, manifest["kind"], manifest["metadata"]["name"]


def matches(manifest: Manifest, target: dict[str, str]) -> bool:
    """Whether a kustomize patch target selects the manifest (kustomize matches the fields as
    anchored regular expressions; an absent field matches anything)."""
    group, version = group_version(manifest)
    values = {
        "group": group,
        "version": version,
        "kind": manifest["kind"],
        "name": manifest["metadata"]["name"],
    }
    return all(re.fullmatch(pattern, values[field]) for field, pattern in target.items())


def render(directory: Path) -> list[Manifest]:
    """The manifests ``kustomize build directory`` produces, for the supported subset."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - KUSTOMIZATION_FIELDS
    if unsupported:
        raise ValueError(f"{directory}: kustomization fields {sorted(unsupported)} not supported")
    docs: list[Manifest] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs.extend(render(path) if path.is_dir() else load_documents(path))
    ids = [resource_id(d) for d in docs]
    duplicates = {i for i in ids if ids.count(i) > 1}
    if duplicates:
        raise ValueError(f"{directory}: resources defined twice: {sorted(duplicates)}")
    for number, patch in enumerate(kustomization.get("patches", [])):
        where = f"{directory}: patches[{number}]"
        if set(patch) - PATCH_FIELDS or "target" not in patch:
            raise ValueError(f"{where}: only path/patch with a target are supported")
        if set(patch["target"]) - TARGET_FIELDS:
            raise ValueError(f"{where}: target fields must be among {sorted(TARGET_FIELDS)}")
        text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()
        operations = yaml.safe_load(text)
        if not isinstance(operations, list):
            raise ValueError(f"{where}: not an RFC 6902 JSON patch (a list of operations)")
        selected = [i for i, d in enumerate(docs) if matches(d, patch["target"])]
        if len(selected) != 1:
            raise ValueError(f"{where}: target selects {len(selected)} resources, not 1")
        for i in selected:
            # A failing `test` or a missing path raises, as kustomize does.
            docs[i] = jsonpatch.apply_patch(docs[i], operations)
    return docs


def renderings() -> dict[str, list[Manifest]]:
    """The base and every overlay, rendered."""
    out = {"base": render(BASE)}
    out.update({name: render(path) for name, path in OVERLAYS.items()})
    return out


def find(docs: list[Manifest], kind: str, name: str | None = None) -> Manifest:
    found = [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ---- alert rules, dashboards and the metric names they use --------------------------------------

# Series Prometheus makes itself rather than scraping them from the service.
PROMETHEUS_SERIES = {"up"}
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
# Grafana's template variables, as the live test binds them (its targets carry these labels).
GRAFANA_VARIABLES = {
    "namespace": "advantage-test",
    "job": "advantage-service",
    "__rate_interval": "1m",
    "__interval": "15s",
    "__range": "5m",
}


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule
        for group in yaml.safe_load(ALERTS.read_text())["groups"]
        for rule in group["rules"]
        if "alert" in rule
    ]


def dashboards() -> dict[str, dict[str, Any]]:
    """Every dashboard JSON under deploy/grafana, by file stem."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(GRAFANA.glob("*.json"))}


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's panels (rows excluded, panels inside collapsed rows included)."""
    out = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            out.extend(panel.get("panels", []))
        else:
            out.append(panel)
    return out


def panel_queries() -> list[tuple[str, str, str, str]]:
    """(dashboard, panel title, refId, expr) of every panel target."""
    return [
        (stem, panel["title"], target["refId"], target["expr"])
        for stem, dashboard in dashboards().items()
        for panel in panels(dashboard)
        for target in panel["targets"]
    ]


def panel_query_id(query: tuple[str, str, str, str]) -> str:
    """A test id for a panel target: dashboard:panel title:refId."""
    stem, title, ref, _ = query
    return f"{stem}:{title}:{ref}"


def substitute(expr: str, variables: dict[str, str] = GRAFANA_VARIABLES) -> str:
    """``expr`` with Grafana's ``$name``, ``${name}`` and ``[[name]]`` variables bound."""

    def value(match: re.Match[str]) -> str:
        name = next(g for g in match.groups() if g)
        if name not in variables:
            raise KeyError(f"unbound Grafana variable {name} in {expr}")
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)|\[\[(\w+)\]\]", value, expr)


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression reads: every identifier written right before a label
    selector, and every advantage_* identifier wherever it stands."""
    without_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    selected = re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", without_strings)
    prefixed = re.findall(r"\badvantage_[a-z0-9_]+", without_strings)
    return set(selected) | set(prefixed)


def exported_names(exposition: str) -> tuple[set[str], set[str]]:
    """(every sample and family name, the histogram/summary family names) of a /metrics text."""
    names: set[str] = set()
    histograms: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            if kind in ("histogram", "summary"):
                histograms.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names, histograms


def unknown_metrics(expr: str, exposition: str) -> set[str]:
    """Names ``expr`` reads that the exposition does not export (histogram series included)."""
    names, histograms = exported_names(exposition)

    def known(name: str) -> bool:
        if name in names or name in PROMETHEUS_SERIES:
            return True
        return any(
            name.endswith(s) and name.removesuffix(s) in histograms for s in HISTOGRAM_SUFFIXES
        )

    return {name for name in metric_names(expr) if not known(name)}


# ---- the PrometheusRule mirror of alerts.yaml ---------------------------------------------------


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, descriptions) as literal blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str)


def prometheus_rule() -> Manifest:
    """deploy/prometheus/alerts.yaml as a PrometheusRule for the Prometheus operator."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "advantage-service",
            "labels": {
                "app.kubernetes.io/name": "advantage-service",
                "app.kubernetes.io/component": "server",
                "app.kubernetes.io/part-of": "advantage-service",
            },
        },
        "spec": {"groups": groups},
    }


def prometheus_rule_yaml() -> str:
    header = (
        "# Generated from deploy/prometheus/alerts.yaml (the one source of the rules):\n"
        "#   .venv/bin/python tests/deploy/deploy_support.py prometheusrule"
        " > deploy/k8s/base/prometheusrule.yaml\n"
    )
    body = yaml.dump(prometheus_rule(), Dumper=_LiteralDumper, sort_keys=False, width=100)
    return header + body


if __name__ == "__main__":
    if sys.argv[1:] != ["prometheusrule"]:
        sys.exit("usage: deploy_support.py prometheusrule")
    sys.stdout.write(prometheus_rule_yaml())
