"""CI's closing account of the test steps, from the JUnit XML each pytest step writes (`.ci/run`).

    python .ci/summary.py REPORT_DIR STEP [STEP ...]

One line per step (`core: 1131 passed, 0 failed, 32 skipped`), the notebooks' line out of the core step, and the
check that no skip hides a failure: every test that the core step skipped for want of a compile-only or engine
venv (its reason names `make venv-…`) must have passed in one of the later steps, which build those venvs. Exits 1
when a step's report is missing, a test failed, or such a skip ran nowhere; the last line is the total.
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

NEEDS_VENV = re.compile(r"make (venv-[a-z0-9]+)")
NOTEBOOKS = "tests.colab.test_notebooks"


@dataclass
class Step:
    """The outcome of every test case of one pytest run, keyed by (module, name)."""

    name: str
    outcomes: dict[tuple[str, str], str] = field(default_factory=dict)
    reasons: dict[tuple[str, str], str] = field(default_factory=dict)

    def count(self, module: str = "") -> dict[str, int]:
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        for (mod, _), outcome in self.outcomes.items():
            if mod.startswith(module):
                counts[outcome] += 1
        return counts


def read_step(path: Path, name: str) -> Step:
    """A step's test cases; a module skipped (or failed) at collection is one case named by the module."""
    step = Step(name)
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname") or case.get("name", "")
        key = (module, case.get("name", ""))
        if case.find("failure") is not None or case.find("error") is not None:
            step.outcomes[key] = "failed"
        elif (skipped := case.find("skipped")) is not None:
            step.outcomes[key] = "skipped"
            step.reasons[key] = f"{skipped.get('message', '')} {skipped.text or ''}"
        else:
            step.outcomes[key] = "passed"
    return step


def line(label: str, counts: dict[str, int]) -> str:
    return f"{label}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"


def unrun_skips(steps: list[Step]) -> list[str]:
    """The first step's skips for want of a venv that no later step passed (a skipped module counts as run when
    any test of that module passed later)."""
    first, later = steps[0], steps[1:]
    passed = {key for step in later for key, outcome in step.outcomes.items() if outcome == "passed"}
    missing = []
    for key, reason in first.reasons.items():
        venv = NEEDS_VENV.search(reason)
        if venv is None:
            continue
        module, name = key
        ran = key in passed if module != name else any(mod == module for mod, _ in passed)
        if not ran:
            missing.append(f"{module}::{name} (skipped for want of {venv.group(1)})")
    return missing


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder, names = Path(argv[0]), argv[1:]
    steps, ok = [], True
    for name in names:
        path = folder / f"{name}.xml"
        if not path.is_file():
            print(f"{name}: no report ({path}): the step did not run its tests")
            ok = False
            continue
        steps.append(read_step(path, name))
        print(line(name, steps[-1].count()))
        if steps[-1].name == names[0]:
            print(line("  notebooks", steps[-1].count(NOTEBOOKS)))
    total = {k: sum(step.count()[k] for step in steps) for k in ("passed", "failed", "skipped")}
    ok = ok and total["failed"] == 0
    if steps and steps[0].name == names[0]:
        missing = unrun_skips(steps)
        for test in missing:
            print(f"not run anywhere: {test}")
        print(f"skips of {names[0]} for want of a venv, not run by a later step: {len(missing)}")
        ok = ok and not missing
    print(line("total", total))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
