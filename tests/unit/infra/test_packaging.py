"""The wheel holds every module: packages are found from pyproject's patterns, not listed."""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[3]


def test_every_source_package_is_found_by_the_packaging_patterns() -> None:
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = find["packages"]["find"]["include"]
    found = set(find_packages(ROOT, include=patterns))
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in ROOT.rglob("__init__.py")
        if p.parts[len(ROOT.parts)] not in {"tests", ".venv", "build"}
        and "site-packages" not in p.parts
    }
    assert on_disk, "no packages found on disk"
    assert on_disk <= found, f"packages the wheel would miss: {sorted(on_disk - found)}"
    assert not any(name.startswith("tests") for name in found)


def test_the_data_files_ship_with_their_packages() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert data["package-data"] == {"infra": ["*.sql"], "schemas": ["jsonschema/*.json"]}
    assert list((ROOT / "infra").glob("*.sql"))
    assert list((ROOT / "schemas" / "jsonschema").glob("*.json"))
