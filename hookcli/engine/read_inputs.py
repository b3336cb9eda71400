"""Inputs read from files (``--input``): images (or folders of them), tensor files (.pt/.npy/.npz/.safetensors)
and tensors given in Python.

``hookcli.engine.build_inputs.make_inputs`` calls in here when ``--input`` is given; images are decoded with
torchvision.io (PIL as fallback) and preprocessed with the model's weights transforms when known.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hookcli.errors import InputError, UnsupportedError, UsageError, describe_exception
from hookcli.engine.input_types import (
    IMAGE_SUFFIXES,
    TENSOR_SUFFIXES,
    ModelInputs,
    pack_inputs,
    plural,
    transform_size,
)
from hookcli.engine.loading import UNPICKLE_IMPORT_HINT, LoadedModel, torch_load_failure
from hookcli.engine.stats import iter_tensors
from hookcli.limits import IMAGE_PIXELS, TENSOR_BYTES, check_size

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


# --------------------------------------------------------------------------- image files


def expand_files(files: Sequence[str | os.PathLike[str]]) -> tuple[str, list[Path], str]:
    """Check the files; return their kind ("images" | "tensors"), the paths and a source label."""
    kinds: set[str] = set()
    paths: list[Path] = []
    labels: list[str] = []
    for entry in files:
        text, path = os.fspath(entry), Path(entry)
        if path.is_dir():
            images = sorted(p for p in path.iterdir()
                            if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
            if not images:
                raise InputError(f"folder {text!r} has no images",
                                 hint="supported images: " + " ".join(IMAGE_SUFFIXES))
            kinds.add("images")
            paths.extend(images)
            labels.append(f"{text.rstrip('/' + os.sep)}/ ({plural(len(images), 'file')})")
            continue
        if not path.exists():
            raise InputError(f"input file not found: {text}",
                             hint="check the path (relative paths start at the current directory)")
        suffix = path.suffix.lower()
        if suffix not in IMAGE_SUFFIXES + TENSOR_SUFFIXES:
            raise InputError(f"unsupported input file {text!r}",
                             hint=f"supported: images {' '.join(IMAGE_SUFFIXES)}, tensors "
                             f"{' '.join(TENSOR_SUFFIXES)}, or a folder of images")
        kinds.add("images" if suffix in IMAGE_SUFFIXES else "tensors")
        paths.append(path)
        labels.append(text)
    if len(kinds) > 1:
        raise UsageError("cannot mix image files and tensor files as inputs",
                         hint="give either images (or folders of images) or tensor files")
    kind = kinds.pop()
    prefix = "image" if kind == "images" and len(files) == 1 and not Path(files[0]).is_dir() else kind
    shown = labels[:3] + ([f"... ({plural(len(paths), 'file')})"] if len(labels) > 3 else [])
    return kind, paths, f"{prefix}: " + ", ".join(shown)


def list_input_files(files: Sequence[str | os.PathLike[str]]) -> tuple[str, list[Path], str]:
    """The files ``files`` names, folders expanded to their images (sorted by name), unread.

    Returns the kind (``"images"`` or ``"tensors"``), the paths in the order ``make_inputs`` reads
    them, and the source label a report shows; raises as ``make_inputs`` does. Lets a caller run
    a large folder in batches (``hookcli features``): ``make_inputs(loaded, files=paths[i:j])``.
    """
    return expand_files(files)


def _check_pixels(path: Path) -> None:
    """InputError when the image's header gives more pixels than ``IMAGE_PIXELS``: checked before
    decoding (a 30000x30000 PNG of a few kilobytes decodes to gigabytes). A file PIL cannot
    identify is left to the decoders to refuse."""
    from PIL import Image, UnidentifiedImageError

    limit = IMAGE_PIXELS.value()
    pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # the size is judged here, below
    try:
        with Image.open(path) as im:  # reads the header only
            width, height = im.size
    except (UnidentifiedImageError, OSError, ValueError):
        return
    finally:
        Image.MAX_IMAGE_PIXELS = pil_limit
    if width * height > limit:
        raise IMAGE_PIXELS.exceeded(f"image {str(path)!r}", f"{width}x{height} = {width * height:,} pixels")


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path: Path) -> None:
    """InputError when a PNG is corrupt: a chunk's CRC is wrong or PIL cannot decode its data.

    torchvision's libpng decoder ends the whole process (SIGSEGV) on such files (a bad CRC, a
    broken deflate stream, a bad filter byte), so a PNG is checked before it reaches it: the CRCs
    here, the data by PIL, which raises instead. Called after ``_check_pixels``, so the decode is bounded.
    """
    import zlib

    from PIL import Image

    data = path.read_bytes()
    pos = len(PNG_SIGNATURE)
    problem = ""
    while pos + 12 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind, end = data[pos + 4:pos + 8], pos + 8 + length
        if end + 4 > len(data):
            break  # truncated: PIL below says so
        if zlib.crc32(data[pos + 4:end]) != int.from_bytes(data[end:end + 4], "big"):
            problem = f"the CRC of its {kind.decode('latin-1')!r} chunk is wrong"
            break
        pos = end + 4
        if kind == b"IEND":
            break
    if not problem:
        pil_limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None  # judged by _check_pixels
        try:
            with Image.open(io.BytesIO(data)) as im:
                im.load()
        except Exception as exc:
            problem = describe_exception(exc)
        finally:
            Image.MAX_IMAGE_PIXELS = pil_limit
    if problem:
        raise InputError(f"could not decode image {str(path)!r}: a corrupt PNG file: {problem}",
                         hint="is it a valid, complete image file? re-save it with an image editor or PIL")


def _decode(path: Path) -> torch.Tensor:
    """Decode an image file to a uint8 RGB CHW tensor (torchvision, falling back to PIL), after
    checking its size (``_check_pixels``) and, for a PNG, its soundness (``_check_png``)."""
    from torchvision.io import ImageReadMode, decode_image

    _check_pixels(path)
    with open(path, "rb") as fh:
        if fh.read(len(PNG_SIGNATURE)) == PNG_SIGNATURE:  # by content: decode_image sniffs it too
            _check_png(path)
    try:
        with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders (TorchCodec)
            warnings.simplefilter("ignore", DeprecationWarning)
            img = decode_image(str(path), mode=ImageReadMode.RGB)
        return img[0] if img.ndim == 4 else img  # animated GIF: first frame
    except Exception:
        pass  # BMP, TIFF, ... : PIL reads those
    try:
        from PIL import Image
        from torchvision.transforms.v2.functional import pil_to_tensor

        with Image.open(path) as im:
            return _pil_rgb(im, path, pil_to_tensor)
    except UnsupportedError:
        raise
    except Exception as exc:
        raise InputError(f"could not decode image {str(path)!r}: {describe_exception(exc)}",
                         hint="is it a valid, complete image file?") from exc


def _pil_rgb(im: Any, path: Path, pil_to_tensor: Any) -> torch.Tensor:
    """An image PIL opened as an RGB CHW tensor: uint8, or uint16 for 16-bit grey (a 16-bit TIFF, scaled
    to [0, 1] as a 16-bit PNG is). PIL's RGB conversion clips wider values to 0..255 (a 16-bit image
    comes out white, a float one black): 32-bit integer and float images, which have no standard scale,
    are UnsupportedError (exit 2) rather than silently wrong inputs."""
    import numpy as np

    if im.mode.startswith("I;16"):
        grey = torch.from_numpy(np.asarray(im).astype(np.uint16))
        return grey.unsqueeze(0).expand(3, -1, -1).contiguous()
    if im.mode in ("I", "F"):
        kind = "32-bit float" if im.mode == "F" else "32-bit integer"
        raise UnsupportedError(f"image {str(path)!r} holds {kind} pixels (PIL mode {im.mode}), which have no "
                               "standard scale to the 8-bit RGB a model's preprocessing expects",
                               hint="save the values the model should see as a tensor file (.npy, .pt), or the "
                                    "image as 8- or 16-bit")
    return pil_to_tensor(im.convert("RGB"))


def _generic_preprocess(img: torch.Tensor, crop: int | tuple[int, int] = 224, *, crop_pct: float = 224 / 256,
                        mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> torch.Tensor:
    """Resize the shorter side to crop / crop_pct (256 for a 224 crop) and center-crop, scale to
    [0, 1], normalise with ``mean``/``std`` (ImageNet's by default): the usual classification
    preprocessing when no preset exists (timm models give their own size, crop_pct, mean and std)."""
    import torchvision.transforms.v2.functional as F

    h, w = (crop, crop) if isinstance(crop, int) else crop
    img = F.center_crop(F.resize(img, [int(min(h, w) / crop_pct + 1e-6)], antialias=True), [h, w])
    img = F.to_dtype(img, torch.float32, scale=True)
    if img.shape[0] != len(mean):  # a model built for other channel counts (in_chans=1): grey
        img = img.mean(dim=0, keepdim=True).expand(len(mean), -1, -1)
    return F.normalize(img, list(mean), list(std))


def image_inputs(loaded: LoadedModel, paths: list[Path], label: str) -> ModelInputs:
    """Decode and preprocess images into the input form the model's family expects."""
    import torchvision.transforms.v2.functional as F

    raw = [_decode(p) for p in paths]
    family = loaded.family
    tf = loaded.weights_enum.transforms() if loaded.weights_enum is not None else None
    if family == "detection":  # a list of float CHW images in [0, 1], any sizes
        images = [F.to_dtype(img, torch.float32, scale=True) for img in raw]
        return pack_inputs([(images, f"{label}, list of {plural(len(images), 'image')}")])
    if family == "optical_flow":  # two frames, [0, 1] mapped to [-1, 1] as RAFT expects
        if len(raw) != 2 or raw[0].shape != raw[1].shape:
            got = ", ".join(f"{p.name} {list(r.shape)}" for p, r in zip(paths, raw))
            raise InputError(f"optical flow models take exactly two images of one size (got {got})",
                             hint="give two frames of one size: --input a.png --input b.png")
        pair = tf(*raw) if tf is not None else [
            F.normalize(F.to_dtype(r, torch.float32, scale=True), [0.5] * 3, [0.5] * 3) for r in raw]
        return pack_inputs([(t.unsqueeze(0), f"image: {p}") for t, p in zip(pair, paths)])
    if family == "video":  # the images are the frames of one clip: (1, C, T, H, W)
        frames = [tf(img.unsqueeze(0)) if tf is not None else _generic_preprocess(img).unsqueeze(1)
                  for img in raw]
        clip = torch.cat(frames, dim=1).unsqueeze(0)
        return pack_inputs([(clip, f"{label}, one clip of {plural(len(frames), 'frame')}")])
    if loaded.input_config is not None:  # timm: its pretrained_cfg's size, crop_pct, mean and std
        cfg = loaded.input_config
        out = [_generic_preprocess(img, tuple(cfg["input_size"][1:]), crop_pct=cfg["crop_pct"], mean=cfg["mean"],
                                   std=cfg["std"]) for img in raw]
        return pack_inputs([(torch.stack(out), f"{label}, preprocessed with the model's pretrained_cfg")])
    crop = _hf_image_size(loaded) or transform_size(loaded, "crop_size", 224)
    if tf is not None and family != "segmentation" and getattr(tf, "crop_size", [crop])[0] != crop:
        tf = None  # the preset crops for other weights than the model was built for (vit_h_14)
    out = [tf(img) if tf is not None else _generic_preprocess(img, crop) for img in raw]
    if any(t.shape != out[0].shape for t in out):
        sizes = ", ".join(f"{p.name} {list(t.shape)}" for p, t in zip(paths, out))
        raise InputError(f"images differ in size after preprocessing: {sizes}",
                         hint="give images of one aspect ratio, or one image at a time")
    return pack_inputs([(torch.stack(out), label)])


def _hf_image_size(loaded: LoadedModel) -> int | None:
    """The square image size of a transformers vision config (``image_size``), else None."""
    config = getattr(loaded.model, "config", None)
    size = getattr(getattr(config, "vision_config", None) or config, "image_size", None)
    return size if isinstance(size, int) and hasattr(config, "model_type") else None


# --------------------------------------------------------------------------- tensor files

Entry = tuple[str | None, Any, str]  # (keyword name, or None for positional; value; source)


def _split_keyed(data: dict[Any, Any], label: str) -> list[Entry]:
    """Numeric keys (``0``, ``arr_0``) -> positional in numeric order; other keys -> keyword."""
    index = {k: re.fullmatch(r"(?:arr_)?(\d+)", str(k)) for k in data}
    if data and all(index.values()):
        keys = sorted(data, key=lambda k: int(index[k].group(1)))  # type: ignore[union-attr]
        return [(None, data[k], f"file: {label}[{k}]") for k in keys]
    if bad := [k for k in data if not isinstance(k, str) or not k.isidentifier()]:
        raise InputError(f"{label}: keys {bad[:5]!r} are neither positions nor argument names",
                         hint="name tensors 0, 1, ... (positional) or after forward's arguments (keywords)")
    return [(k, v, f"file: {label}[{k}]") for k, v in data.items()]


def _capped_source(path: Path, label: str) -> Path:
    """``path`` itself when it is a regular file within ``TENSOR_BYTES``; a device, FIFO or socket is
    refused before any of it is read (``check_size``)."""
    check_size(path, TENSOR_BYTES, f"input file {label}")
    return path


def _check_expanded(source: Path | io.BytesIO, label: str) -> None:
    """InputError when the members of an .npz (a zip) expand past ``TENSOR_BYTES``, read from its
    directory before any member is (a small zip can hold gigabytes of zeros)."""
    import zipfile

    try:
        with zipfile.ZipFile(source) as archive:
            total = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not a zip: numpy says what it is
    finally:
        if isinstance(source, io.BytesIO):
            source.seek(0)
    if total > TENSOR_BYTES.value():
        raise TENSOR_BYTES.exceeded(f"input file {label}", f"its arrays expand to {total:,} bytes")


def _numpy_tensor(array: Any, label: str) -> torch.Tensor:
    """A numpy array as a tensor of its own values: a byte order other than the machine's (a
    ``>f4`` file) is converted, since torch refuses it; a dtype torch has no tensor for
    (structured, strings) is an InputError naming it."""
    import numpy as np

    array = np.array(array)
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(array)
    except TypeError as exc:
        raise InputError(f"input file {label} holds an array of numpy dtype {array.dtype}, which torch has no "
                         "tensor type for",
                         hint="save numeric or bool arrays (numpy.save / numpy.savez)") from exc


def _read_tensor_file(path: Path, label: str, family: str | None, trust_pickle: bool = False) -> list[Entry]:
    """Read one tensor file into positional / keyword entries (``trust_pickle``: a .pt/.pth file
    may hold any pickled object, e.g. a namedtuple of tensors; unpickling runs code from it)."""
    suffix = path.suffix.lower()
    try:
        source = _capped_source(path, label)
        if suffix in (".npy", ".npz"):
            import numpy as np

            if suffix == ".npz":
                _check_expanded(source, label)
            data = np.load(source, allow_pickle=False)
            if suffix == ".npy":
                return [(None, _numpy_tensor(data, label), f"file: {label}")]
            with data:
                return _split_keyed({k: _numpy_tensor(data[k], f"{label}[{k}]") for k in data.files}, label)
        if suffix == ".safetensors":
            from safetensors.torch import load, load_file

            tensors = load_file(str(path), device="cpu") if isinstance(source, Path) else load(source.getvalue())
            return _split_keyed(dict(tensors), label)
        obj = torch.load(source, map_location="cpu", weights_only=not trust_pickle)
    except ImportError as exc:
        if suffix in (".pt", ".pth"):  # unpickling imports the module of a class the file names
            raise InputError(f"could not read input file {label}: {describe_exception(exc)}",
                             hint=UNPICKLE_IMPORT_HINT) from exc
        raise InputError(f"reading {label} needs the {exc.name} package",
                         hint=f"pip install {exc.name}") from exc
    except InputError:
        raise
    except Exception as exc:
        if suffix in (".pt", ".pth"):
            message, hint = torch_load_failure(exc, f"input file {label}", trust_pickle,
                                               resave="torch.save(tensor_or_tuple_or_dict, PATH)")
            raise InputError(message, hint=hint) from exc
        raise InputError(f"could not read input file {label}: {describe_exception(exc)}",
                         hint=f"is it a complete {suffix} file of plain tensors?") from exc
    return _entries(obj, label, family)


def _entries(obj: Any, label: str, family: str | None) -> list[Entry]:
    """What a tensor file (or ``inputs=`` in Python) holds as positional / keyword entries."""
    if isinstance(obj, torch.Tensor):
        return [(None, obj, f"file: {label}")]
    if isinstance(obj, (list, tuple)):
        if family == "detection" and obj and all(
                isinstance(t, torch.Tensor) and t.ndim == 3 for t in obj):  # one list of images
            return [(None, list(obj), f"file: {label}, list of {plural(len(obj), 'image')}")]
        return [(None, v, f"file: {label}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        return _split_keyed(obj, label)
    raise InputError(f"{label} holds a {type(obj).__name__}, not a tensor, tuple or dict",
                     hint="save the inputs with torch.save(tensor_or_tuple_or_dict, PATH)")


def memory_inputs(loaded: LoadedModel, value: Any) -> ModelInputs:
    """Inputs given as tensors in Python (``inputs=``): read as the same object in a .pt file would be.
    Each tensor is a copy, so that a model changing its input in place leaves the caller's as it was."""
    entries = [(k, _copied(v), "python: inputs" + src.removeprefix("file: inputs"))
               for k, v, src in _entries(value, "inputs", loaded.family)]
    return _packed(entries)


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, list):
        return [_copied(v) for v in value]
    return value


def tensor_inputs(loaded: LoadedModel, files: Sequence[str | os.PathLike[str]], *,
                  trust_pickle: bool = False) -> ModelInputs:
    """Several tensor files: positional inputs in the given order, keyword inputs merged."""
    return _packed([e for f in files for e in _read_tensor_file(Path(f), os.fspath(f), loaded.family, trust_pickle)])


def _packed(entries: list[Entry]) -> ModelInputs:
    for _, value, source in entries:
        if any(t.is_meta for _, t in iter_tensors(value)):  # shapes without values: nothing to run on
            raise InputError(f"{source.removeprefix('file: ').removeprefix('python: ')} holds a meta tensor: it has "
                             "a shape but no values",
                             hint="save the input from a real device (tensor.cpu()), or give --input-shape instead")
    keyword = [(k, v, src) for k, v, src in entries if k is not None]
    names = [k for k, _, _ in keyword]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise InputError(f"keyword inputs given by more than one file: {', '.join(twice)}",
                         hint="give each keyword input in one file only")
    return pack_inputs([(v, src) for k, v, src in entries if k is None], keyword)
