"""Profile JSON round trip and validation (lemix.profile)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from lemix.latency import AffineQuadraticLatencyModel, DecodeCoeffs, PaperLatencyModel, QuadCoeffs
from lemix.profile import (
    SCHEMA_VERSION,
    MemoryProfile,
    Profile,
    TransferProfile,
    default_profile_path,
    load_profile,
    save_profile,
)


def make_profile(num_stages: int = 2) -> Profile:
    """A small two-stage profile with round numbers."""
    return Profile(
        name="unit",
        num_stages=num_stages,
        paper=PaperLatencyModel((1e-8,) * num_stages, (2e-8,) * num_stages),
        ours=AffineQuadraticLatencyModel(
            forward=(QuadCoeffs(1e-3, 4e-5, 2e-9),) * num_stages,
            backward=(QuadCoeffs(2e-3, 8e-5, 4e-9),) * num_stages,
            decode=(DecodeCoeffs(5e-3, 1e-5, 2e-7),) * num_stages,
        ),
        optimizer_step_s=(0.05,) * num_stages,
        memory=MemoryProfile(
            capacity_bytes=1000,
            weight_bytes=(100,) * num_stages,
            training_state_bytes=(200,) * num_stages,
            kv_bytes_per_token=(2,) * num_stages,
            activation_bytes_per_token=(5,) * num_stages,
            host_capacity_bytes=5000,
        ),
        transfer=TransferProfile(host_link_bytes_s=25e9, weight_sync_bytes_s=10.0),
        model={"name": "toy", "num_layers": 4},
        hardware={"name": "toy-gpu", "assumptions": {"mfu": 0.5}},
        fit_quality={"forward": {"ours": [{"r2": 0.99, "mape": 0.01}]}},
        provenance="hand-written for tests",
    )


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return path


def test_json_round_trip_is_equal(tmp_path: Path) -> None:
    profile = make_profile()
    assert Profile.from_json_dict(profile.to_json_dict()) == profile
    path = tmp_path / "profile.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION


def test_missing_field_is_a_clear_value_error(tmp_path: Path) -> None:
    data = make_profile().to_json_dict()
    del data["memory"]["kv_bytes_per_token"]
    with pytest.raises(ValueError, match="missing field 'kv_bytes_per_token'"):
        load_profile(_write(tmp_path, data))


def test_bad_schema_version_is_a_value_error(tmp_path: Path) -> None:
    data = make_profile().to_json_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(ValueError, match="schema_version"):
        load_profile(_write(tmp_path, data))
    del data["schema_version"]
    with pytest.raises(ValueError, match="schema_version"):
        load_profile(_write(tmp_path, data))


def test_bad_json_and_missing_file_are_value_errors(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{"schema_version": 1, ')
    with pytest.raises(ValueError, match="cannot read profile .*broken.json"):
        load_profile(path)
    with pytest.raises(ValueError, match="cannot read profile"):
        load_profile(tmp_path / "absent.json")


def test_top_level_that_is_not_an_object_is_a_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="JSON object"):
        load_profile(_write(tmp_path, [1, 2, 3]))


def test_wrong_types_and_stage_count_mismatch_are_value_errors(tmp_path: Path) -> None:
    data = make_profile().to_json_dict()
    data["latency"]["ours"]["forward"] = [{"a": 1.0}, {"a": 1.0}]  # b, c missing
    with pytest.raises(ValueError, match="invalid profile"):
        load_profile(_write(tmp_path, data))
    data = make_profile().to_json_dict()
    data["num_stages"] = 3
    with pytest.raises(ValueError, match="3 entries"):
        load_profile(_write(tmp_path, data))


def test_derived_figures_by_hand() -> None:
    profile = make_profile()
    # forward per stage at C=1, ℓ=100: 1e-3 + 4e-5·100 + 2e-9·10⁴ = 5.02e-3; two stages
    assert profile.standalone_prefill_s(100) == pytest.approx(2 * 5.02e-3)
    # decode per stage at C=1, Σ=1000: 5e-3 + 1e-5 + 2e-4 = 5.21e-3
    assert profile.standalone_decode_step_s(1000) == pytest.approx(2 * 5.21e-3)
    assert profile.total_weight_bytes == 200
    assert profile.weight_sync_s() == pytest.approx(20.0)
    assert profile.memory.static_bytes(1) == 300
    assert profile.latency_model("ours") is profile.ours
    assert profile.latency_model("paper") is profile.paper
    with pytest.raises(ValueError, match="unknown latency model"):
        profile.latency_model("vidur")


def test_shipped_default_profile_loads_with_one_entry_per_stage() -> None:
    path = default_profile_path()
    assert path.name == "a100-llama2-7b-2stage.json"
    profile = load_profile(path)
    assert profile.num_stages == 2
    mem = profile.memory
    per_stage = [
        profile.paper.eta_forward,
        profile.paper.eta_backward,
        profile.ours.forward,
        profile.ours.backward,
        profile.ours.decode,
        profile.optimizer_step_s,
        mem.weight_bytes,
        mem.training_state_bytes,
        mem.kv_bytes_per_token,
        mem.activation_bytes_per_token,
    ]
    assert all(len(x) == profile.num_stages for x in per_stage)
    assert mem.capacity_bytes > max(mem.static_bytes(s) for s in range(profile.num_stages))


@pytest.mark.parametrize(
    ("filename", "num_stages"),
    [("a100-llama2-7b-4stage.json", 4), ("h100-llama2-7b-2stage.json", 2)],
)
def test_other_shipped_profiles_load(filename: str, num_stages: int) -> None:
    profile = load_profile(default_profile_path().parent / filename)
    assert profile.num_stages == num_stages
    assert len(profile.memory.kv_bytes_per_token) == num_stages


def test_chunk_model_round_trips_and_is_absent_when_derived(tmp_path: Path) -> None:
    from lemix.latency import ChunkCoeffs

    derived = make_profile()
    assert "chunk" not in derived.to_json_dict()["latency"]["ours"]
    chunk = (ChunkCoeffs(1e-3, 4e-5, 2e-9, 5e-9, 3e-7),) * 2
    measured = dataclasses.replace(derived, ours=dataclasses.replace(derived.ours, chunk=chunk))
    data = measured.to_json_dict()
    assert data["latency"]["ours"]["chunk"][1] == {
        "a": 1e-3,
        "b": 4e-5,
        "c": 2e-9,
        "e": 5e-9,
        "f": 3e-7,
    }
    path = tmp_path / "chunk.json"
    save_profile(measured, path)
    assert load_profile(path) == measured
    assert load_profile(path).ours.chunk_forward_s(1, 10, 20) == pytest.approx(chunk[1](10, 20))


def test_a_profile_written_before_chunks_loads_with_the_derived_model(tmp_path: Path) -> None:
    data = make_profile().to_json_dict()
    data["latency"]["ours"].pop("chunk", None)
    profile = load_profile(_write(tmp_path, data))
    assert profile.ours.chunk == ()
    # Derived: forward (a, b, c), e = 2·c, f = d2 (see ChunkCoeffs.derived).
    expected = 1e-3 + 4e-5 * 10 + 2e-9 * 100 + 4e-9 * 10 * 20 + 2e-7 * 20
    assert profile.ours.chunk_forward_s(0, 10, 20) == pytest.approx(expected)


def test_a_chunk_list_of_the_wrong_length_is_rejected(tmp_path: Path) -> None:
    data = make_profile().to_json_dict()
    data["latency"]["ours"]["chunk"] = [{"a": 0.0, "b": 0.0, "c": 0.0, "e": 0.0, "f": 0.0}]
    with pytest.raises(ValueError, match="chunk"):
        load_profile(_write(tmp_path, data))
