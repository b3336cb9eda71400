"""Every bad input: the right exit code, one ``Error:`` line plus one ``  hint:`` line, nothing else.

A table of bad command lines runs through the CLI in a scratch working directory; for each row the
test checks the exit code, that stderr is exactly the two lines (no traceback, no Click usage
block), that stdout is empty, and that no file or directory appeared. The Python API rows pass a
model instance and check it comes back untouched. The fixes the table found have their own tests
below (parent directories, JUnit time, float16 inputs, ``--model-arg`` values, channel lists).
"""

from __future__ import annotations

import ast
import json
import math
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hookcli
from hookcli import errors
from hookcli.errors import HookcliError, UsageError
from hookcli.commands.fmaps import compact_ranges, parse_channels
from hookcli.engine.build_inputs import make_inputs
from hookcli.options import parse_input_shape
from hookcli.engine.loading import from_instance
from hookcli.options import parse_model_args
from timeouts import scaled_timeout

MODEL_FILE = '''
import torch
from torch import nn


def build(width: int = 16):
    return nn.Sequential(nn.Linear(width, 32), nn.ReLU(), nn.Linear(32, 8))


def conv():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, x, mask):
        return self.lin(x) * mask


def boom():
    raise ValueError("factory exploded")


class NoCopy(nn.Module):  # a lock: copy.deepcopy raises
    def __init__(self):
        super().__init__()
        import threading
        self.lin = nn.Linear(16, 4)
        self.lock = threading.Lock()

    def forward(self, x):
        return self.lin(x)


class CatchAll(NoCopy):  # every missing attribute is a function (__deepcopy__, example_inputs, ...)
    def __init__(self):
        super().__init__()
        del self.lock

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return lambda *args, **kwargs: None


class Halt(BaseException):
    pass


class BadText(Exception):
    def __str__(self):
        raise ValueError("no text")


def halt():
    raise Halt("the factory halted")


class RaisesBase(NoCopy):
    def forward(self, x):
        raise Halt("halted by the model")


class RaisesBadText(NoCopy):
    def forward(self, x):
        raise BadText()


class RunsHookcli(NoCopy):  # calls hookcli on itself from its own forward
    def forward(self, x):
        import hookcli
        hookcli.stats(self, input_shapes=["2x16"])
        return self.lin(x)


class RefusesWeights(nn.Module):  # its own state-dict loader wants every key, as a quantized Linear once did
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def _load_from_state_dict(self, state_dict, prefix, *args):
        raise ValueError("this module loads only a complete state dict of its own format")

    def forward(self, x):
        return self.lin(x)


def quantized():  # static quantization: its layers output quint8 tensors, its state dict packs weights
    from torch.ao.nn import quantized as nnq
    gen = torch.Generator().manual_seed(0)
    lin = nnq.Linear(16, 8)
    lin.set_weight_bias(torch.quantize_per_tensor(torch.randn(8, 16, generator=gen) / 4, 0.01, 0, torch.qint8),
                        torch.randn(8, generator=gen))
    lin.scale, lin.zero_point = 0.05, 64
    return nn.Sequential(nnq.Quantize(0.05, 64, torch.quint8), lin, nnq.DeQuantize())


def exported():  # torch.export: a flattened graph whose train() and eval() raise
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU())
    return torch.export.export(model, (torch.randn(2, 16),)).module()


class Café(nn.Module):  # a module name outside ASCII and Latin-1
    def __init__(self):
        super().__init__()
        self.add_module("café模", nn.Linear(16, 4))

    def forward(self, x):
        return getattr(self, "café模")(x)
'''


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (RGB) and whose data is a few bytes: what a
    decoder would expand is known from the header alone."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def _corrupt_png(fault: str) -> bytes:
    """An 8x8 RGB PNG with one fault: ``"crc"`` (IDAT's CRC wrong) or ``"filter"`` (a row's filter
    byte is 7, with correct CRCs). torchvision's libpng decoder ended the process on both (SIGSEGV)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes, crc_xor: int = 0) -> bytes:
        crc = zlib.crc32(kind + data) ^ crc_xor
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    rows = b"".join((b"\7" if fault == "filter" else b"\0") + bytes(range(24)) for _ in range(8))
    ihdr = struct.pack(">IIBBBBB", 8, 8, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(rows), crc_xor=0xFF if fault == "crc" else 0) + chunk(b"IEND", b""))


def _zip_claiming(size: int, members: int) -> bytes:
    """A small .npz whose zip directory says each member expands to ``size`` bytes (as a zip bomb's
    does): the sizes are written into the local and central headers of small deflated members."""
    import io
    import struct
    import zipfile

    import numpy as np

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for i in range(members):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.zeros(1000 + i))
            archive.writestr(f"arr_{i}.npy", member.getvalue())
    data = bytearray(buffer.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        infos = archive.infolist()
    central = data.rfind(b"PK\x05\x06")
    start = struct.unpack_from("<I", data, central + 16)[0]
    for info in infos:
        struct.pack_into("<I", data, info.header_offset + 22, size)  # local header: uncompressed size
    offset = start
    for _ in infos:
        struct.pack_into("<I", data, offset + 24, size)  # central directory: uncompressed size
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, offset + 28)
        offset += 46 + name_len + extra_len + comment_len
    return bytes(data)


def _listing(root: Path) -> list[str]:
    """Every path under ``root`` (hidden temporary files included)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A scratch working directory holding the model files and bad input files the rows name."""
    (tmp_path / "lin.py").write_text(MODEL_FILE)
    (tmp_path / "syn.py").write_text("def oops(:\n")
    (tmp_path / "afile").write_text("a file, not a directory")
    (tmp_path / "corrupt.pt").write_bytes(b"\x80\x02 this is not a pickle" * 8)
    torch.save({"0.weight": torch.zeros(32, 16)}, tmp_path / "good.pt")
    (tmp_path / "trunc.pt").write_bytes((tmp_path / "good.pt").read_bytes()[:100])
    (tmp_path / "bad.png").write_bytes(b"\x89PNG but not really")
    (tmp_path / "malformed.json").write_text("{bad json")
    (tmp_path / "list.json").write_text("[]")
    (tmp_path / "badcall.json").write_text(json.dumps({"layers": [{"name": "0", "call": "x"}]}))
    (tmp_path / "badoutput.json").write_text(json.dumps({"layers": [{"name": "0", "output": [1]}]}))
    (tmp_path / "syntax.toml").write_text("fill = ones\n")
    (tmp_path / "unknown.toml").write_text('fil = "ones"\n')
    (tmp_path / "wrongtype.toml").write_text('seed = "zero"\n')
    (tmp_path / "pickle.toml").write_text("trust_pickle = true\n")
    (tmp_path / "negseed.toml").write_text("seed = -1\n")
    (tmp_path / "badrule.toml").write_text("[checks]\nfinit = true\n")
    (tmp_path / "escape.toml").write_text('output = "~/.bashrc"\n')
    (tmp_path / "readout.toml").write_text('input = "/etc/hostname"\n')
    (tmp_path / "numpyload.toml").write_text('model = "numpy:load"\nmodel_args = { file = "x.npy", allow_pickle = true }\n')
    (tmp_path / "inflr.toml").write_text("[checks.params_change]\nlr = inf\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "badtext.py").write_text(
        "class BadText(Exception):\n    def __str__(self):\n        raise ValueError('no text')\n\n\n"
        "raise BadText()\n")
    (tmp_path / "deep.toml").write_text("fill = " + "[" * 5000 + "]" * 5000 + "\n")
    torch.save(torch.empty(2, 16, device="meta"), tmp_path / "meta.pt")
    (tmp_path / "huge.png").write_bytes(_png_header(30000, 30000))
    (tmp_path / "bomb.npz").write_bytes(_zip_claiming(3_000_000_000, members=3))
    np.save(tmp_path / "struct.npy", np.zeros(2, dtype=[("a", "f4"), ("b", "i4")]))
    (tmp_path / "badcrc.png").write_bytes(_corrupt_png("crc"))
    (tmp_path / "badfilter.jpg").write_bytes(_corrupt_png("filter"))  # a PNG by content, named .jpg
    for name in ("huge.json", "huge.toml"):  # sparse: 65 MiB of zeros that take no disk
        with open(tmp_path / name, "wb") as fh:
            fh.truncate(65 << 20)
    monkeypatch.chdir(tmp_path)
    return tmp_path


LIN = "lin.py:build"
R18 = ("resnet18", "--input-shape", "1x3x32x32")

#: (id, argv, exit code, text the Error line must contain)
ROWS: list[tuple[str, list[str], int, str]] = [
    # sizes and seeds
    ("huge shape", ["stats", LIN, "--input-shape", "99999999x99999999"], 2, "needs"),
    ("overflowing shape", ["stats", LIN, "--input-shape", "9999999999999999999x99999999"], 2, "more than a tensor"),
    ("absurd dimension", ["stats", LIN, "--input-shape", "1" * 5000], 2, "bad input shape"),
    ("zero dimension", ["stats", LIN, "--input-shape", "0x16"], 2, "positive integers"),
    ("unknown shape dtype", ["stats", LIN, "--input-shape", "2x16:int9"], 2, "int9"),
    ("huge batch", ["stats", LIN, "--input-shape", "2x16", "--batch-size", "99999999999999"], 2, "needs"),
    ("negative seed", ["stats", LIN, "--seed", "-1"], 2, "--seed"),
    ("seed 2**70", ["stats", LIN, "--seed", str(2**70)], 2, "--seed"),
    ("seed expression", ["stats", LIN, "--seed", "2**70"], 2, "--seed"),
    # model arguments and model specs
    ("negative num_classes", ["stats", *R18, "--model-arg", "num_classes=-5"], 2, "num_classes=-5"),
    ("negative num_classes (shapes)", ["shapes", "resnet18", "--model-arg", "num_classes=-5"], 2, "num_classes=-5"),
    ("unknown torchvision kwarg", ["stats", *R18, "--model-arg", "bogus=1"], 2, "bogus"),
    ("torchvision weights through model-arg", ["stats", *R18, "--model-arg", "weights='DEFAULT'"], 2, "past --weights"),
    ("backbone weights through model-arg", ["shapes", "fasterrcnn_resnet50_fpn", "--model-arg",
                                            "weights_backbone='DEFAULT'"], 2, "weights_backbone would"),
    ("timm checkpoint through model-arg", ["stats", "timm:resnet18", "--model-arg", "checkpoint_path='good.pt'"], 2,
     "checkpoint_path is not a model argument"),
    ("unparseable model-arg", ["stats", LIN, "--model-arg", "width=[1,2"], 2, "not a Python literal"),
    ("empty model-arg value", ["stats", LIN, "--model-arg", "width="], 2, "empty value"),
    ("model-arg without =", ["stats", LIN, "--model-arg", "width"], 2, "KEY=VALUE"),
    ("model-arg of wrong type", ["stats", LIN, "--model-arg", "width=foo"], 2, "width='foo'"),
    ("unknown model", ["stats", "resnt18"], 2, "resnt18"),
    ("timm: without a name", ["shapes", "timm:"], 2, "timm: needs a model name"),
    ("empty model spec", ["stats", ""], 2, "empty"),
    ("missing attribute", ["stats", "lin.py:missing"], 2, "missing"),
    ("missing model file", ["stats", "nofile.py:Net"], 2, "nofile.py"),
    ("syntax error in model file", ["stats", "syn.py:Net"], 2, "SyntaxError"),
    ("factory raising", ["stats", "lin.py:boom"], 2, "factory exploded"),
    # weights
    ("missing weights", ["stats", LIN, "--weights", "nope.pt"], 2, "nope.pt"),
    ("weights from a device", ["stats", LIN, "--weights", "/dev/null"], 2, "weights file /dev/null is a device"),
    ("corrupt .pt weights", ["stats", LIN, "--weights", "corrupt.pt"], 2, "corrupt"),
    ("truncated .pt weights", ["stats", LIN, "--weights", "trunc.pt"], 2, "corrupt or truncated"),
    ("weights of another model", ["stats", LIN, "--weights", "good.pt"], 2, "do not fit"),
    ("weights name for a user model", ["stats", LIN, "--weights", "DEFAULT"], 2, "DEFAULT"),
    ("unknown torchvision weights", ["stats", *R18, "--weights", "IMAGENET9K"], 2, "IMAGENET9K"),
    # inputs
    ("missing input file", ["stats", LIN, "--input", "nope.png"], 2, "nope.png"),
    ("unreadable image", ["stats", LIN, "--input", "bad.png"], 2, "bad.png"),
    ("corrupt .pt input", ["stats", LIN, "--input", "corrupt.pt"], 2, "corrupt"),
    ("structured .npy input", ["stats", LIN, "--input", "struct.npy"], 2, "numpy dtype [('a', '<f4')"),
    ("PNG with a bad CRC", ["stats", LIN, "--input", "badcrc.png"], 2, "CRC of its 'IDAT' chunk"),
    ("PNG with a bad filter byte", ["stats", LIN, "--input", "badfilter.jpg"], 2, "a corrupt PNG file"),
    ("folder without images", ["stats", LIN, "--input", "folder"], 2, "no images"),
    ("unsupported input file", ["stats", LIN, "--input", "lin.py"], 2, "unsupported input file"),
    ("too many inputs", ["stats", LIN, "--input-shape", "2x16", "--input-shape", "2x16"], 2, "too many"),
    ("too few inputs", ["stats", "lin.py:Two", "--input-shape", "2x16"], 2, "mask"),
    ("wrong-shape input: the model raised", ["stats", LIN, "--input-shape", "2x17"], 1, "the model raised"),
    ("negative batch size", ["stats", LIN, "--batch-size", "-1"], 2, "--batch-size"),
    ("bad fill", ["stats", LIN, "--fill", "noise"], 2, "--fill"),
    # selection and run options
    ("unknown layer", ["stats", LIN, "--layers", "bogus"], 2, "bogus"),
    ("negative depth", ["stats", LIN, "--depth", "-1"], 2, "--depth"),
    ("unknown type", ["stats", LIN, "--types", "Bogus"], 2, "Bogus"),
    ("bad dtype", ["stats", LIN, "--dtype", "int9"], 2, "int9"),
    ("bad device", ["stats", LIN, "--device", "tpu"], 2, "tpu"),
    ("bad loss", ["grads", LIN, "--loss", "hinge"], 2, "--loss"),
    ("negative target", ["grads", LIN, "--target", "-1"], 2, "--target"),
    ("target past the classes", ["grads", LIN, "--loss", "ce", "--target", "99"], 2, "--target 99"),
    ("zero clip", ["grads", LIN, "--clip", "0"], 2, "--clip"),
    ("nan clip", ["grads", LIN, "--clip", "nan"], 2, "--clip"),
    ("unknown option", ["stats", LIN, "--bogus"], 2, "--bogus"),
    ("unknown command", ["stat", LIN], 2, "stat"),
    # config files
    ("missing config", ["stats", LIN, "--config", "nope.toml"], 2, "nope.toml"),
    ("bad config TOML", ["stats", LIN, "--config", "syntax.toml"], 2, "not valid TOML"),
    ("unknown config key", ["stats", LIN, "--config", "unknown.toml"], 2, "fil"),
    ("wrong type in config", ["stats", LIN, "--config", "wrongtype.toml"], 2, "seed"),
    ("negative seed in config", ["stats", LIN, "--config", "negseed.toml"], 2, "seed"),
    ("trust_pickle in config", ["stats", LIN, "--config", "pickle.toml"], 2, "trust_pickle"),
    ("unknown check rule", ["check", LIN, "--config", "badrule.toml"], 2, "finit"),
    ("config output outside its directory", ["stats", LIN, "--config", "escape.toml"], 2, "'output'"),
    ("config input outside the repository", ["stats", LIN, "--config", "readout.toml"], 2, "'input'"),
    ("config model numpy:load", ["stats", "--config", "numpyload.toml"], 2, "numpy:load"),
    ("infinite threshold in config", ["check", LIN, "--config", "inflr.toml"], 2, "'lr'"),
    # check baselines and CI outputs
    ("malformed baseline JSON", ["check", LIN, "--baseline", "malformed.json"], 2, "baseline"),
    ("baseline not an object", ["check", LIN, "--baseline", "list.json"], 2, "baseline"),
    ("baseline with a bad call", ["check", LIN, "--baseline", "badcall.json"], 2, "call"),
    ("baseline with a bad output", ["check", LIN, "--baseline", "badoutput.json"], 2, "output"),
    ("missing baseline", ["check", LIN, "--baseline", "nope.json"], 2, "nope.json"),
    ("junit under a file", ["check", LIN, "--junit", "afile/report.xml"], 2, "not a directory"),
    # outputs
    ("output under a file", ["stats", LIN, "-o", "afile/r.json"], 2, "not a directory"),
    ("output is a directory", ["stats", LIN, "-o", "folder"], 2, "folder"),
    ("output extension vs --format", ["stats", LIN, "-o", "r.json", "--format", "csv"], 2, "json"),
    ("features output extension", ["features", LIN, "-o", "feats.txt"], 2, "unsupported file type"),
    ("fmaps output extension", ["fmaps", "lin.py:conv", "--layer", "0", "-o", "maps.jpg"], 2, "PNG"),
    # fmaps options
    ("fmaps huge scale", ["fmaps", "lin.py:conv", "--layer", "0", "--scale", "100000", "-o", "m.png"], 2, "--scale"),
    ("fmaps image too big", ["fmaps", "lin.py:conv", "--layer", "0", "--input-shape", "1x3x512x512",
                             "--scale", "200", "-o", "m.png"], 2, "the image would be"),
    ("fmaps channel range", ["fmaps", "lin.py:conv", "--layer", "0", "--input-shape", "1x3x8x8",
                             "--channels", "0-100000", "-o", "m.png"], 2, "8 channels"),
    ("fmaps absurd channel range", ["fmaps", "lin.py:conv", "--layer", "0", "--channels", "0-99999999999999",
                                    "-o", "m.png"], 2, "more than"),
    ("fmaps bad channels", ["fmaps", "lin.py:conv", "--layer", "0", "--channels", "a-b", "-o", "m.png"], 2,
     "--channels"),
    ("fmaps sample past the batch", ["fmaps", "lin.py:conv", "--layer", "0", "--input-shape", "1x3x8x8",
                                     "--sample", "5", "-o", "m.png"], 2, "--sample 5"),
    ("fmaps call never made", ["fmaps", "lin.py:conv", "--layer", "0", "--input-shape", "1x3x8x8",
                               "--call", "3", "-o", "m.png"], 2, "--call 3"),
    ("fmaps unknown layer", ["fmaps", "lin.py:conv", "--layer", "bogus", "-o", "m.png"], 2, "bogus"),
    ("fmaps without --layer", ["fmaps", "lin.py:conv", "-o", "m.png"], 2, "--layer"),
    # faults of the model's code (issue #20 part 3): never exit 3
    ("check of an uncopyable model", ["check", "lin.py:NoCopy"], 2, "cannot be deep-copied: TypeError"),
    ("check of a catch-all __getattr__", ["check", "lin.py:CatchAll"], 2, "copy.deepcopy gave a NoneType"),
    ("forward raising a BaseException", ["stats", "lin.py:RaisesBase"], 1, "Halt: halted by the model"),
    ("forward raising a BaseException (grads)", ["grads", "lin.py:RaisesBase"], 1, "Halt: halted by the model"),
    ("forward raising a BaseException (diff)", ["diff", "lin.py:RaisesBase"], 1, "Halt: halted by the model"),
    ("exception whose __str__ raises", ["stats", "lin.py:RaisesBadText"], 1, "BadText whose __str__ raised"),
    ("factory raising a BaseException", ["stats", "lin.py:halt"], 1, "Halt (a BaseException): the factory halted"),
    ("import raising an unprintable exception", ["stats", "badtext.py:Net"], 2, "BadText whose __str__ raised"),
    ("hookcli from the model's forward", ["stats", "lin.py:RunsHookcli"], 2, "already running this model"),
    ("hookcli's own entry point as MODEL", ["stats", "hookcli.cli.main:main"], 2, "called again"),
    ("diff whose run B refuses A's weights", ["diff", "lin.py:RefusesWeights", "--input-shape", "2x16"], 2,
     "cannot take run A's weights"),
    ("a torch.export'ed module", ["stats", "lin.py:exported", "--input-shape", "2x16"], 2, "torch.export"),
    ("input .pt holding a meta tensor", ["stats", LIN, "--input", "meta.pt"], 2, "meta tensor"),
    ("deeply nested TOML", ["stats", LIN, "--config", "deep.toml"], 2, "too deeply"),
    # sizes: every read has a limit, checked before anything is decoded or expanded
    ("30000x30000 PNG", ["stats", LIN, "--input", "huge.png"], 2, "30000x30000 = 900,000,000 pixels"),
    ("npz zip bomb", ["stats", LIN, "--input", "bomb.npz"], 2, "expand to 9,000,000,000 bytes"),
    ("huge --baseline", ["check", LIN, "--baseline", "huge.json"], 2, "over the limit of 64 MiB"),
    ("huge --config", ["stats", LIN, "--config", "huge.toml"], 2, "over the limit of 64 MiB"),
]


@pytest.mark.parametrize("argv, code, needle", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_with_a_hint(cli, workdir: Path, argv: list[str], code: int, needle: str) -> None:
    before = _listing(workdir)
    result = cli(*argv)
    lines = result.stderr.splitlines()
    assert result.exit_code == code, result.stderr
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("Error: ") and needle in lines[0], result.stderr
    assert "internal error" not in lines[0]
    assert lines[1].startswith("  hint: ") and len(lines[1].strip()) > len("hint: ") + 5, result.stderr
    assert all(len(line) <= errors.MAX_MESSAGE + len("  hint: ") for line in lines)
    if code == 2:  # exit 1 (the model raised) prints the rows gathered before the failure, by design
        assert result.stdout == ""
    assert _listing(workdir) == before  # nothing written: no report, no temp file, no directory


def test_table_covers_every_example_of_the_issue() -> None:
    assert len(ROWS) >= 40 and len({r[0] for r in ROWS}) == len(ROWS)


def test_a_long_error_is_cut_to_one_short_line(cli, workdir: Path) -> None:
    """--channels 0-100000 used to print every index (588 KB); the message names ranges."""
    result = cli("fmaps", "lin.py:conv", "--layer", "0", "--input-shape", "1x3x8x8", "--channels",
                 ",".join(str(i) for i in range(0, 200000, 2)), "-o", "m.png")
    assert result.exit_code == 2
    assert len(result.stderr) < 2 * errors.MAX_MESSAGE + 50 and len(result.stderr.splitlines()) == 2


# --------------------------------------------------------------------------- Python API, model untouched


def _snapshot(model: nn.Module) -> dict[str, Any]:
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "training": [m.training for m in model.modules()],
        "requires_grad": [p.requires_grad for p in model.parameters()],
        "grads": [p.grad for p in model.parameters()],
        "hooks": [len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
                  for m in model.modules()],
        "dtype_device": [(p.dtype, p.device) for p in model.parameters()],
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (a["state"].keys() == b["state"].keys()
            and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
            and all(a[k] == b[k] for k in a if k != "state"))


API_ROWS: list[tuple[str, str, dict[str, Any], type[HookcliError]]] = [
    ("huge shape", "stats", {"input_shapes": ["99999999x99999999"]}, errors.InputError),
    ("negative seed", "stats", {"seed": -1}, UsageError),
    ("seed 2**70", "stats", {"seed": 2**70}, UsageError),
    ("float seed", "stats", {"seed": 1.5}, UsageError),
    ("too many inputs", "stats", {"input_shapes": ["2x16", "2x16"]}, errors.InputError),
    ("bad dtype", "grads", {"dtype": "int9"}, UsageError),
    ("bad device", "stats", {"device": "tpu"}, UsageError),
    ("bad fill", "stats", {"fill": "noise"}, UsageError),
    ("unknown layer", "grads", {"layers": "bogus"}, errors.LayerNotFoundError),
    ("model args for an instance", "stats", {"model_args": {"width": 3}}, UsageError),
    ("model args not a dict", "stats", {"model_args": ["width=3"]}, UsageError),
    ("nan clip", "grads", {"clip": float("nan")}, UsageError),
    ("target past the classes", "grads", {"loss": "ce", "target": 99}, UsageError),
    ("negative batch", "stats", {"batch_size": -2}, UsageError),
    ("malformed baseline", "check", {"baseline": "malformed.json"}, errors.ConfigError),
    ("misspelt option", "stats", {"input_shape": ["2x16"]}, UsageError),
    ("misspelt option (check)", "check", {"layer": "0"}, UsageError),
    ("layers not strings", "stats", {"layers": 5}, UsageError),
    ("weights not a path", "stats", {"weights": 5}, UsageError),
    ("input shapes not a list", "stats", {"input_shapes": 2}, UsageError),
    ("fmaps channel range", "fmaps", {"layer": "0", "channels": "0-100000"}, UsageError),
    ("fmaps huge scale", "fmaps", {"layer": "0", "scale": 100000}, UsageError),
    ("fmaps channels not ints", "fmaps", {"layer": "0", "channels": [0.5]}, UsageError),
]


@pytest.mark.parametrize("function, kwargs, error", [r[1:] for r in API_ROWS], ids=[r[0] for r in API_ROWS])
def test_bad_input_through_the_api_leaves_the_model_untouched(
        workdir: Path, function: str, kwargs: dict[str, Any], error: type[HookcliError]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).train()
    before = _snapshot(model)
    listing = _listing(workdir)
    with pytest.raises(error) as info:
        getattr(hookcli, function)(model, **kwargs)
    assert info.value.exit_code == 2
    assert info.value.hint and "\n" not in errors.one_line(info.value.message)
    assert len(info.value.message) <= errors.MAX_MESSAGE
    assert _same(_snapshot(model), before)
    assert _listing(workdir) == listing


# --------------------------------------------------------------------------- hints are structural


def test_every_error_class_has_a_default_hint() -> None:
    classes = [errors.HookcliError]
    for cls in classes:
        classes.extend(cls.__subclasses__())
    assert errors.UnsupportedError in classes and errors.InternalError in classes
    for cls in classes:
        assert cls("x").hint and len(cls.default_hint) > 10, cls
        assert cls("x", hint="do this").hint == "do this"


def test_every_usage_error_raised_in_the_package_names_a_hint() -> None:
    """Each ``raise XError(...)`` of the exit-2 family in hookcli/ passes ``hint=``: the default
    hint is a safety net, not the message a user should get."""
    usage = {name for name, obj in vars(errors).items()
             if isinstance(obj, type) and issubclass(obj, UsageError)}
    package = Path(hookcli.__file__).parent
    missing = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                func = node.exc.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if name in usage and not any(k.arg == "hint" for k in node.exc.keywords):
                    missing.append(f"{path.relative_to(package)}:{node.lineno} {name}")
    assert usage >= {"UsageError", "InputError", "ConfigError", "OutputError", "UnsupportedError"}
    assert missing == []


def test_one_line_flattens_and_cuts() -> None:
    assert errors.one_line("a\n  b\r\n\tc") == "a b c"
    long = errors.one_line("x " * 1000)
    assert len(long) == errors.MAX_MESSAGE and long.endswith("...")
    exc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate\n"
                       "Exception raised from ... frame #0")
    assert errors.describe_exception(exc) == "RuntimeError: DefaultCPUAllocator: can't allocate"


# --------------------------------------------------------------------------- what the table fixed


def test_junit_and_output_create_missing_parent_directories(cli, workdir: Path) -> None:
    """One behaviour for both: missing parent directories are created, only when writing."""
    result = cli("check", LIN, "--junit", "reports/ci/junit.xml", "-o", "out/deeper/check.json")
    assert result.exit_code == 0, result.stderr
    assert json.loads((workdir / "out/deeper/check.json").read_text())["command"] == "check"
    ET.parse(workdir / "reports/ci/junit.xml")
    failed = cli("check", LIN, "--layers", "bogus", "--junit", "never/junit.xml", "-o", "never2/c.json")
    assert failed.exit_code == 2 and not (workdir / "never").exists() and not (workdir / "never2").exists()


def test_junit_reports_the_time_the_check_took(cli, workdir: Path) -> None:
    result = cli("check", LIN, "--junit", "junit.xml")
    assert result.exit_code == 0, result.stderr
    root = ET.parse(workdir / "junit.xml").getroot()
    suite = root.find("testsuite")
    assert suite is not None
    cases = {case.get("name"): float(case.get("time", "nan")) for case in suite.iter("testcase")}
    assert cases["runs"] > 0  # the forward and backward pass took time
    assert all(t >= 0 for t in cases.values())
    assert float(suite.get("time", "nan")) >= cases["runs"] and root.get("time") == suite.get("time")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dummy_inputs_take_the_model_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).to(dtype)
    report = hookcli.stats(model, input_shapes=["3x8"], layers="0")
    name = str(dtype).removeprefix("torch.")
    assert [i.dtype for i in report.inputs] == [name]
    row = report.layers[0]
    assert row.dtype == name
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0)).to(dtype)  # seed 0, as documented
    with torch.no_grad():
        expected = model[0](x).float()
    assert math.isclose(row.stats["mean"], expected.mean().item(), rel_tol=1e-3, abs_tol=1e-3)
    assert math.isclose(row.stats["max"], expected.max().item(), rel_tol=1e-3, abs_tol=1e-3)
    explicit = make_inputs(from_instance(model), shapes=[parse_input_shape("3x8:float32")])
    assert explicit.args[0].dtype == torch.float32  # a dtype the user wrote is kept


def test_inputs_bind_to_forward_before_running(cli, workdir: Path) -> None:
    ok = cli("stats", "lin.py:Two", "--input-shape", "2x16", "--input-shape", "2x4", "-f", "json")
    assert ok.exit_code == 0, ok.stderr
    too_few = cli("stats", "lin.py:Two", "--input-shape", "2x16")
    error, hint = too_few.stderr.splitlines()
    assert "Two.forward" in error and "'mask'" in error
    assert hint.startswith("  hint: forward(x, mask):") and "--input-shape" in hint


def test_seed_bounds_are_inclusive() -> None:
    model = nn.Sequential(nn.Linear(4, 2))
    for seed in (0, 2**64 - 1):
        report = hookcli.stats(model, input_shapes=["2x4"], seed=seed)
        assert report.inputs[0].source == f"randn(seed={seed})"


def test_model_arg_values() -> None:
    parsed = parse_model_args(["name=gelu_new", "path=weights/x.pt", "hub=bert-base-uncased",
                               "quoted='a b'", "n=-5", "dims=[1, 2]", "none=None"])
    assert parsed == {"name": "gelu_new", "path": "weights/x.pt", "hub": "bert-base-uncased", "quoted": "a b",
                      "n": -5, "dims": [1, 2], "none": None}
    for bad in ("n=[1,2", "n=3x", "n={a: 1}", "n=a b", "n=", "n=relu(inplace)"):
        with pytest.raises(UsageError) as info:
            parse_model_args([bad])
        assert "quote" in (info.value.hint or "")
    with pytest.raises(UsageError, match="twice"):
        parse_model_args(["n=1", "n=2"])


_LITERALS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=3), inner,
                                                                                            max_size=3),
    max_leaves=6)


@settings(max_examples=60, deadline=None)
@given(value=_LITERALS, word=st.from_regex(r"[A-Za-z_][A-Za-z0-9_.\-/]{0,12}", fullmatch=True))
def test_model_arg_literals_round_trip(value: Any, word: str) -> None:
    assert parse_model_args([f"v={value!r}"]) == {"v": value}
    literal = word in ("True", "False", "None")
    assert parse_model_args([f"w={word}"]) == {"w": ast.literal_eval(word) if literal else word}


def test_channel_lists_are_capped_and_shown_as_ranges() -> None:
    assert compact_ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"
    assert compact_ranges(range(0, 40, 2), limit=3) == "0,2,4,..."
    assert parse_channels("0-3,8") == [0, 1, 2, 3, 8]
    with pytest.raises(UsageError, match="more than"):
        parse_channels("0-99999999999999")



# --------------------------------------------------------------------------- faults around the model and the streams


def test_catch_all_getattr_gives_no_example_inputs(cli, workdir: Path) -> None:
    """``model.example_inputs`` of a catch-all ``__getattr__`` is a function returning None: not inputs."""
    result = cli("shapes", "lin.py:CatchAll", "-f", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["inputs"][0]["shape"] != None  # noqa: E711 - a guessed shape, not None


def test_a_forward_raising_a_base_exception_keeps_the_model_and_its_rows() -> None:
    """The API raises ModelRaisedError (exit 1) for a BaseException of the model's; Ctrl-C stays Ctrl-C."""
    class Halt(BaseException):
        pass

    class Net(nn.Module):
        def __init__(self, error: BaseException) -> None:
            super().__init__()
            self.lin, self.error = nn.Linear(4, 2), error

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise self.error

    model = Net(Halt("stop"))
    before = _snapshot(model)
    with pytest.raises(errors.ModelRaisedError) as info:
        hookcli.stats(model, input_shapes=["2x4"])
    assert info.value.exit_code == 1 and "Halt: stop" in info.value.message
    assert [r.name for r in info.value.report.layers] == ["lin"]
    assert _same(_snapshot(model), before)
    with pytest.raises(KeyboardInterrupt):
        hookcli.stats(Net(KeyboardInterrupt()), input_shapes=["2x4"])


