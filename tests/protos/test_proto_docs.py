"""Every field and rpc in protos/ carries a comment (issue 11: defaults, units,
errors, idempotency are documented where a client generating code reads them)."""

from __future__ import annotations

import re
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
FIELD = re.compile(r"^\s*(optional |repeated )?[\w.]+ (\w+) = \d+;")
RPC = re.compile(r"^\s*rpc (\w+)\(")


def undocumented(text: str) -> list[str]:
    """Fields and rpcs with neither a trailing comment nor a comment line above."""
    missing: list[str] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        match = FIELD.match(line) or RPC.match(line)
        if match is None:
            continue
        has_trailing = "//" in line
        has_above = i > 0 and lines[i - 1].strip().startswith("//")
        if not (has_trailing or has_above):
            missing.append(f"line {i + 1}: {line.strip()}")
    return missing


def test_the_checker_sees_a_bare_field() -> None:
    assert undocumented("message M {\n  uint32 n = 1;\n}") == ["line 2: uint32 n = 1;"]
    assert undocumented("message M {\n  // count\n  uint32 n = 1;\n}") == []
    assert undocumented("service S {\n  rpc Go(A) returns (B);\n}") == [
        "line 2: rpc Go(A) returns (B);"
    ]


def test_every_field_and_rpc_is_documented() -> None:
    files = sorted(PROTO_ROOT.rglob("*.proto"))
    assert files
    missing = {str(path.relative_to(PROTO_ROOT)): undocumented(path.read_text()) for path in files}
    assert not {name: lines for name, lines in missing.items() if lines}
