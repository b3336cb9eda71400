"""Scale: shapes on the meta device, the real-run fallback, FLOPs, a 7B-parameter model, GPU syncs."""

from __future__ import annotations

import resource
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import hookcli
import tiny_models as tm

BIG_MODEL = Path(__file__).resolve().parent / "big_model.py"


def layer_shapes(report) -> list[tuple[str, int, str, list[int] | None, str | None]]:
    return [(r.name, r.call, r.output, r.shape, r.dtype) for r in report.layers]


@pytest.mark.parametrize("spec, kwargs", [
    ("resnet18", {"input_shapes": ["1x3x64x64"], "all_modules": True}),
    ("mobilenet_v3_small", {"input_shapes": ["2x3x64x64"], "depth": 2}),
    ("vit_b_16", {"model_args": {"image_size": 64}, "depth": 2}),
    ("tiny_models:TupleOut", {"input_shapes": ["2x4"], "all_modules": True}),
    ("tiny_models:TinyLSTM", {"input_shapes": ["2x6x5"], "all_modules": True}),
])
def test_meta_shapes_equal_real_shapes(spec: str, kwargs: dict) -> None:
    meta = hookcli.shapes(spec, **kwargs)
    real = hookcli.shapes(spec, device="cpu", **kwargs)
    assert meta.device == "meta" and real.device == "cpu"
    assert layer_shapes(meta) == layer_shapes(real)
    assert meta.model.params == real.model.params


def test_data_dependent_model_falls_back_to_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "picky.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn
        class Picky(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 4)
                self.head = nn.Linear(4, 2)
            def forward(self, x):
                h = self.fc(x)
                keep = h[h.sum(1) > -100]          # data-dependent shape: no meta kernel
                return self.head(keep)
    """))
    report = hookcli.shapes(f"{tmp_path / 'picky.py'}:Picky", input_shapes=["3x4"])
    assert report.device == "cpu"
    assert any("cannot run on the meta device" in n for n in report.notes)
    assert [(r.name, r.shape) for r in report.layers] == [("fc", [3, 4]), ("head", [3, 2])]


def test_flops_of_conv_and_linear_match_hand_computation() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    report = hookcli.shapes(model, input_shapes=["2x3x8x8"], flops=True)
    by_name = {r.name: r.flops for r in report.layers}
    conv = 2 * 2 * 8 * 8 * 8 * (3 * 3 * 3)  # 2 * batch * Cout * H * W * (Cin * kh * kw)
    linear = 2 * 2 * 512 * 10  # 2 * batch * in * out
    assert by_name == {"0": conv, "1": 0, "2": linear}
    assert report.flops == {"forward": conv + linear, "backward": None, "partial": False, "missing_ops": []}


def test_flops_of_reused_module_per_call_and_total_matches_flop_counter_mode() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    model = tm.Reused()
    report = hookcli.shapes(model, input_shapes=["5x4"], flops=True, all_modules=True)
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(5, 4))
    assert report.flops["forward"] == counter.get_total_flops() == 2 * 5 * (4 * 8 + 8 * 8 + 8 * 3)
    assert [r.flops for r in report.layers if r.name == "act"] == [0, 0, 0]
    grads = hookcli.grads(model, input_shapes=["5x4"], flops=True)
    assert grads.flops["forward"] == report.flops["forward"] and grads.flops["backward"] > 0


def test_resnet18_total_flops_match_flop_counter_mode_on_meta() -> None:
    from torch.utils.flop_counter import FlopCounterMode
    from torchvision.models import resnet18

    report = hookcli.shapes("resnet18", input_shapes=["1x3x64x64"], flops=True)
    assert report.device == "meta"
    with torch.device("meta"):
        model = resnet18()
    with FlopCounterMode(display=False) as counter:
        model(torch.empty(1, 3, 64, 64, device="meta"))
    assert report.flops["forward"] == counter.get_total_flops()
    assert sum(r.flops for r in report.layers) == counter.get_total_flops()  # children partition the model


def test_7b_parameter_model_is_inspected_on_meta_without_allocating_weights() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report = hookcli.shapes(f"{BIG_MODEL}:Big")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert report.device == "meta"
    assert report.model.params > 6.5e9 and report.model.param_bytes > 26e9  # 26 GB of float32 weights...
    assert grown_mb < 1500  # ...never allocated (this machine has less memory than that)
    assert report.layers[-1].shape == [1, 16, 32000]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_host_synchronisation_per_layer_on_cuda() -> None:
    from torchvision.models import resnet18

    from hookcli.engine.losses import build_loss
    from hookcli.engine.hooks import attach
    from hookcli.engine.taps import Gradients, Statistics
    from hookcli.engine.selection import select_modules

    model = resnet18().cuda().eval()
    x = torch.randn(2, 3, 64, 64, device="cuda", requires_grad=True)
    with attach(model, select_modules(model, all_modules=True), [Statistics(), Gradients()]) as session:
        torch.cuda.set_sync_debug_mode("error")  # any synchronising op inside raises
        try:
            loss = build_loss(model(x), loss="auto", target=0, output_key=None).value
            torch.autograd.grad(loss, [x])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    records, _ = session.records()  # the one transfer, after the run
    assert all(r.stats is not None and r.grad is not None for r in records if r.called)


@pytest.mark.parametrize("hooks", ["per-module", "process-wide"])
def test_device_statistics_and_gradient_hooks_never_read_a_value_back_on_the_host(hooks: str) -> None:
    """Where CI has no GPU, the same property on the meta device: a meta tensor has no values, so any
    host read of one (``item``, ``float``, ``bool``, ``tolist``, ``cpu``) raises. The accelerator path
    of the reducer on every layout, and a hooked forward and backward with gradient statistics, must
    leave every statistic a device tensor, read later in one transfer."""
    from torchvision.models import resnet18

    from hookcli.engine.losses import build_loss
    from hookcli.engine.selection import select_modules
    from hookcli.engine.hooks import attach
    from hookcli.engine.taps import Gradients
    from hookcli.engine.stats import SCALE, Reducer, merge

    base = torch.empty(4, 8, 6, 5, device="meta")
    layouts = [base, base.transpose(1, 3), base.contiguous(memory_format=torch.channels_last), base[:, ::2],
               torch.empty(5, device="meta").expand(3, 5), base.half(), base.bfloat16(), base.double(),
               torch.empty(0, 3, device="meta"), torch.empty((), device="meta")]
    vectors = []
    for t in layouts:
        vector = Reducer().reduce(t)
        assert isinstance(vector, torch.Tensor) and vector.is_meta and vector.shape == (SCALE + 1,)
        vectors.append(vector)
    merged = vectors[0]
    for vector in vectors[1:]:  # merging across calls, steps or ranks stays on the device too
        merged = merge(merged, vector)
    assert merged.is_meta and merged.shape == (SCALE + 1,)

    model = resnet18().to("meta").eval()
    x = torch.randn(2, 3, 64, 64, device="meta", requires_grad=True)
    model_modules = 1 if hooks == "process-wide" else None  # (1: the whole model is selected)
    with attach(model, select_modules(model, all_modules=True), [Gradients()],
                model_modules=model_modules) as session:
        loss = build_loss(model(x), loss="auto", target=0, output_key=None).value
        torch.autograd.grad(loss, [x])
    session.raise_error()  # a host read inside a hook is stored there, then raised here
    grads = [t.grad for call in session.calls for t in call.outputs if t.wants_grad]
    assert len(grads) == len(session.calls) and all(isinstance(g, torch.Tensor) and g.is_meta for g in grads)