def _hookcli(tmp_path: Path, *args: str, env: dict[str, str] | None = None, **kwargs: Any):
    import os
    import subprocess
    import sys

    root = Path(hookcli.__file__).resolve().parent.parent
    full = {**os.environ, "PYTHONPATH": str(root), **(env or {})}
    full.pop("HOOKCLI_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "hookcli", *args], cwd=tmp_path, env=full, timeout=scaled_timeout(300),
                          **kwargs)


def test_a_reader_that_leaves_ends_the_run_quietly(workdir: Path) -> None:
    """``hookcli stats ... | head -1``: the reader is gone when the report is written; exit 141
    (128 + SIGPIPE, as for a Unix tool) and nothing on stderr. The same when stderr's reader left
    (click alone would exit 1 then: "the model failed")."""
    import os
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left before the first byte
    try:
        proc = _hookcli(workdir, "stats", LIN, "--input-shape", "2x16", stdout=write_end, stderr=subprocess.PIPE)
        error = _hookcli(workdir, "stats", LIN, "--layers", "bogus", stdout=subprocess.PIPE, stderr=write_end)
        wrote = _hookcli(workdir, "stats", LIN, "-o", "r.json", stdout=subprocess.PIPE, stderr=write_end)
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == b""
    assert error.returncode == 141 and error.stdout == b""
    assert wrote.returncode == 141 and json.loads((workdir / "r.json").read_text())["command"] == "stats"


