"""docs/configuration.md's option tables are exactly what scripts/config_table.py prints."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "config_table", REPO / "scripts" / "config_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("config_table", module)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_matches_the_option_tables() -> None:
    script = _script()
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert script.doc_block(doc) == script.render(), (
        "docs/configuration.md's option tables are stale: "
        "run `python scripts/config_table.py --write`"
    )


def test_every_service_option_is_listed_with_its_env_variable() -> None:
    block = _script().render()
    for flag, env in (
        ("--metrics-port", "LEMIX_SCHEDULER_METRICS_PORT"),
        ("--metrics-port", "LEMIX_EXECUTOR_METRICS_PORT"),
        ("--offload", "LEMIX_OFFLOAD"),
        ("--policy", "LEMIX_POLICY"),
    ):
        assert f"`{flag}`" in block and f"`{env}`" in block
