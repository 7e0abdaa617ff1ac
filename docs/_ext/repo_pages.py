"""Pages generated from the repository's own Markdown at every docs build: one per experiment folder that has a
README (docs/_generated/experiments/<folder>.md includes it, images and all), so a new experiment appears on the
site without anyone listing it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sphinx.application import Sphinx


def experiment_readmes(root: Path) -> list[Path]:
    """experiments/<folder>/README.md of every experiment folder, sorted."""
    return sorted(p for p in (root / "experiments").glob("*/README.md"))


def _write(app: Sphinx) -> None:
    src = Path(app.srcdir)
    out = src / "_generated" / "experiments"
    out.mkdir(parents=True, exist_ok=True)
    wanted = {}
    for readme in experiment_readmes(src.parent):
        rel = Path("..", "..", "..", readme.relative_to(src.parent)).as_posix()
        wanted[f"{readme.parent.name}.md"] = f"```{{include}} {rel}\n:relative-images:\n:relative-docs: ../../\n```\n"
    for stale in out.glob("*.md"):
        if stale.name not in wanted:
            stale.unlink()
    for name, text in wanted.items():
        page = out / name
        if not page.exists() or page.read_text(encoding="utf-8") != text:
            page.write_text(text, encoding="utf-8")


def setup(app: Sphinx) -> dict[str, bool]:
    app.connect("builder-inited", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
