"""kvcompile's wheel carries every package and the shipped folders (setup.py finds the packages; pyproject maps the
shipped folders into the package)."""

from __future__ import annotations

import runpy
import tomllib
from pathlib import Path

from kvcompile.shipped import SHIPPED_FOLDERS, shipped_folder

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_and_shipped_folder_is_in_the_wheel_list():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # kvruntime is its own distribution (tests/test_runtime_distribution.py)
    folders = {"kvcompile": ROOT / "kvcompile"}
    found = {
        ".".join((top, *init.parent.relative_to(folder).parts))
        for top, folder in folders.items()
        for init in folder.rglob("__init__.py")
    }
    packages = set(runpy.run_path(str(ROOT / "setup.py"), run_name="packages")["PACKAGES"])
    assert found <= packages
    mapped = {name: ROOT / path for name, path in setuptools["package-dir"].items()}
    for name in SHIPPED_FOLDERS:
        assert mapped[f"kvcompile._shipped.{name}"] == shipped_folder(name)  # the checkout's folder is the one shipped
        patterns = setuptools["package-data"][f"kvcompile._shipped.{name}"]
        shipped = {p for pattern in patterns for p in shipped_folder(name).glob(pattern)}
        tracked = {
            p
            for p in shipped_folder(name).rglob("*")
            if p.is_file() and p.suffix in (".md", ".safetensors", ".png", ".gz", ".txt", ".json")
        }
        assert tracked == shipped  # no shipped file left out of the wheel
