"""Tiny real models used across the test suite (importable as ``tiny_models:Name``)."""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass

import torch
from torch import nn

Pair = namedtuple("Pair", ["logits", "features"])
Batch = namedtuple("Batch", ["x", "y"])  # pickled inputs: torch.load reads it only with --trust-pickle


@dataclass
class TrainState:
    """A non-tensor object a training checkpoint holds (weights_only loading refuses it)."""

    epoch: int = 0
    lr: float = 0.1


class Reused(nn.Module):
    """Calls the same ``act`` module three times (like torchvision ResNet's ``relu``)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, width)
        self.fc2 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        x = self.act(self.fc2(x))
        x = self.act(x * 2.0)
        return self.head(x)


def reused_calls(model: Reused, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Plain torch (``torch.relu`` for ``act``): the output of every module call of ``Reused``, by label."""
    with torch.no_grad():
        fc1 = model.fc1(x)
        act0 = torch.relu(fc1)
        fc2 = model.fc2(act0)
        act1 = torch.relu(fc2)
        act2 = torch.relu(act1 * 2.0)
        head = model.head(act2)
    return {"fc1": fc1, "act#0": act0, "fc2": fc2, "act#1": act1, "act#2": act2, "head": head}


class TupleOut(nn.Module):
    """Returns a tuple from a submodule (``split``) and a dict at the top."""

    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return x[:, :2], x[:, 2:] * 3.0, (x > 0).long()

    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.b = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"out": self.a(x), "aux": self.b(y)}

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.split = TupleOut.Split()
        self.heads = TupleOut.Heads()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.stem(x)
        a, b, _mask = self.split(h)
        return self.heads(a, b)


class NamedTupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> Pair:
        f = torch.tanh(self.body(x))
        return Pair(self.head(f), f)


class TinyLSTM(nn.Module):
    def __init__(self, input_size: int = 5, hidden: int = 7) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, (h, c) = self.lstm(x)
        return self.head(out[:, -1])


class CheckedLinear(nn.Linear):
    """A Linear that names a feature-count mismatch in its own words before torch would.

    The documented failure (docs/stats.md, tests/golden/) must not show torch's error text, which
    changes between releases (``addmm: mat1 and mat2 ...`` in one, ``mat1 and mat2 ...`` in another)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise RuntimeError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        return super().forward(x)


class Raises(nn.Module):
    """Forward raises inside ``bad`` (a feature-count mismatch), after ``good`` has run."""

    def __init__(self) -> None:
        super().__init__()
        self.good = nn.Linear(4, 6)
        self.act = nn.ReLU()
        self.bad = CheckedLinear(5, 2)  # expects 5 features, gets 6
        self.never = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.never(self.bad(self.act(self.good(x))))


class MakesNaN(nn.Module):
    """Produces NaN and Inf in ``log`` (log of negative numbers and of zero)."""

    class Log(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.log = MakesNaN.Log()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.log(self.fc(x)))


class InPlace(nn.Module):
    """In-place ReLU after a residual add, as in torchvision's ResNet blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.relu = nn.ReLU(inplace=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn(self.fc(x))
        out += x
        out = self.relu(out)
        return self.head(out)


class Tied(nn.Module):
    """Two names for one weight: each parameter tensor must be counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.out = nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids))


class Scaled(nn.Module):
    """A model with constructor arguments (for --model-arg)."""

    def __init__(self, width: int = 4, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale
        self.fc = nn.Linear(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def build_scaled(width: int = 4, scale: float = 1.0) -> Scaled:
    """A factory function (``tiny_models:build_scaled``)."""
    return Scaled(width=width, scale=scale)


instance = Reused()


class BiasDroppedInLowPrecision(nn.Linear):
    """A Linear whose bfloat16/float16 path forgets its bias: a wrong low-precision kernel, the kind of bug
    ``diff --vs-dtype bfloat16`` is for (float32 is right)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            return nn.functional.linear(x, self.weight)
        return super().forward(x)