def test_stdout_on_a_full_device_or_closed_is_one_error_line(workdir: Path) -> None:
    import os
    import subprocess

    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with open("/dev/full", "w") as full:
        proc = _hookcli(workdir, "stats", LIN, "--input-shape", "2x16", stdout=full, stderr=subprocess.PIPE,
                        text=True)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 2 and lines[0].startswith("Error: cannot write the report to stdout"), proc.stderr
    assert lines[1].startswith("  hint: ")
    closed = _hookcli(workdir, "stats", LIN, "--input-shape", "2x16", stdout=subprocess.DEVNULL,
                      stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1))  # >&-
    assert closed.returncode == 2, closed.stderr
    assert closed.stderr.splitlines()[0] == "Error: stdout is closed: the report has nowhere to go"


@pytest.mark.parametrize("fmt", ["table", "csv"])
def test_an_encoding_without_the_characters_still_writes_the_report(workdir: Path, fmt: str) -> None:
    """Latin-1 has neither the table's box lines nor the module's name: escaped, not UnicodeEncodeError."""
    import subprocess

    proc = _hookcli(workdir, "stats", "lin.py:Café", "--input-shape", "2x16", "-f", fmt,
                    env={"PYTHONIOENCODING": "latin-1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr
    assert "caf\xe9\\u6a21".encode("latin-1") in proc.stdout and proc.stderr == b""
    bad = _hookcli(workdir, "stats", "lin.py:Café", "--layers", "café模x", env={"PYTHONIOENCODING": "latin-1"},
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert bad.returncode == 2 and bad.stderr.startswith(b"Error: ") and b"\\u6a21" in bad.stderr


@pytest.mark.parametrize("suffix", [".safetensors", ".npz"])
def test_features_of_a_quantized_model_are_saved_dequantized(cli, workdir: Path, suffix: str) -> None:
    """safetensors and numpy have no quint8: the values are saved as float32, and the report says so."""
    import numpy as np
    from safetensors.torch import load_file

    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(3))
    torch.save(x, workdir / "x.pt")
    result = cli("features", "lin.py:quantized", "--input", "x.pt", "-o", f"q{suffix}")
    assert result.exit_code == 0, result.stderr
    assert "1: quint8 (quantized) saved dequantized as float32" in result.stdout  # the report's notes
    namespace: dict[str, Any] = {}
    exec(compile(MODEL_FILE, "lin.py", "exec"), namespace)
    model = namespace["quantized"]().eval()
    with torch.no_grad():
        expected = model[1](model[0](x)).dequantize()
    if suffix == ".npz":
        with np.load(workdir / "q.npz") as data:
            saved = torch.from_numpy(data["1"])
    else:
        saved = load_file(str(workdir / "q.safetensors"))["1"]
    assert saved.dtype == torch.float32 and torch.equal(saved, expected)


# --------------------------------------------------------------------------- size limits, raised or lowered


def test_the_limits_apply_to_real_files_and_can_be_raised(cli, workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real compressed .npz and a real PNG, checked against lowered limits; raising them lets the
    same files through (the environment variable the message names is the one that works)."""
    import numpy as np
    from PIL import Image

    np.savez_compressed(workdir / "zeros.npz", np.zeros((2, 16), dtype=np.float32))  # 128 bytes of data
    Image.new("RGB", (40, 30)).save(workdir / "small.png")
    monkeypatch.setenv("HOOKCLI_MAX_TENSOR_BYTES", "100")
    monkeypatch.setenv("HOOKCLI_MAX_IMAGE_PIXELS", "1000")
    for argv, needle in ((["--input", "zeros.npz"], "HOOKCLI_MAX_TENSOR_BYTES"),
                         (["--input", "small.png"], "HOOKCLI_MAX_IMAGE_PIXELS")):
        result = cli("stats", "lin.py:conv" if "png" in argv[1] else LIN, *argv)
        assert result.exit_code == 2, result.stderr
        error, hint = result.stderr.splitlines()
        assert "too large" in error and needle in hint
    monkeypatch.setenv("HOOKCLI_MAX_TENSOR_BYTES", "1000000")
    monkeypatch.setenv("HOOKCLI_MAX_IMAGE_PIXELS", "1200")
    assert cli("stats", LIN, "--input", "zeros.npz").exit_code == 0
    assert cli("stats", "lin.py:conv", "--input", "small.png").exit_code == 0
    monkeypatch.setenv("HOOKCLI_MAX_IMAGE_PIXELS", "lots")
    bad = cli("stats", "lin.py:conv", "--input", "small.png")
    assert bad.exit_code == 2 and bad.stderr.startswith("Error: HOOKCLI_MAX_IMAGE_PIXELS='lots'")


@pytest.mark.parametrize("name, argv, what", [
    ("endless.pt", ["stats", LIN, "--input", "endless.pt"], "input file"),
    ("endless.json", ["check", LIN, "--baseline", "endless.json"], "baseline file"),
    ("endless.toml", ["stats", LIN, "--config", "endless.toml"], "config file"),
])
def test_an_endless_fifo_is_refused_unread(cli, workdir: Path, monkeypatch: pytest.MonkeyPatch, name: str,
                                           argv: list[str], what: str) -> None:
    """A FIFO that keeps sending (as /dev/zero would) is refused before any of it is read (it was read
    up to the limit, 4 GiB for a tensor file). The writer stops by itself after 80 MiB, so that a
    regression fails this test instead of filling the memory."""
    import os
    import threading

    monkeypatch.setenv("HOOKCLI_MAX_TENSOR_BYTES", "1000000")
    fifo = workdir / name
    os.mkfifo(fifo)
    sent = [0]

    def write() -> None:
        try:
            with open(fifo, "wb") as out:
                while sent[0] < 80 << 20:
                    out.write(b"\0" * 65536)
                    sent[0] += 65536
        except BrokenPipeError:
            pass

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    result = cli(*argv)
    deadline = time.monotonic() + scaled_timeout(60)
    while writer.is_alive() and time.monotonic() < deadline:
        # a reader opens and goes: the writer's open returns, and its next write breaks
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(timeout=scaled_timeout(0.1))
    assert result.exit_code == 2, result.stderr
    assert f"{what} " in result.stderr.splitlines()[0] and "is a FIFO" in result.stderr.splitlines()[0]
    assert sent[0] <= 65536  # hookcli read nothing: at most one write went into the pipe's buffer, which the
    # open above let in before the pipe broke


def test_check_without_params_change_needs_no_copy(cli, workdir: Path) -> None:
    """With params_change off, an uncopyable model is checked; the second look (which steps a copy) is
    skipped, so the dead layer is judged on the one run, as for a copyable model without it."""
    (workdir / "nocopy.py").write_text(
        "import threading\nimport broken_models\n\n\n"
        "class NoCopyDead(broken_models.DeadLayer):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lock = threading.Lock()\n")
    (workdir / "nochange.toml").write_text("[checks.params_change]\nenabled = false\n")
    result = cli("check", "nocopy.py:NoCopyDead", "--input-shape", "4x4", "--config", "nochange.toml", "-f", "json")
    assert result.exit_code == 1, result.stderr
    assert "deep-copied" not in result.stderr
    rules = {r["rule"]: r for r in json.loads(result.stdout)["rules"]}
    assert "params_change" not in rules
    assert rules["max_zero_fraction"]["status"] == "FAIL" and rules["runs"]["status"] == "PASS"


def test_a_closed_stderr_loses_only_the_diagnostics(workdir: Path) -> None:
    """``2>&-``: the run still writes its -o FILE and exits 0; nothing it opens takes descriptor 2."""
    import os
    import subprocess

    proc = _hookcli(workdir, "stats", LIN, "--input-shape", "2x16", "-o", "r.json", stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, preexec_fn=lambda: os.close(2))
    assert proc.returncode == 0 and proc.stdout == b""
    assert json.loads((workdir / "r.json").read_text())["command"] == "stats"


def test_diff_of_a_quantized_model_against_itself_compares_its_quantized_outputs(cli, workdir: Path) -> None:
    """A quantized state dict (packed weights, a dtype) reaches run B with its version data: nothing differs,
    and the quantized layer's row is there (the run B that could not take A's weights was exit 2 once)."""
    result = cli("diff", "lin.py:quantized", "--input-shape", "2x16", "-f", "json")
    assert result.exit_code == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["rows"]}
    assert rows["1"]["a"]["dtype"] == rows["1"]["b"]["dtype"] == "quint8"
    assert rows["1"]["status"] == "ok" and rows["1"]["errors"]["max_abs"] == 0.0
