"""scripts/readme_performance.py rewrites only the README's mma.sync subsection."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import readme_performance as rp  # noqa: E402


def test_rewrite_replaces_only_the_mma_sync_subsection():
    text = ("# x\n\n## Performance at a glance\n\nkeep 1\n\n## Performance\n\n### Forward on the H100\n\nkeep 2\n\n"
            f"{rp.HEADING}\n\nold table\n\n{rp.END}\n\nkeep 3\n")
    out = rp.rewrite(text, f"{rp.HEADING}\n\nnew table\n\n")
    assert "old table" not in out and "new table" in out
    for kept in ("## Performance at a glance", "keep 1", "### Forward on the H100", "keep 2", rp.END, "keep 3"):
        assert kept in out


def test_rewrite_needs_both_markers_in_order():
    with pytest.raises(ValueError):
        rp.rewrite("## Performance\n\nno subsection\n", "x")
    with pytest.raises(ValueError):
        rp.rewrite(f"{rp.END}\n{rp.HEADING}\n", "x")


def test_the_readme_has_the_markers():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert readme.index(rp.HEADING) < readme.index(rp.END)
