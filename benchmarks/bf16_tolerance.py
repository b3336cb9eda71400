"""Measure how far bfloat16 runs of healthy models are from float32: the data behind ``diff``'s defaults.

``python benchmarks/bf16_tolerance.py`` runs ``hookcli.diff(MODEL, vs_dtype="bfloat16", all_modules=True)``
over healthy random-init models (torchvision classifiers at small inputs, timm tiny models, tiny Hugging
Face transformers, an LSTM, an MLP) and records, for every module output, the cosine distance (1 - cosine)
and the relative L2 error ||a - b|| / ||a||. It writes ``benchmarks/bf16_tolerance.md``: per model the worst
layer of each metric and the model's own output, then percentiles over models and over every layer.
Not a test (nothing is asserted); about 10 minutes on 2 cores. ``--only NAME,...`` runs some models.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hookcli  # noqa: E402
from hookcli.commands.diff_numbers import tolerance_for  # noqa: E402
from hookcli.render.diff import tolerance_text  # noqa: E402

OUT = Path(__file__).with_name("bf16_tolerance.md")


class LSTMNet(nn.Module):
    """A two-layer LSTM over a sequence of 32 features, and a linear head on the last step."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(32, 64, num_layers=2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 256), nn.ReLU(), nn.LayerNorm(256),
                         nn.Linear(256, 10))


def built(factory: Any) -> nn.Module:
    torch.manual_seed(0)
    return factory().eval()


def hf(model_type: str, **fields: Any) -> Any:
    """A tiny Hugging Face model as hookcli builds it: ``hf:TYPE`` with config fields."""
    return (f"hf:{model_type}", {"model_args": fields, "seq_len": 16})


