"""Reference outputs: ``stats``, ``grads`` and ``check`` as JSON and a 20-step watch log of three real models
(torchvision, timm, transformers: random init, seeded), compared with the files under
tests/golden/reference/ that an earlier commit wrote (its README says which, and how to write them again).

They pin what hookcli prints while the collection layer beneath changes: keys, strings, ints and shapes
exactly; floats to a tolerance that fits how they were computed (``close``). The one key ignored is
``reduction`` (which reduction backend computed the numbers, added after the files were made); the
watch's later signals (``ADDED_KEYS``) may be present where the files lack them, and nothing else may.

Regenerate (only where a change of the numbers is intended)::

    OMP_NUM_THREADS=1 python tests/test_reference_outputs.py --update
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

REFERENCE_DIR = Path(__file__).resolve().parent / "golden" / "reference"

#: The models: a spec and the options that make it small (a few seconds for all twelve runs).
MODELS: dict[str, list[str]] = {
    "resnet18": ["resnet18", "--input-shape", "2x3x64x64"],
    "timm": ["timm:test_vit", "--input-shape", "2x3x160x160"],
    "gpt2": ["hf:gpt2", "--model-arg", "n_layer=2", "--model-arg", "n_embd=32", "--model-arg", "n_head=2",
             "--model-arg", "vocab_size=64", "--seq-len", "8", "--batch-size", "2"],
}
COMMANDS = ("stats", "grads", "check")
WATCH_STEPS, WATCH_EVERY = 20, 5

# Tolerances. One-shot statistics (stats, grads, check) are float64 reductions of one float32 forward and
# backward of a fixed input: what can move them is the float32 forward/backward itself (oneDNN/MKL pick
# other kernels on another x86 CPU, and another thread count splits their sums differently: last-bit
# changes, ~1e-7 relative per value) and the order of hookcli's own float64 sums (~1e-15). Relative 1e-6
# leaves a factor ~10 over what was measured between OMP_NUM_THREADS=1 and 2. A 20-step training log feeds
# those last bits back through 20 SGD steps (each update depends on the previous step's float32 values),
# so they grow with the steps: relative 1e-4 there. Values that are differences of large ones (a mean
# near 0, a gradient's mean of ~1e-12) are compared to the scale of their tensor (``_scale``), not to
# themselves: relative error of a cancelled sum says nothing.
ONE_SHOT_REL = 1e-6
TRAINING_REL = 1e-4
# One more: a gradient that is 0 in exact arithmetic (attention's key bias: softmax ignores a constant per
# query) holds float32 noise of ~1e-10, some of it exactly 0 depending on how a sum was split, so its
# zero_fraction in a training log moves by a few values out of a few hundred between thread counts
# (0.03 measured on a 192-value bias). There it is compared to this absolute tolerance.
TRAINING_ZERO_FRACTION_ATOL = 0.05
#: Keys whose values are compared loosely or not at all.
IGNORED_KEYS = frozenset({"reduction"})
#: Keys a watch line gained after the files were made (new signals): allowed where the file has none.
ADDED_KEYS = frozenset({"output_logits", "attention"})


def _run_cli(args: list[str]) -> str:
    from click.testing import CliRunner

    from hookcli.cli import main

    result = CliRunner().invoke(main, args, catch_exceptions=False, env={"COLUMNS": "120"})
    if result.exit_code not in (0, 1):  # check exits 1 when a rule fails: still a report
        raise AssertionError(f"hookcli {' '.join(args)} exited {result.exit_code}: {result.output[-2000:]}")
    return result.stdout


def outputs(tmp: Path) -> dict[str, str]:
    """Every reference output, by file name: made now, with this checkout."""
    out: dict[str, str] = {}
    for name, spec in MODELS.items():
        for command in COMMANDS:
            out[f"{name}_{command}.json"] = _run_cli([command, *spec, "--format", "json"])
        log = tmp / f"{name}_watch.jsonl"
        log.unlink(missing_ok=True)
        _run_cli(["watch", *spec, "--steps", str(WATCH_STEPS), "--every", str(WATCH_EVERY), "--out", str(log),
                  "--format", "json"])
        out[f"{name}_watch.jsonl"] = log.read_text()
    return out


def parse(name: str, text: str) -> Any:
    if name.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def _scale(d: dict[str, Any]) -> float:
    """The magnitude of the values a statistics dict describes (0 when it says none)."""
    values = [abs(v) for k in ("rms", "std", "abs_max", "max", "min", "norm")
              if isinstance(v := d.get(k), float) and math.isfinite(v)]
    return max(values, default=0.0)


def close(a: float, b: float, rel: float, scale: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= rel * max(abs(a), abs(b), scale) + 1e-300


def compare(want: Any, got: Any, rel: float, where: str = "", scale: float = 0.0, zeros_atol: float = 0.0
            ) -> list[str]:
    """The differences between two parsed outputs (empty: the same); ``where`` names the place;
    ``zeros_atol``: the absolute tolerance of a ``zero_fraction``."""
    if isinstance(want, dict) and isinstance(got, dict):
        got = {k: v for k, v in got.items() if k not in IGNORED_KEYS and (k in want or k not in ADDED_KEYS)}
        want = {k: v for k, v in want.items() if k not in IGNORED_KEYS}
        if list(want) != list(got):
            return [f"{where}: keys {list(want)} != {list(got)}"]
        inner = max(scale, _scale(want))
        return [d for k in want
                for d in compare(want[k], got[k], rel, f"{where}.{k}", inner, zeros_atol)]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} items != {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got))
                for d in compare(w, g, rel, f"{where}[{i}]", scale, zeros_atol)]
    if where.endswith(".zero_fraction") and isinstance(want, float) and isinstance(got, float):
        return [] if abs(want - got) <= zeros_atol or close(want, got, rel, 0.0) else [f"{where}: {want!r} != {got!r}"]
    if isinstance(want, float) and isinstance(got, float):
        return [] if close(want, got, rel, scale) else [f"{where}: {want!r} != {got!r}"]
    if type(want) is not type(got) or want != got:
        return [f"{where}: {want!r} != {got!r}"]
    return []


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return outputs(tmp_path_factory.mktemp("reference"))


@pytest.mark.parametrize("name", [f"{m}_{c}.json" for m in MODELS for c in COMMANDS]
                         + [f"{m}_watch.jsonl" for m in MODELS])
def test_output_is_the_reference(made: dict[str, str], name: str) -> None:
    want = parse(name, (REFERENCE_DIR / name).read_text())
    got = parse(name, made[name])
    training = name.endswith(".jsonl")
    diffs = compare(want, got, TRAINING_REL if training else ONE_SHOT_REL, name,
                    zeros_atol=TRAINING_ZERO_FRACTION_ATOL if training else 0.0)
    assert not diffs, "\n".join(diffs[:20])


def test_comparison_catches_a_changed_float_key_and_string() -> None:
    want = {"a": {"std": 1.0, "mean": 1e-3}, "s": "x", "n": 2}
    assert not compare(want, {"a": {"std": 1.0, "mean": 1e-3 + 1e-8}, "s": "x", "n": 2, "reduction": "kernel"}, 1e-6)
    assert compare(want, {"a": {"std": 1.0, "mean": 1e-3 + 1e-5}, "s": "x", "n": 2}, 1e-6)
    assert compare(want, {"a": {"std": 1.0, "mean": 1e-3}, "s": "y", "n": 2}, 1e-6)
    assert compare(want, {"a": {"std": 1.0, "mean": 1e-3}, "s": "x", "n": 3}, 1e-6)
    assert compare(want, {"a": {"std": 1.0}, "s": "x", "n": 2}, 1e-6)
    assert compare({"zero_fraction": 0.5}, {"zero_fraction": 0.51}, 1e-6)
    assert not compare({"zero_fraction": 0.5}, {"zero_fraction": 0.51}, 1e-6, zeros_atol=0.05)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: OMP_NUM_THREADS=1 python tests/test_reference_outputs.py --update")
    import tempfile

    REFERENCE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for file_name, text in outputs(Path(tmp)).items():
            (REFERENCE_DIR / file_name).write_text(text)
            print(f"wrote {REFERENCE_DIR / file_name}")
