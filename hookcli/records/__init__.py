"""Plain data that hookcli computes and renderers read (never tensors; renderers never import torch).

``core``: the inspection report (shapes, stats, grads) — ``Report.to_dict()`` *is* the JSON format;
``exports``: features / fmaps results; ``checks``: the check gate's results; ``diff``: two runs compared; ``watch``: a training loop's logged steps; ``watch_report``: one statistic of a watch log (``hookcli report``). Everything is re-exported
here, so ``from hookcli.records import Report`` works for all of them.
"""

from hookcli.records import statistics
from hookcli.records.attention import AttentionLayer, OutputLogits
from hookcli.records.checks import CheckResult, RuleResult
from hookcli.records.core import (
    GRAD_KEYS,
    SCHEMA,
    STAT_EXTRA_KEYS,
    STAT_KEYS,
    FailureInfo,
    GradStats,
    InputInfo,
    LayerRecord,
    ModelInfo,
    ModelList,
    ModuleRow,
    ModuleTree,
    ParamRecord,
    Report,
    Shape,
    Stats,
)
from hookcli.records.diff import DiffReport, DiffRow, Errors, Tolerance
from hookcli.records.exports import ChannelRecord, FeatureExport, FeatureMaps, SavedTensor
from hookcli.records.watch import (
    WATCH_SCHEMA, WATCH_STAT_KEYS, Finding, Histogram, NonfiniteCause, WatchLayer, WatchParam, WatchRun, WatchStep,
)
from hookcli.records.watch_report import ReportSeries, WatchReport

__all__ = [
    "AttentionLayer", "OutputLogits",
    "GRAD_KEYS", "SCHEMA", "STAT_EXTRA_KEYS", "STAT_KEYS", "ChannelRecord", "CheckResult", "DiffReport", "DiffRow", "Errors", "FailureInfo", "FeatureExport",
    "FeatureMaps", "GradStats", "InputInfo", "LayerRecord", "ModelInfo", "ModelList", "ModuleRow",
    "ModuleTree", "ParamRecord", "Report", "RuleResult", "SavedTensor", "Shape", "Stats", "Tolerance",
    "WATCH_SCHEMA", "WATCH_STAT_KEYS", "Finding", "Histogram", "NonfiniteCause", "WatchLayer", "WatchParam",
    "WatchRun", "WatchStep", "ReportSeries", "WatchReport", "statistics",
]
