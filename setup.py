"""One build step on top of pyproject.toml (which holds all the metadata): the wheel carries the
built-in configs and assets.

``configs/`` and ``assets/`` stay at the repository root, where the tests, docs and benchmarks
name them. A wheel cannot install folders outside its packages, so building copies them into
the package as ``flowgrpo/_packaged/configs`` and ``flowgrpo/_packaged/assets``;
``flowgrpo.packaged_data`` finds them there when flowgrpo runs outside a checkout. MANIFEST.in
puts the same folders in the sdist, so a wheel built from the sdist (``python -m build``) has them
too. An editable install (``pip install -e .``) copies nothing: ``flowgrpo.packaged_data`` reads
the checkout's own folders.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
# Where the copies go inside the built packages (flowgrpo/packaged_data.py INSTALLED_DATA_DIR).
PACKAGED_DIR = Path("flowgrpo") / "_packaged"
# What ships, as globs under the repository root. Keep in step with MANIFEST.in.
PACKAGED_GLOBS = ("configs/*.yaml", "configs/*/*.yaml", "assets/**/*")
# Downloaded prompt sets (flowgrpo fetch-prompts) come with their own terms: never shipped.
EXCLUDED_FOLDERS = (Path("assets") / "prompts" / "fetched",)


def packaged_files(root: Path = ROOT) -> list[Path]:
    """The files to ship, relative to ``root``: regular files matched by ``PACKAGED_GLOBS``,
    without ``EXCLUDED_FOLDERS``, caches and hidden files."""
    files: set[Path] = set()
    for pattern in PACKAGED_GLOBS:
        for path in root.glob(pattern):
            relative = path.relative_to(root)
            hidden = any(part.startswith(".") or part == "__pycache__" for part in relative.parts)
            excluded = any(relative.is_relative_to(folder) for folder in EXCLUDED_FOLDERS)
            if path.is_file() and not hidden and not excluded:
                files.add(relative)
    return sorted(files)


class BuildPyWithPackagedData(build_py):
    """``build_py`` that also copies ``packaged_files`` into ``<build_lib>/flowgrpo/_packaged``."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):   # the checkout's folders are read in place
            return
        target = Path(self.build_lib) / PACKAGED_DIR
        # A build folder reused from an earlier build must not ship files removed since.
        shutil.rmtree(target, ignore_errors=True)
        files = packaged_files()
        if not any(path.parts[0] == "configs" for path in files):
            raise RuntimeError(f"no configs/*.yaml under {ROOT}: the wheel would ship without its "
                               f"built-in configs (an sdist built without MANIFEST.in?)")
        for relative in files:
            destination = target / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / relative, destination)


setup(cmdclass={"build_py": BuildPyWithPackagedData})
