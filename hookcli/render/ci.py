"""CI outputs of ``hookcli check`` as text: JUnit XML, GitHub Actions annotations and the job summary.

Never imports torch, writes nothing: the command line's edge (``hookcli.cli.ci``) writes them. Annotations (``::error title=...::message``) go to **stderr**: the Actions
runner reads workflow commands from both streams, and stdout stays clean for ``--format json``.
Escaping follows GitHub's toolkit (``@actions/core`` ``command.ts``): in messages ``%``, ``\\r`` and
``\\n`` become ``%25``, ``%0D`` and ``%0A``; property values (``title``, ``file``) also escape ``:``
and ``,`` as ``%3A`` and ``%2C``. Before that, text from the model (module names in messages, the
model spec) has its control characters written as visible escapes (``\\x1b``, ``\\n``, ``\\u202e``):
a name can neither colour the log nor start a line (a workflow command) of its own. The same goes
for the JUnit XML, whose viewers show text as it is.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET

from hookcli.escape import escape_control
from hookcli.records import CheckResult, RuleResult
from hookcli.render import render

#: How many offenders an annotation or a JUnit failure lists (JSON lists them all).
MAX_LISTED = 10
_COMMANDS = {"FAIL": "error", "WARN": "warning"}
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


def escape_data(text: str) -> str:
    """Escape a workflow-command message: ``%`` -> ``%25``, CR -> ``%0D``, LF -> ``%0A``."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """Escape a workflow-command property value: as :func:`escape_data`, plus ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def rule_text(rule: RuleResult, limit: int = MAX_LISTED) -> str:
    """The rule's message, then one line per offender (at most ``limit``); each line escaped
    (:func:`~hookcli.escape.escape_control`), so only these line breaks remain."""
    lines = [escape_control(rule.message)]
    if len(rule.violations) > 1:
        lines += [f"- {escape_control(v.get('message') or v.get('where'))}" for v in rule.violations[:limit]]
        if len(rule.violations) > limit:
            lines.append(f"- ... {len(rule.violations) - limit} more")
    return "\n".join(lines)


def _repo_path(path: str | None) -> str | None:
    """``path`` relative to the working directory (the checkout in Actions), or None outside it."""
    if not path:
        return None
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return None
    return None if rel.startswith("..") else rel.replace(os.sep, "/")


def annotations(result: CheckResult) -> list[str]:
    """One ``::error``/``::warning`` command per FAIL/WARN rule, pointing at the config file."""
    file = _repo_path(result.config)
    lines = []
    for rule in result.rules:
        command = _COMMANDS.get(rule.status)
        if command is None:
            continue
        where = f" at {rule.offender}" if rule.offender else ""
        title = escape_control(f"hookcli check {rule.rule}{where} ({result.model.spec})")
        props = [f"title={escape_property(title)}"]
        if file:
            props.insert(0, f"file={escape_property(escape_control(file))}")
        lines.append(f"::{command} {','.join(props)}::{escape_data(rule_text(rule))}")
    return lines


def _xml(text: str) -> str:
    """Text for an XML attribute or element: control characters escaped (which leaves none that
    XML 1.0 forbids; the substitution is a second guard)."""
    return _XML_INVALID.sub("\ufffd", escape_control(text))


def _seconds(value: float | None) -> str:
    """JUnit's ``time`` (seconds, millisecond precision); 0 for what did not run."""
    return f"{max(value or 0.0, 0.0):.3f}"


def junit_xml(result: CheckResult) -> str:
    """A JUnit XML document: one ``testcase`` per rule; FAIL -> ``failure``, SKIP -> ``skipped``."""
    counts = result.counts()
    totals = {"tests": str(len(result.rules)), "failures": str(counts["failed"]), "errors": "0",
              "skipped": str(counts["skipped"]), "time": _seconds(result.seconds)}
    spec = result.model.spec
    suites = ET.Element("testsuites", name="hookcli check", **totals)
    suite = ET.SubElement(suites, "testsuite", name=_xml(f"hookcli check {spec}"), **totals)
    props = ET.SubElement(suite, "properties")
    for name, value in (("model", spec), ("class", result.model.class_name), ("config", result.config or ""),
                        ("hookcli", result.version)):
        ET.SubElement(props, "property", name=name, value=_xml(str(value)))
    classname = "hookcli.check." + re.sub(r"[^A-Za-z0-9_]+", "_", result.model.class_name)
    for rule in result.rules:
        case = ET.SubElement(suite, "testcase", name=rule.rule, classname=classname, time=_seconds(rule.seconds))
        summary = f"{rule.status} ({rule.severity}): {rule.message}"
        if rule.status == "FAIL":
            failure = ET.SubElement(case, "failure", message=_xml(rule.message), type=rule.rule)
            failure.text = _XML_INVALID.sub("\ufffd", rule_text(rule))  # escaped line by line
        elif rule.status == "SKIP":
            ET.SubElement(case, "skipped", message=_xml(rule.message))
        ET.SubElement(case, "system-out").text = _xml(summary)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def step_summary(result: CheckResult) -> str:
    """The text appended to ``$GITHUB_STEP_SUMMARY``: the Markdown rendering of ``result``."""
    return render(result, "markdown") + "\n"


__all__ = ["annotations", "escape_data", "escape_property", "junit_xml", "rule_text", "step_summary"]
