"""kvcompile's package list, found rather than written by hand (everything else is in pyproject.toml): a new method
or recipe package is in the wheel without an edit here. The runtime, kvruntime, is a distribution of its own
(runtime/pyproject.toml) that kvcompile depends on. The shipped folders are mapped into the package
(`[tool.setuptools.package-dir]`) so that a wheel finds them (kvcompile/shipped.py)."""

from setuptools import find_packages, setup

PACKAGES = [
    *find_packages(include=["kvcompile", "kvcompile.*"]),
    "kvcompile._shipped.artifacts",
    "kvcompile._shipped.calibration_data",
]

if __name__ == "__main__":
    setup(packages=PACKAGES)
