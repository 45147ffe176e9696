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


SHELL_SCRIPTS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.sh"))


def _mosaic_calls(text: str) -> list[tuple[str, list[str]]]:
    """(subcommand, --options) of every `-m mosaic SUB ...` in a shell script, continuation
    lines joined, each call cut at its redirections."""
    import re

    joined = text.replace("\\\n", " ")
    calls = []
    for match in re.finditer(r"-m mosaic ([a-z][\w-]*)([^\n;&|>]*)", joined):
        calls.append((match.group(1), re.findall(r"(?<!\S)(--[a-z][\w-]*)", match.group(2))))
    return calls


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_call_mosaic_with_options_it_has(script):
    """A device call is scarce: a prepared script must not fail there on a mistyped option."""
    import typer

    from mosaic.cli import app

    commands = typer.main.get_command(app).commands
    for sub, options in _mosaic_calls(script.read_text()):
        assert sub in commands, f"{script.name}: mosaic has no command {sub!r}"
        known = {o for p in commands[sub].params for o in (*p.opts, *p.secondary_opts)}
        unknown = sorted(set(options) - known)
        assert not unknown, f"{script.name}: mosaic {sub} has no option {unknown}"
