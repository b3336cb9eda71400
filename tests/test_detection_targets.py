"""torchvision detection models in train mode get synthetic targets; segmentation a smaller train input.

In train mode a detection model computes its losses against targets and refuses to run without them:
``check``, ``check --steps``, ``watch MODEL`` and ``grads --train`` stopped with the model's "targets should
not be none". Every family (SSD, RetinaNet, FCOS, Faster / Mask / Keypoint R-CNN) runs here at 64x64 on a
two-layer backbone (``tests/tiny_models.py``), with no flags; the loss is checked against the model's own
loss dict computed with plain torch, and the targets against what each family needs.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tiny_models
from hookcli.engine.build_inputs import TRAIN_SEGMENTATION_NOTE, TRAIN_SEGMENTATION_SIZE, detection_targets, make_inputs
from hookcli.engine.loading import from_instance

FAMILIES = ["tiny_ssd", "tiny_retinanet", "tiny_fcos", "tiny_fasterrcnn", "tiny_maskrcnn", "tiny_keypointrcnn"]


def _spec(name: str) -> str:
    return f"tiny_models:{name}"  # (imported already: its import draws nothing from the seeded RNG)


def _json(result: Any) -> dict[str, Any]:
    assert result.exit_code in (0, 1), result.stderr  # 1: a rule failed on a tiny random model, not a crash
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", FAMILIES)
def test_grads_in_train_mode_is_the_models_own_loss(cli: Any, name: str) -> None:
    report = _json(cli("grads", _spec(name), "--train", "-f", "json"))
    assert report["failure"] is None and report["loss"]["kind"] == "model_loss"
    torch.manual_seed(0)  # as hookcli builds and runs it (seed 0)
    model = getattr(tiny_models, name)()
    inputs = make_inputs(from_instance(model), batch_size=2, train=True)
    images, targets = inputs.args
    assert len(images) == len(targets) == 2
    model.train()
    torch.manual_seed(0)
    want = sum(model(images, targets).values()).item()
    assert report["loss"]["value"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", FAMILIES)
def test_check_steps_and_watch_run_every_detection_family(cli: Any, name: str) -> None:
    check = _json(cli("check", _spec(name), "--steps", "10", "-f", "json"))
    rules = {r["rule"]: r for r in check["rules"]}
    assert rules["runs"]["status"] == "PASS", rules["runs"]
    assert check["report"]["failure"] is None, check["report"]["failure"]
    assert check["report"]["inputs"][1]["source"].startswith("targets: ")
    watch = cli("watch", _spec(name), "--steps", "3")
    assert watch.exit_code == 0, watch.stderr + watch.stdout
    assert "3 steps, 3 logged" in watch.stdout


@settings(max_examples=25, deadline=None)
@given(size=st.integers(32, 400), batch=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_targets_fit_the_images_and_each_family(size: int, batch: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in ("tiny_fasterrcnn", "tiny_maskrcnn", "tiny_keypointrcnn"):
        targets, _ = detection_targets(getattr(tiny_models, name)(), size, batch, gen, seed)
        assert len(targets) == batch
        for t in targets:
            boxes = t["boxes"]
            assert boxes.dtype == torch.float32 and boxes.shape[1] == 4
            assert (boxes[:, 2:] > boxes[:, :2]).all() and (boxes >= 0).all() and (boxes <= size).all()
            assert t["labels"].dtype == torch.int64 and (t["labels"] >= 1).all()
            assert ("masks" in t) == (name == "tiny_maskrcnn") and ("keypoints" in t) == (name == "tiny_keypointrcnn")
            if "masks" in t:
                for box, mask in zip(boxes.int().tolist(), t["masks"]):
                    x0, y0, x1, y1 = box
                    assert mask.sum() == (x1 - x0) * (y1 - y0) == mask[y0:y1, x0:x1].sum()
            if "keypoints" in t:
                kp = t["keypoints"]
                assert kp.shape == (len(boxes), 3, 3) and (kp[..., 2] == 1).all()
                assert (kp[..., 0] >= boxes[:, None, 0]).all() and (kp[..., 0] <= boxes[:, None, 2]).all()
                assert (kp[..., 1] >= boxes[:, None, 1]).all() and (kp[..., 1] <= boxes[:, None, 3]).all()


def test_segmentation_check_defaults_to_a_small_input_and_says_so(cli: Any) -> None:
    """check on a segmentation model at its defaults: 128x128 in train mode (its preset's 520 took minutes
    on a CPU), said in the input's source; stats (eval) keeps the preset's size."""
    result = cli("check", "lraspp_mobilenet_v3_large", "-f", "json")
    report = _json(result)
    assert report["ok"] is True
    first = report["report"]["inputs"][0]
    assert first["shape"] == [2, 3, TRAIN_SEGMENTATION_SIZE, TRAIN_SEGMENTATION_SIZE]
    assert TRAIN_SEGMENTATION_NOTE in first["source"]
    shapes = json.loads(cli("shapes", "lraspp_mobilenet_v3_large", "-f", "json").stdout)
    assert shapes["inputs"][0]["shape"] == [1, 3, 520, 520]
