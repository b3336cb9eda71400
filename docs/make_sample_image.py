"""Make ``docs/images/sample.png``: a small, procedurally generated, photo-like scene (224x224 RGB).

Sky gradient, a sun with a soft glow, two rolling hills, a house with a roof, a window and a door, a
tree with dappled leaves: enough edges, colours and textures for feature maps to show something. No
pixel noise: it would triple the size of this PNG and of the feature maps drawn from it. Deterministic
(seeded); no downloads. Run from the repository root:

    python docs/make_sample_image.py
    hookcli fmaps resnet18 --layer conv1 --input docs/images/sample.png --output docs/images/conv1_fmaps.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torchvision.io import write_png

SIZE = 224
OUT = Path(__file__).resolve().parent / "images" / "sample.png"


def color(r: float, g: float, b: float) -> torch.Tensor:
    return torch.tensor([r, g, b]).reshape(3, 1, 1)


def paint(img: torch.Tensor, mask: torch.Tensor, rgb: torch.Tensor, alpha: float | torch.Tensor = 1.0) -> None:
    """Blend ``rgb`` into ``img`` where ``mask`` (H, W, values in [0, 1]) is set."""
    a = mask.float().clamp(0, 1) * alpha
    img.mul_(1 - a).add_(rgb * a)


def scene(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    y, x = torch.meshgrid(torch.linspace(0, 1, SIZE), torch.linspace(0, 1, SIZE), indexing="ij")
    # sky: deep blue at the top to a pale haze at the horizon
    img = color(0.25, 0.45, 0.80) * (1 - y) + color(0.85, 0.90, 0.95) * y
    # sun with a glow
    d = ((x - 0.78) ** 2 + (y - 0.22) ** 2).sqrt()
    paint(img, torch.exp(-((d / 0.16) ** 2)), color(1.0, 0.95, 0.75), 0.6)
    paint(img, d < 0.07, color(1.0, 0.97, 0.85))
    # far hill and near hill (sine ridges), shaded towards the bottom
    far = y > 0.58 + 0.05 * torch.sin(x * 7.0 + 0.5)
    paint(img, far, color(0.35, 0.55, 0.35) * (1.1 - 0.3 * y))
    near = y > 0.70 + 0.06 * torch.sin(x * 4.0 + 2.0)
    paint(img, near, color(0.30, 0.62, 0.22) * (1.15 - 0.4 * y))
    # grass stripes on the near hill
    paint(img, near & (torch.sin(x * 90 + y * 30) > 0.6), color(0.22, 0.50, 0.16), 0.5)
    # house: wall, roof (a triangle), window, door
    wall = (x > 0.18) & (x < 0.42) & (y > 0.56) & (y < 0.78)
    paint(img, wall, color(0.86, 0.78, 0.62))
    roof = (y > 0.42) & (y <= 0.56) & ((x - 0.30).abs() < (y - 0.42) / 0.14 * 0.15)
    paint(img, roof, color(0.62, 0.20, 0.15))
    paint(img, (x > 0.22) & (x < 0.29) & (y > 0.60) & (y < 0.67), color(0.30, 0.45, 0.65))
    paint(img, (x > 0.33) & (x < 0.39) & (y > 0.64) & (y < 0.78), color(0.40, 0.25, 0.15))
    # tree: trunk and a round crown with dappled leaves
    paint(img, (x > 0.63) & (x < 0.67) & (y > 0.55) & (y < 0.76), color(0.35, 0.24, 0.14))
    crown = ((x - 0.65) ** 2 + ((y - 0.50) * 1.2) ** 2).sqrt() < 0.10
    leaves = (torch.rand((SIZE // 4, SIZE // 4), generator=gen) * 0.25).repeat_interleave(4, 0).repeat_interleave(4, 1)
    paint(img, crown, color(0.15, 0.42, 0.15) + leaves)
    return (img.clamp(0, 1) * 255).round().to(torch.uint8)


def main(out: Path = OUT) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    write_png(scene(), str(out), compression_level=9)
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
