"""Every script behind BENCHMARKS.md still imports against today's package (a renamed module
must not leave a benchmark that only fails on the GPU machine)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(script):
    spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # `if __name__ == "__main__"` keeps main() from running
    assert callable(getattr(module, "main", None))
