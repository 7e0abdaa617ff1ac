"""The repository refers to nothing outside itself: the method and the team's notes live in docs/."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Built from pieces so that this file does not match its own patterns.
OUTSIDE = re.compile("|".join([re.escape(".." + "/shared"), re.escape("LOGRA" + ".md"), re.escape("DESIGN" + ".md"),
                               re.escape("STYLE" + ".md")]))
SECTION = re.compile(r"docs/method\.md §(\d+)")


def _tracked_texts():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    for name in files.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        try:
            yield name, path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary files (images) cannot hold a reference
            continue


def test_no_tracked_file_refers_outside_the_repository():
    found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for name, text in _tracked_texts() for m in OUTSIDE.finditer(text)]
    assert not found, "references outside the repository (point them into docs/):\n" + "\n".join(found)


def test_method_sections_cited_exist():
    method = (ROOT / "docs" / "method.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^## §(\d+) ", method, flags=re.MULTILINE))
    assert sections == {str(n) for n in range(1, 8)}
    cited = {(name, m.group(1)) for name, text in _tracked_texts() for m in SECTION.finditer(text)}
    assert cited, "nothing cites docs/method.md by section"
    missing = sorted(f"{name}: §{n}" for name, n in cited if n not in sections)
    assert not missing, f"citations of sections docs/method.md does not have: {missing}"
