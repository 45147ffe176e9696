"""Every script behind BENCHMARKS.md still imports against today's package (a renamed module
must not leave a benchmark that only fails on the GPU machine)."""

import importlib.util
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_imports(script, monkeypatch):
    monkeypatch.syspath_prepend(str(script.parent))  # `python benchmarks/x.py` puts it there
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


def _script(name: str, monkeypatch=None):
    """A benchmark script as a module; with `monkeypatch`, its folder on sys.path for the
    test (as `python benchmarks/x.py` has it), so that it may import its siblings."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


AUTOTUNE_LOG = """\
AUTOTUNE addmm(64x512, 64x512, 512x512)
strides: [0, 1], [512, 1], [1, 512]
dtypes: torch.bfloat16, torch.bfloat16, torch.bfloat16
  triton_mm_1 0.0200 ms 100.0% BLOCK_K=64, num_warps=4
  addmm 0.0300 ms 66.7%
SingleProcess AUTOTUNE benchmarking takes 1.5 seconds and 0.5 seconds precompiling for 21 choices
E1202 a traceback line that is not part of any block
AUTOTUNE mm(512x64, 64x512)
  mm 0.0100 ms 100.0%
  triton_mm_2 0.0150 ms 66.7% BLOCK_K=32
SingleProcess AUTOTUNE benchmarking takes 3.0 seconds and 0.0 seconds precompiling for 20 choices
AUTOTUNE mm(9x9, 9x9)
  triton_mm_3 0.0050 ms 100.0% BLOCK_K=16
SingleProcess AUTOTUNE benchmarking takes 1.0 seconds and 0.0 seconds precompiling for 20 choices
AUTOTUNE mm(1x1, 1x1)
  triton_mm_4 0.0010 ms 100.0%
"""


def test_autotune_log_gives_each_operators_best_and_aten_time():
    tuned = _script("autotune_choices").parse(AUTOTUNE_LOG)
    assert [t["op"] for t in tuned] == ["addmm", "mm", "mm"]  # the unfinished block is left out
    first, second, third = tuned
    assert (first["best"], first["best_ms"], first["aten_ms"]) == ("triton_mm_1", 0.02, 0.03)
    assert first["tuning_s"] == 2.0 and first["choices"] == 21
    assert (second["best"], second["aten_ms"]) == ("mm", 0.01)
    assert third["aten_ms"] is None and third["slowest_listed_ms"] == 0.005


def test_trace_overlap_counts_the_matched_kernels_time_beside_other_streams():
    """A norm kernel on stream 9 half under a GEMM of stream 7, then alone: 50 of its 100 us
    ran beside another stream; a second norm (10 us) never did."""
    overlap = _script("trace_overlap").overlap

    def kernel(name, start, duration, stream):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": duration,
                "args": {"stream": stream}}

    trace = {"traceEvents": [{"name": "ProfilerStep#1"}, kernel("gemm", 0, 100, 7),
                             kernel("foreach_norm_a", 50, 100, 9),
                             kernel("foreach_norm_b", 200, 10, 9)]}
    streams = overlap(trace, "foreach_norm")["streams"]
    assert streams["9"]["matched_ms"] == pytest.approx(0.11)
    assert streams["9"]["matched_beside_other_streams_ms"] == pytest.approx(0.05)
    assert streams["7"]["matched_ms"] == 0.0 and streams["9"]["matched_count"] == 2


@pytest.mark.parametrize("value", [300.0, 1.3, 0.021, -0.0037, 1e-3])
def test_the_fp8_probes_stochastic_rounding_is_unbiased_above_and_below_the_normals(
        value, monkeypatch):
    """The 8-bit-moments probe's e4m3 rounding: every code representable, the mean of many
    draws the value (normal range: within 2^-8 of a unit, the 8 bits' resolution; below
    2^-6 on the subnormal grid), while rounding to nearest keeps one neighbour's error."""
    import torch

    probe = _script("fp8_moments_digits", monkeypatch)
    x = torch.full((1 << 16,), value)
    bits = torch.randint(0, 256, x.shape, dtype=torch.int32,
                         generator=torch.Generator().manual_seed(0))
    codes = probe.fp8_rounded(x, bits)
    assert codes.dtype == torch.float8_e4m3fn and torch.isfinite(codes.float()).all()
    unit = 2.0 ** (torch.floor(torch.log2(torch.tensor(abs(value)))) - 3).item()
    unit = max(unit, probe.SUBNORMAL_STEP)
    assert abs(codes.float().mean().item() - value) < unit / 64
    assert len(set(codes.float().tolist())) == 2  # the value's two neighbours
    nearest = probe.fp8_rounded(x, None).float()
    assert len(set(nearest.tolist())) == 1 and abs(nearest[0].item() - value) > unit / 64


def test_the_fp8_probes_blocks_keep_each_blocks_largest_moment(monkeypatch):
    import torch

    probe = _script("fp8_moments_digits", monkeypatch)
    x = torch.cat([torch.linspace(-1e-3, 2e-3, 256), torch.linspace(0, 7.0, 256)])
    codes, scale = probe.block_quantized(x, 256, None)
    back = probe.dequantized(codes, scale, 256)
    assert back[255].item() == pytest.approx(2e-3) and back[511].item() == pytest.approx(7.0)
    assert torch.allclose(back, x, rtol=2 ** -4, atol=2e-3 * 2 ** -9)


def test_the_weak_scaling_prediction_ranks_the_sum_during_the_backward_ahead(monkeypatch):
    rows = _script("weak_scaling_prediction", monkeypatch).rows("unified-io-2:4")
    by = {(r["bf16_weights"], r["grad_sync"]): r for r in rows}
    assert len(rows) == 4
    for bf16 in (False, True):
        flat, overlapped = by[(bf16, "flat")], by[(bf16, "overlapped")]
        assert flat["one_gpu_ms"] == overlapped["one_gpu_ms"]
        assert overlapped["weak_scaling"] > flat["weak_scaling"]
        assert overlapped["weak_scaling"] == pytest.approx(
            2 * overlapped["one_gpu_ms"] / overlapped["two_gpu_ms"], rel=1e-2)
