"""Gradients (``hookcli.grads``) compared with torch.autograd.grad computed independently in the test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookcli
import tiny_models as tm
from reference import dummy
from hookcli.errors import ModelRaisedError


def assert_grad_matches(stats: dict, grad: torch.Tensor) -> None:
    g = grad.detach().double()
    assert stats["mean"] == pytest.approx(g.mean().item(), rel=1e-4, abs=1e-9)
    assert stats["std"] == pytest.approx(g.std(correction=0).item(), rel=1e-4, abs=1e-9)
    assert stats["min"] == pytest.approx(g.min().item(), rel=1e-4, abs=1e-9)
    assert stats["max"] == pytest.approx(g.max().item(), rel=1e-4, abs=1e-9)
    assert stats["norm"] == pytest.approx(g.norm().item(), rel=1e-4, abs=1e-9)
    assert stats["nan_count"] == 0 and stats["inf_count"] == 0


@pytest.fixture(scope="module")
def resnet18() -> nn.Module:
    from torchvision.models import resnet18

    torch.manual_seed(0)
    return resnet18(weights=None).eval()


def test_resnet18_layer4_output_and_fc_weight_gradients(resnet18: nn.Module) -> None:
    report = hookcli.grads(resnet18, input_shapes=["2x3x64x64"], layers=["layer4"], params="all")
    (layer4,) = report.layers
    assert layer4.name == "layer4" and layer4.shape == [2, 512, 2, 2]
    # independent: the same forward split at layer4, cross-entropy against class 0
    m = resnet18
    x = dummy(2, 3, 64, 64).requires_grad_()
    h = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    l4 = m.layer4(m.layer3(m.layer2(m.layer1(h))))
    logits = m.fc(torch.flatten(m.avgpool(l4), 1))
    loss = F.cross_entropy(logits, torch.zeros(2, dtype=torch.long))
    g_l4, g_fc, g_conv1 = torch.autograd.grad(loss, [l4, m.fc.weight, m.conv1.weight])
    assert_grad_matches(layer4.grad, g_l4)
    assert report.loss["kind"] == "cross_entropy" and report.loss["value"] == pytest.approx(loss.item(), rel=1e-5)
    params = {p.name: p for p in report.params}
    assert list(params) == [n for n, _ in m.named_parameters()]  # named_parameters() order
    assert_grad_matches(params["fc.weight"].grad, g_fc)
    assert_grad_matches(params["conv1.weight"].grad, g_conv1)
    fc = params["fc.weight"]
    assert fc.norm == pytest.approx(m.fc.weight.norm().item(), rel=1e-5)
    assert fc.grad["abs_max"] == pytest.approx(g_fc.abs().max().item(), rel=1e-5)
    assert all(p.grad is None for p in m.parameters())  # .grad untouched


def test_in_place_relu_gets_correct_gradients_every_call(resnet18: nn.Module) -> None:
    """layer1.0.relu (inplace=True) is called twice per block: one gradient record per call."""
    report = hookcli.grads(resnet18, input_shapes=["1x3x64x64"], layers=["layer1.0.relu", "layer1.0.bn2"],
                           params="none")
    relu = [r for r in report.layers if r.name == "layer1.0.relu"]
    assert [r.call for r in relu] == [0, 1]
    m, block = resnet18, resnet18.layer1[0]
    x = dummy(1, 3, 64, 64)
    h = m.maxpool(m.relu(m.bn1(m.conv1(x))))
    r0 = torch.relu(block.bn1(block.conv1(h)))
    bn2 = block.bn2(block.conv2(r0))
    r1 = torch.relu(bn2 + h)
    rest = m.layer4(m.layer3(m.layer2(m.layer1[1](r1))))
    logits = m.fc(torch.flatten(m.avgpool(rest), 1))
    loss = F.cross_entropy(logits, torch.zeros(1, dtype=torch.long))
    g_r0, g_r1, g_bn2 = torch.autograd.grad(loss, [r0, r1, bn2])
    assert_grad_matches(relu[0].grad, g_r0)
    assert_grad_matches(relu[1].grad, g_r1)
    bn2_record = next(r for r in report.layers if r.name == "layer1.0.bn2")
    assert_grad_matches(bn2_record.grad, g_bn2)  # before the in-place `out += identity`


def test_reused_module_gradient_per_call_and_input_grads() -> None:
    model = tm.Reused()
    report = hookcli.grads(model, input_shapes=["3x4"], layers=["act"], loss="sum", input_grads=True)
    x = dummy(3, 4).requires_grad_()
    a0 = torch.relu(model.fc1(x))
    a1 = torch.relu(model.fc2(a0))
    p2 = a1 * 2.0
    a2 = torch.relu(p2)
    out = model.head(a2)
    grads = torch.autograd.grad(out.sum(), [a0, a1, a2, p2])
    records = [r for r in report.layers if r.name == "act"]
    assert [r.call for r in records] == [0, 1, 2]
    for record, g in zip(records, grads[:3]):
        assert_grad_matches(record.grad, g)
    assert_grad_matches(records[2].grad_input[0], grads[3])
    assert report.loss["kind"] == "sum"


def test_tuple_output_gradients_each_element() -> None:
    model = tm.TupleOut()
    report = hookcli.grads(model, input_shapes=["2x4"], layers=["split"], output_key="out")
    x = dummy(2, 4)
    h = model.stem(x)
    a, b = h[:, :2], h[:, 2:] * 3.0
    out = model.heads(a, b)
    assert report.loss["output"] == "['out']" and report.loss["kind"] == "cross_entropy"
    loss = F.cross_entropy(out["out"], torch.zeros(2, dtype=torch.long))
    g_a, g_b = torch.autograd.grad(loss, [a, b], allow_unused=True)
    by_label = {r.label: r for r in report.layers}
    assert_grad_matches(by_label["split[0]"].grad, g_a)
    assert g_b is None and by_label["split[1]"].grad is None  # only 'aux' uses it: no gradient flows
    assert by_label["split[2]"].grad is None  # integer mask: no gradient


def test_clip_matches_clamping_by_hand() -> None:
    model = tm.Scaled(width=3, scale=50.0)
    report = hookcli.grads(model, input_shapes=["4x4"], loss="sum", clip=0.5, params="all")
    x = dummy(4, 4)
    gw, gb = torch.autograd.grad((model(x)).sum(), [model.fc.weight, model.fc.bias])
    params = {p.name: p for p in report.params}
    assert_grad_matches(params["fc.weight"].grad, gw.clamp(-0.5, 0.5))
    assert_grad_matches(params["fc.bias"].grad, gb.clamp(-0.5, 0.5))
    assert params["fc.weight"].clipped == int((gw.abs() > 0.5).sum()) > 0
    assert params["fc.bias"].clipped == int((gb.abs() > 0.5).sum())
    assert not any(p._backward_hooks for p in model.parameters())  # clip hooks removed


def test_grad_and_requires_grad_are_restored() -> None:
    model = tm.Reused()
    model.fc1.weight.requires_grad_(False)
    marker = torch.full_like(model.fc2.weight, 7.0)
    model.fc2.weight.grad = marker
    report = hookcli.grads(model, input_shapes=["3x4"], params="all")
    assert model.fc1.weight.requires_grad is False
    assert model.fc2.weight.grad is marker and torch.equal(marker, torch.full_like(marker, 7.0))
    assert model.fc1.bias.grad is None and model.head.weight.grad is None
    params = {p.name: p for p in report.params}
    assert params["fc1.weight"].requires_grad is False and params["fc1.weight"].grad is None
    assert params["fc1.bias"].grad is not None


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[override]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        raise RuntimeError("boom in backward")


class BackwardRaises(nn.Module):
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return _Boom.apply(x)

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.boom = BackwardRaises.Boom()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.boom(self.fc(x)))


def test_backward_that_raises_names_the_module_and_keeps_rows() -> None:
    model = BackwardRaises().train()
    with pytest.raises(ModelRaisedError) as info:
        hookcli.grads(model, input_shapes=["2x4"])
    err = info.value
    assert err.phase == "backward" and err.module == "boom" and err.input_shapes == [[2, 4]]
    rows = {r.name: r for r in err.report.layers}
    assert rows["head"].grad is not None  # gradients that arrived before the failure are kept
    assert rows["fc"].grad is None
    assert model.training and all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name, args", [
    ("mobilenet_v3_small", ["1x3x64x64"]),
    ("vit_b_16", ["1x3x64x64"]),
])
def test_torchvision_models_run_without_in_place_errors(name: str, args: list[str]) -> None:
    kwargs = {"model_args": {"image_size": 64}} if name == "vit_b_16" else {}
    report = hookcli.grads(name, input_shapes=args, **kwargs)
    called = [r for r in report.layers if r.called]
    assert called and all(r.grad is not None for r in called if r.dtype and r.dtype.startswith("float"))