IMG = {"input_shapes": ["1x3x64x64"]}
#: name -> (model spec or factory, hookcli options)
MODELS: dict[str, tuple[Any, dict[str, Any]]] = {
    **{name: (name, IMG) for name in (
        "resnet18", "resnet50", "resnext50_32x4d", "wide_resnet50_2", "mobilenet_v2", "mobilenet_v3_small",
        "mobilenet_v3_large", "efficientnet_b0", "efficientnet_v2_s", "densenet121", "vgg11_bn", "alexnet",
        "squeezenet1_1", "shufflenet_v2_x1_0", "resnet34", "regnet_x_400mf", "regnet_y_400mf", "convnext_tiny",
        "googlenet", "swin_t")},
    "inception_v3": ("inception_v3", {"input_shapes": ["1x3x80x80"]}),
    "vit_b_16": ("vit_b_16", {"input_shapes": ["1x3x224x224"]}),
    "timm:resnet10t": ("timm:resnet10t", IMG),
    "timm:convnext_atto": ("timm:convnext_atto", IMG),
    "timm:vit_tiny_patch16_224": ("timm:vit_tiny_patch16_224", {"input_shapes": ["1x3x64x64"],
                                                                 "model_args": {"img_size": 64}}),
    "timm:efficientnet_b0": ("timm:efficientnet_b0", IMG),
    "timm:mobilevitv2_050": ("timm:mobilevitv2_050", IMG),
    "timm:test_vit": ("timm:test_vit", {}),
    "hf:gpt2": hf("gpt2", n_layer=2, n_embd=64, n_head=2, vocab_size=1000),
    "hf:bert": hf("bert", num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
                  vocab_size=1000),
    "hf:t5": hf("t5", num_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32, vocab_size=1000),
    "hf:llama": hf("llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=1000),
    "hf:vit": ("hf:vit", {"model_args": {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2,
                                         "intermediate_size": 128, "image_size": 32, "patch_size": 8}}),
    "lstm": (LSTMNet, {"input_shapes": ["2x20x32"]}),
    "mlp": (mlp, {"input_shapes": ["8x128"]}),
}


@dataclass
class Layer:
    label: str
    cos_dist: float
    rel_l2: float


@dataclass
class Measured:
    name: str
    layers: list[Layer]
    final: Layer
    ok: bool  # report.ok with this tree's defaults
    seconds: float

    def worst(self, key: str) -> Layer:
        return max(self.layers, key=lambda layer: getattr(layer, key))


def measure(name: str) -> Measured:
    spec, options = MODELS[name]
    model = built(spec) if callable(spec) else spec
    kwargs = dict(options)
    start = time.perf_counter()
    report = hookcli.diff(model, vs_dtype="bfloat16", all_modules=True, **kwargs)
    seconds = time.perf_counter() - start
    layers = [Layer(r.label, 1.0 - r.errors.cosine, r.errors.rel_l2) for r in report.rows
              if r.errors is not None and r.status in ("ok", "diverged")
              and math.isfinite(r.errors.rel_l2) and r.a_dtype not in (None,) and str(r.a_dtype).startswith("float")]
    finals = [Layer(r.label, 1.0 - r.errors.cosine, r.errors.rel_l2) for r in report.rows
              if r.final and r.errors is not None]
    final = max(finals, key=lambda layer: layer.rel_l2)
    return Measured(name, layers, final, report.ok, seconds)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def table(results: list[Measured]) -> str:
    tol = tolerance_for("float32", "bfloat16", None, None)
    lines = [
        "# bfloat16 against float32 on healthy models",
        "",
        "Written by `python benchmarks/bf16_tolerance.py` (do not edit by hand). Each model is random-init (seed 0),",
        "run by `hookcli.diff(MODEL, vs_dtype=\"bfloat16\", all_modules=True)`: run A in float32, run B with the",
        "model and inputs cast to bfloat16. For every module output: cosine distance `1 - cos(a, b)` and",
        "relative L2 error `||a - b|| / ||a||`. `ok` is `report.ok` with this tree's defaults",
        f"({tolerance_text(tol)}).",
        "",
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}",
        "",
        "| model | layers | worst cos dist (layer) | worst rel L2 (layer) | final cos dist | final rel L2 | ok | s |",
        "| --- | ---: | --- | --- | ---: | ---: | --- | ---: |",
    ]
    for m in results:
        wc, wr = m.worst("cos_dist"), m.worst("rel_l2")
        lines.append(f"| {m.name} | {len(m.layers)} | {wc.cos_dist:.2e} (`{wc.label}`) | {wr.rel_l2:.2e} (`{wr.label}`) "
                     f"| {m.final.cos_dist:.2e} | {m.final.rel_l2:.2e} | {'yes' if m.ok else 'NO'} "
                     f"| {m.seconds:.1f} |")
    per_model_cos = [m.worst("cos_dist").cos_dist for m in results]
    per_model_rel = [m.worst("rel_l2").rel_l2 for m in results]
    all_cos = [layer.cos_dist for m in results for layer in m.layers]
    all_rel = [layer.rel_l2 for m in results for layer in m.layers]
    lines += ["", f"{len(results)} models, {len(all_cos)} layer outputs; "
              f"{sum(not m.ok for m in results)} fail this tree's defaults.", "",
              "| distribution | p50 | p90 | p99 | max |", "| --- | ---: | ---: | ---: | ---: |"]
    for label, values in (("cos dist, worst layer per model", per_model_cos),
                          ("rel L2, worst layer per model", per_model_rel),
                          ("cos dist, every layer", all_cos), ("rel L2, every layer", all_rel)):
        lines.append(f"| {label} | " + " | ".join(f"{percentile(values, q):.2e}" for q in (50, 90, 99, 100)) + " |")
    return "\n".join(line for line in lines if line is not None) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model names (default: all)")
    parser.add_argument("--output", default=str(OUT), help="the Markdown table to write")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    results = []
    for name in names:
        m = measure(name)
        wc, wr = m.worst("cos_dist"), m.worst("rel_l2")
        print(f"{name:28} worst cos dist {wc.cos_dist:.2e} ({wc.label}) worst rel L2 {wr.rel_l2:.2e} ({wr.label}) "
              f"final rel L2 {m.final.rel_l2:.2e} ok {m.ok} {m.seconds:.1f}s",
              flush=True)
        results.append(m)
    Path(args.output).write_text(table(results))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