class BrokenInBfloat16(nn.Module):
    """Linear -> GELU -> a Linear that drops its bias in bfloat16 -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.fc2 = BiasDroppedInLowPrecision(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.act(self.fc1(x))))


class Checkpointed(nn.Module):
    """``a`` -> ``block`` -> ``head``, ``block`` under activation checkpointing (rerun during backward), as
    timm and Hugging Face do with gradient checkpointing: non-reentrant by default, ``reentrant=True`` the
    other flavour, ``None`` not checkpointed (the same model, for reference)."""

    def __init__(self, reentrant: bool | None = False) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(6, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.GELU())
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils import checkpoint

        h = self.a(x)
        if self.reentrant is None:
            return self.head(self.block(h))
        return self.head(checkpoint.checkpoint(self.block, h, use_reentrant=self.reentrant))


# --------------------------------------------------------------------------- torchvision detection, tiny


def _tiny_backbone(channels: int = 8) -> nn.Module:
    """Two strided convolutions to one 1/4-size feature map (``out_channels`` as detection models read it)."""
    backbone = nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1), nn.ReLU(),
                             nn.Conv2d(channels, channels, 3, stride=2, padding=1), nn.ReLU())
    backbone.out_channels = channels
    return backbone


def _rcnn_parts() -> dict:
    """Anchors, RoI pooling and a small box head for the R-CNN family at 64x64, on ``_tiny_backbone``."""
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    return {"rpn_anchor_generator": AnchorGenerator(((16, 32),), ((0.5, 1.0, 2.0),)),
            "box_roi_pool": MultiScaleRoIAlign(["0"], 7, 2), "min_size": 64, "max_size": 64,
            "box_head": TwoMLPHead(8 * 7 * 7, 16), "box_predictor": FastRCNNPredictor(16, 3)}


def tiny_fasterrcnn() -> nn.Module:
    """Faster R-CNN (torchvision's class) on a two-layer backbone at 64x64: its train mode takes targets."""
    from torchvision.models.detection import FasterRCNN

    return FasterRCNN(_tiny_backbone(), **_rcnn_parts())


def tiny_maskrcnn() -> nn.Module:
    """Mask R-CNN at 64x64 (targets with masks)."""
    from torchvision.models.detection import MaskRCNN
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    return MaskRCNN(_tiny_backbone(), mask_roi_pool=MultiScaleRoIAlign(["0"], 14, 2),
                    mask_head=MaskRCNNHeads(8, [8], 1), mask_predictor=MaskRCNNPredictor(8, 8, 3), **_rcnn_parts())


def tiny_keypointrcnn() -> nn.Module:
    """Keypoint R-CNN at 64x64 with 3 keypoints (targets with keypoints)."""
    from torchvision.models.detection import KeypointRCNN
    from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor
    from torchvision.ops import MultiScaleRoIAlign

    return KeypointRCNN(_tiny_backbone(), keypoint_roi_pool=MultiScaleRoIAlign(["0"], 14, 2),
                        keypoint_head=KeypointRCNNHeads(8, [8]), keypoint_predictor=KeypointRCNNPredictor(8, 3),
                        **_rcnn_parts())


def tiny_retinanet() -> nn.Module:
    """RetinaNet at 64x64."""
    from torchvision.models.detection import RetinaNet
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    return RetinaNet(_tiny_backbone(), num_classes=3, min_size=64, max_size=64,
                     anchor_generator=AnchorGenerator(((16, 32),), ((0.5, 1.0, 2.0),)))


def tiny_fcos() -> nn.Module:
    """FCOS at 64x64 (one anchor per location, as FCOS wants; 32 channels for its GroupNorm)."""
    from torchvision.models.detection import FCOS
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    return FCOS(_tiny_backbone(32), num_classes=3, min_size=64, max_size=64,
                anchor_generator=AnchorGenerator(((16,),), ((1.0,),)))
class _SSDBackbone(nn.Module):
    """Two feature maps (1/4 and 1/8 of the image) in a dict, as SSD's backbones return them."""

    def __init__(self) -> None:
        super().__init__()
        self.first = _tiny_backbone()
        self.second = nn.Sequential(nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self.first(x)
        return {"0": a, "1": self.second(a)}


def tiny_ssd() -> nn.Module:
    """SSD at 64x64 on a two-level backbone."""
    from torchvision.models.detection.ssd import SSD
    from torchvision.models.detection.anchor_utils import DefaultBoxGenerator

    return SSD(_SSDBackbone(), DefaultBoxGenerator([[2], [2]]), (64, 64), num_classes=3)


# --------------------------------------------------------------------------- complex-valued


class SpectralConv2d(nn.Module):
    """A Fourier layer (FNO): rfft2, a complex weight on the lowest ``modes`` frequencies, irfft2."""

    def __init__(self, channels: int = 4, modes: int = 3) -> None:
        super().__init__()
        self.modes = modes
        scale = 1.0 / channels
        self.weight = nn.Parameter(scale * torch.randn(channels, channels, modes, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft2(x)
        out = torch.zeros_like(spectrum)
        m = self.modes
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", spectrum[:, :, :m, :m], self.weight)
        return torch.fft.irfft2(out, s=x.shape[-2:])


class Spectrum(nn.Module):
    """Returns the complex spectrum of its input (a submodule with a complex output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft2(x)


class TinyFNO(nn.Module):
    """An FNO-style spectral network on [batch, 1, 8, 8]: a lift, a spectral layer, a complex spectrum
    submodule whose magnitude feeds the head."""

    def __init__(self) -> None:
        super().__init__()
        self.lift = nn.Conv2d(1, 4, 1)
        self.spectral = SpectralConv2d(4, 3)
        self.act = nn.GELU()
        self.spectrum = Spectrum()
        self.head = nn.Linear(4 * 8 * 5, 3)
        self.example_inputs = (torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.spectral(self.lift(x)))
        z = self.spectrum(h)
        return self.head(z.abs().flatten(1))
