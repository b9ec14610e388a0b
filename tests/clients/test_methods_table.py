"""The client's table of methods and inputs (``advantage_contract/methods.py``) is what the
service's registry lists today: a method added to the registry and not regenerated fails here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from advantage_client.integrations import inputs_read
from advantage_service import presets, resolve_estimator
from advantage_service.wire.listing import estimator_listing

ROOT = Path(__file__).resolve().parents[2]


def load_generator():
    path = ROOT / "clients" / "python" / "generate_methods.py"
    spec = importlib.util.spec_from_file_location("generate_methods", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_committed_table_is_what_the_registry_lists() -> None:
    generate = load_generator()
    assert generate.TARGET.read_text() == generate.expected(), (
        "advantage_contract/methods.py drifted from the registry; run "
        "`python clients/python/generate_methods.py`"
    )


def test_the_drift_check_notices_a_new_method() -> None:
    generate = load_generator()
    listing = estimator_listing()
    listing["terms"].append(
        {"name": "new_term", "inputs": ["entropy"], "optional_inputs": ["teacher_logprobs.x"]}
    )
    text = generate.render(listing)
    assert text != generate.TARGET.read_text()
    assert '"new_term"' in text and '"teacher_logprobs": ("cscr", "new_term", "opsd")' in text


def test_every_preset_is_sent_exactly_the_inputs_its_components_require() -> None:
    """The table read by the integrations agrees with the registry's own ``requires``."""
    listing = {
        c["name"]: c for c in (*estimator_listing()["outcomes"], *estimator_listing()["terms"])
    }
    for name in presets():
        resolved = resolve_estimator(name).to_dict()
        outcome = resolved["outcome"]["name"]
        parts = [outcome, *(k for k, v in resolved.items() if k in listing and v)]
        wanted = {
            i.split(".", 1)[0]
            for p in parts
            for i in (*listing[p]["inputs"], *listing[p]["optional_inputs"])
        }
        assert inputs_read(resolved) == wanted, name
