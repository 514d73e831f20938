"""pyproject.toml lists every Python package of the source tree (setuptools takes the explicit
list, so a new family's subpackage left out installs without it and fails only after install)."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _listed_packages() -> set[str]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(ROOT / "pyproject.toml", "rb") as f:
        return set(tomllib.load(f)["tool"]["setuptools"]["packages"])


def test_every_subpackage_is_listed():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cupyflash").rglob("__init__.py")
             if "__pycache__" not in p.parts}
    missing = sorted(found - _listed_packages())
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}"
