"""Hardware/model profiles: what the planner and the simulator know about a node.

A profile is a JSON file (schema in `profiles/README.md`) holding, per pipeline
stage, the fitted latency models (the paper's and ours), memory figures and the
transfer bandwidths. The same object drives the planner's predictions, the
simulator's ground truth and the emulated executor's timing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lemix.latency import (
    AffineQuadraticLatencyModel,
    ChunkCoeffs,
    DecodeCoeffs,
    LatencyModel,
    PaperLatencyModel,
    QuadCoeffs,
)

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class MemoryProfile:
    """Per-stage GPU memory figures, in bytes."""

    capacity_bytes: int  # one stage GPU's memory
    weight_bytes: tuple[int, ...]  # weights (serving copy) per stage
    training_state_bytes: tuple[int, ...]  # grads + optimizer state per stage
    kv_bytes_per_token: tuple[int, ...]  # per sequence token, per stage
    activation_bytes_per_token: tuple[int, ...]  # saved for backward, per token, per stage
    host_capacity_bytes: int  # host memory available for offloaded KV, per node

    def static_bytes(self, stage: int) -> int:
        return self.weight_bytes[stage] + self.training_state_bytes[stage]


@dataclass(frozen=True)
class TransferProfile:
    host_link_bytes_s: float  # GPU <-> host (KV offload/reload), per stage GPU
    weight_sync_bytes_s: float  # node -> node weight copy (SEPARATE baselines)


@dataclass(frozen=True)
class Profile:
    name: str
    num_stages: int
    paper: PaperLatencyModel
    ours: AffineQuadraticLatencyModel
    optimizer_step_s: tuple[float, ...]  # per stage, after the backward reaches it
    memory: MemoryProfile
    transfer: TransferProfile
    model: dict[str, Any] = field(default_factory=dict)  # shapes the profile was derived for
    hardware: dict[str, Any] = field(default_factory=dict)
    fit_quality: dict[str, Any] = field(default_factory=dict)
    provenance: str = ""

    def __post_init__(self) -> None:
        per_stage = [
            self.paper.num_stages,
            self.ours.num_stages,
            len(self.optimizer_step_s),
            len(self.memory.weight_bytes),
            len(self.memory.training_state_bytes),
            len(self.memory.kv_bytes_per_token),
            len(self.memory.activation_bytes_per_token),
        ]
        if any(n != self.num_stages for n in per_stage):
            raise ValueError(
                f"profile {self.name}: every per-stage list needs {self.num_stages} entries"
            )

    def latency_model(self, kind: str = "ours") -> LatencyModel:
        if kind == "ours":
            return self.ours
        if kind == "paper":
            return self.paper
        raise ValueError(f"unknown latency model {kind!r}; choose 'ours' or 'paper'")

    @property
    def total_weight_bytes(self) -> int:
        return sum(self.memory.weight_bytes)

    def weight_sync_s(self) -> float:
        """Time to copy one full replica's weights between nodes."""
        return self.total_weight_bytes / self.transfer.weight_sync_bytes_s

    def standalone_prefill_s(self, num_tokens: int) -> float:
        """Unloaded pipeline latency of one request's prefill (the SLO reference)."""
        return sum(self.ours.forward_s(s, 1, num_tokens) for s in range(self.num_stages))

    def standalone_decode_step_s(self, num_context_tokens: int) -> float:
        """Unloaded time between two tokens of one request alone on a node."""
        stages = range(self.num_stages)
        return sum(self.ours.decode_step_s(s, 1, num_context_tokens) for s in stages)

    # ------------------------------------------------------------- JSON

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "num_stages": self.num_stages,
            "latency": {
                "paper": {
                    "eta_forward": list(self.paper.eta_forward),
                    "eta_backward": list(self.paper.eta_backward),
                },
                "ours": {
                    "forward": [asdict(c) for c in self.ours.forward],
                    "backward": [asdict(c) for c in self.ours.backward],
                    "decode": [asdict(c) for c in self.ours.decode],
                    # Absent = derived from forward and decode (ChunkCoeffs.derived).
                    **({"chunk": [asdict(c) for c in self.ours.chunk]} if self.ours.chunk else {}),
                },
            },
            "optimizer_step_s": list(self.optimizer_step_s),
            "memory": {
                k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self.memory).items()
            },
            "transfer": asdict(self.transfer),
            "model": self.model,
            "hardware": self.hardware,
            "fit_quality": self.fit_quality,
            "provenance": self.provenance,
        }

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> Profile:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"profile schema_version {version!r} unsupported (want {SCHEMA_VERSION})"
            )
        try:
            lat = data["latency"]
            mem = data["memory"]
            return cls(
                name=str(data["name"]),
                num_stages=int(data["num_stages"]),
                paper=PaperLatencyModel(
                    eta_forward=tuple(float(x) for x in lat["paper"]["eta_forward"]),
                    eta_backward=tuple(float(x) for x in lat["paper"]["eta_backward"]),
                ),
                ours=AffineQuadraticLatencyModel(
                    forward=tuple(QuadCoeffs(**c) for c in lat["ours"]["forward"]),
                    backward=tuple(QuadCoeffs(**c) for c in lat["ours"]["backward"]),
                    decode=tuple(DecodeCoeffs(**c) for c in lat["ours"]["decode"]),
                    chunk=tuple(ChunkCoeffs(**c) for c in lat["ours"].get("chunk", ())),
                ),
                optimizer_step_s=tuple(float(x) for x in data["optimizer_step_s"]),
                memory=MemoryProfile(
                    capacity_bytes=int(mem["capacity_bytes"]),
                    weight_bytes=tuple(int(x) for x in mem["weight_bytes"]),
                    training_state_bytes=tuple(int(x) for x in mem["training_state_bytes"]),
                    kv_bytes_per_token=tuple(int(x) for x in mem["kv_bytes_per_token"]),
                    activation_bytes_per_token=tuple(
                        int(x) for x in mem["activation_bytes_per_token"]
                    ),
                    host_capacity_bytes=int(mem["host_capacity_bytes"]),
                ),
                transfer=TransferProfile(**{k: float(v) for k, v in data["transfer"].items()}),
                model=dict(data.get("model", {})),
                hardware=dict(data.get("hardware", {})),
                fit_quality=dict(data.get("fit_quality", {})),
                provenance=str(data.get("provenance", "")),
            )
        except KeyError as exc:
            raise ValueError(f"profile is missing field {exc}") from exc


def load_profile(path: str | Path) -> Profile:
    """Read a profile JSON file; errors name the file and the problem."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read profile {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"invalid profile {path}: the top level must be a JSON object")
    try:
        return Profile.from_json_dict(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid profile {path}: {exc}") from exc


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json_dict(), indent=2) + "\n")


def default_profile_path() -> Path:
    """The A100 Llama-2-7B two-stage profile shipped in the repo."""
    return Path(__file__).resolve().parent.parent / "profiles" / "a100-llama2-7b-2stage.json"


def torch_cpu_profile_path() -> Path:
    """The shipped profile measured on a CPU for the torch backend's
    ``tiny-llama`` preset, 2 stages (`lemix profile` against torch executors)."""
    return default_profile_path().with_name("cpu-tiny-llama-2stage.json")
