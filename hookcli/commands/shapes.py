"""``shapes``: one forward pass without statistics, on the meta device whenever no values are needed."""

from __future__ import annotations

from typing import Any

from hookcli.engine.run import forward_report, prepare
from hookcli.engine.sources import smaller_config
from hookcli.engine.state import exclusive
from hookcli.errors import HookcliError, ModelImportError, ModelRaisedError, UnsupportedError, safe_str
from hookcli.options import RunOptions, model_is_instance
from hookcli.records import Report

META_NOTE = "ran on the meta device: shapes only, no memory for weights or activations (--device cpu: a real run)"


def wants_meta(opts: RunOptions) -> bool:
    """Shapes need no values: run on meta unless a device, input files or weights ask for real data."""
    if opts.meta is not None:
        return opts.meta
    return opts.device is None and not opts.inputs and opts.weights is None and not model_is_instance(opts.model)


def refuse_too_large(size: int | None, fallback: str, config: Any = None) -> None:
    """UnsupportedError (exit 2) when the weights of a model that cannot run on the meta device would not
    fit in this machine's memory: building it for real (a 7B model on the CPU) would be killed instead.
    ``config``: a transformers model's, whose layer count the hint names where the config keeps it."""
    from hookcli import limits

    memory = limits.memory_bytes()
    if size is None or memory is None or size <= memory // 2:
        return
    raise UnsupportedError(
        f"the model cannot run on the meta device ({fallback[:120]}), and its weights ({size / 2**30:.3g} GiB) "
        f"would not fit in this machine's memory ({memory / 2**30:.3g} GiB) to run it for real",
        hint=f"give --device with room for it (a GPU), or a smaller config (e.g. {smaller_config(config)})"
        if config is not None else "give --device with room for it (a GPU), or a smaller model")


def shapes_report(options: RunOptions) -> Report:
    """``shapes``: on the meta device when possible, else (or when the model cannot run there) for real."""
    with exclusive(options.model):
        return _shapes(options.validate())


def _shapes(opts: RunOptions) -> Report:
    fallback: str | None = None
    size: int | None = None  # bytes of the weights, as the meta build counted them
    config: Any = None  # a transformers model's config (the hint's smaller config)
    if wants_meta(opts):
        try:
            prep = prepare(opts, meta=True)
            size = prep.info.param_bytes + prep.info.buffer_bytes
            config = getattr(prep.loaded.model, "config", None)
            config = config if hasattr(config, "model_type") else None
            report = forward_report(prep, "shapes", stats=False, flops=opts.flops)
            report.notes.append(META_NOTE)
            return report
        except ModelImportError as exc:
            cause = exc.__cause__
            if cause is None:
                raise  # not the model's own code (no such class, not a module): the same on any device
            # the model's code raised while it was imported or built on meta (an init that reads values:
            # .item(), quantize_dynamic); built for real it runs, or raises the same error again
            fallback = f"{type(cause).__name__}: {cause}"
        except HookcliError as exc:
            if not isinstance(exc, ModelRaisedError):
                raise  # a usage error (unknown layer, bad input) is the same on any device
            fallback = f"{exc.report.failure.exception}: {exc.report.failure.message}" if exc.report and \
                exc.report.failure else str(exc)
        except Exception as exc:  # building on meta failed (an init that reads values)
            fallback = f"{type(exc).__name__}: {safe_str(exc)}"
    if fallback is not None:
        refuse_too_large(size, fallback, config)
    report = forward_report(prepare(opts), "shapes", stats=False, flops=opts.flops)
    if fallback is not None:
        report.notes.append(f"ran on cpu: the model cannot run on the meta device ({fallback[:160]})")
    return report
