"""What produced a result: package versions and the git commit of the code, recorded beside
every run folder and bench result, so a figure can be traced to the code that measured it
(e.g. whether the zoo's attention still built mask tensors)."""

from __future__ import annotations

import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("mosaic-mm", "torch", "transformers", "numpy", "scipy", "networkx")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_sha() -> str | None:
    """HEAD of the checkout this package runs from (None: not a checkout, or no git)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None
