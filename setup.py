"""The package list, found rather than listed: every package under ``t1async/``, and those under
``actors/`` and ``envs/`` as ``t1async.actors.*`` and ``t1async.envs.*`` (the
``[tool.setuptools.package-dir]`` mapping in pyproject.toml says where they live). setuptools'
``[tool.setuptools.packages.find]`` cannot rename a folder, hence this file; everything else is in
pyproject.toml."""

from setuptools import find_packages, setup

packages = find_packages(include=["t1async", "t1async.*"])
for top in ("actors", "envs"):
    packages += [f"t1async.{name}" for name in find_packages(include=[top, f"{top}.*"])]
setup(packages=packages)
