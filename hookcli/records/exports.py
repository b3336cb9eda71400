"""Plain-data results of ``hookcli features`` and ``hookcli fmaps`` (no tensors; see core.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hookcli.records.core import InputInfo, ModelInfo, Shape, envelope


@dataclass
class SavedTensor:
    """One saved output tensor of one call of one selected module (``hookcli features``)."""

    #: The entry's name in the file, unique by construction (``commands.features.feature_key``): the
    #: report's label (``layer1.0.relu#1``, ``split[0]``) where a module name cannot be misread, the
    #: name percent-encoded where it could (``act%231`` for a module named ``act#1``).
    label: str
    #: The module's exact name, call index and output path (what ``label`` encodes).
    name: str
    call: int
    output: str
    type: str
    shape: Shape
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "name": self.name,
            "call": self.call,
            "output": self.output,
            "type": self.type,
            "shape": self.shape,
            "dtype": self.dtype,
            "bytes": self.nbytes,
        }


@dataclass
class FeatureExport:
    """What ``hookcli features`` saved: one entry per call and output tensor of the selected modules."""

    model: ModelInfo
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    mode: str = "eval"
    entries: list[SavedTensor] = field(default_factory=list)
    not_called: list[str] = field(default_factory=list)  # selected modules that never ran
    path: str | None = None  # the file written; None when only returned (Python API)
    format: str | None = None  # "safetensors" | "torch" | "numpy"
    file_bytes: int | None = None
    batches: int = 1
    batch_size: int | None = None  # images per batch when a folder ran in batches
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "features"
    #: the reduction backend in force for the run's device (``engine.reduction``), as every report names it
    reduction: str | None = None
    #: label -> CPU tensor, for Python callers (not serialised, never rendered).
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            **envelope(self.version, self.command, self.model, self.inputs, self.device, self.mode),
            **({"reduction": self.reduction} if self.reduction is not None else {}),
            "file": {"path": self.path, "format": self.format, "bytes": self.file_bytes},
            "batches": self.batches,
            "batch_size": self.batch_size,
            "tensors": [t.to_dict() for t in self.entries],
            "not_called": list(self.not_called),
            "notes": list(self.notes),
        }


@dataclass
class ChannelRecord:
    """One channel of a captured feature map (one feature of a vector output), for one sample."""

    index: int
    min: float | None
    max: float | None
    mean: float | None
    status: str = "ok"  # "ok" | "dead" (all zero) | "constant" | "nonfinite" (NaN/Inf)
    shown: bool = False  # drawn in the image

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "min": self.min, "max": self.max, "mean": self.mean,
                "status": self.status, "shown": self.shown}


@dataclass
class FeatureMaps:
    """What ``hookcli fmaps`` drew: one module output's channels as a grid (or a bar strip)."""

    model: ModelInfo
    layer: str
    type: str
    inputs: list[InputInfo] = field(default_factory=list)
    device: str = "cpu"
    mode: str = "eval"
    call: int = 0
    calls: int = 1
    output: str = ""  # path of the tensor inside the module's output
    shape: Shape = field(default_factory=list)  # the whole output tensor (batch included)
    dtype: str = ""
    sample: int = 0
    kind: str = "grid"  # "grid": one tile per channel; "bars": one bar per feature
    channels: list[ChannelRecord] = field(default_factory=list)  # every channel of the sample
    scale: int = 1
    tile: list[int] = field(default_factory=list)  # [height, width] of one tile in pixels
    grid: list[int] = field(default_factory=list)  # [rows, columns] of tiles
    image_size: list[int] = field(default_factory=list)  # [width, height] in pixels
    path: str | None = None
    file_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    version: str = ""
    command: str = "fmaps"
    #: The grid as a uint8 (1, H, W) CPU tensor, for Python callers (not serialised, never rendered).
    image: Any = field(default=None, repr=False, compare=False)

    @property
    def label(self) -> str:
        """``name``, ``name#call`` for a reused module, plus the output path (as LayerRecord.label)."""
        base = self.layer or "(model)"
        return (f"{base}#{self.call}" if self.calls > 1 else base) + self.output

    @property
    def shown(self) -> list[int]:
        return [c.index for c in self.channels if c.shown]

    def to_dict(self) -> dict[str, Any]:
        return {
            **envelope(self.version, self.command, self.model, self.inputs, self.device, self.mode),
            "layer": {"name": self.layer, "type": self.type, "call": self.call, "calls": self.calls,
                      "output": self.output, "label": self.label, "shape": self.shape,
                      "dtype": self.dtype},
            "sample": self.sample,
            "kind": self.kind,
            "shown": self.shown,
            "scale": self.scale,
            "tile": self.tile,
            "grid": self.grid,
            "image_size": self.image_size,
            "file": {"path": self.path, "format": "png" if self.path else None,
                     "bytes": self.file_bytes},
            "channels": [c.to_dict() for c in self.channels],
            "notes": list(self.notes),
        }
