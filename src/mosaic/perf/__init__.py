"""Performance models: predict module, stage and iteration times for any plan."""

from mosaic.perf.analytic import AnalyticModel
from mosaic.perf.base import PerfModel, PerfModelError, Work

__all__ = ["PERF_MODELS", "AnalyticModel", "PerfModel", "PerfModelError", "Work", "make_perf_model"]

PERF_MODELS = ("auto", "analytic", "profiled")
"""The names make_perf_model accepts (`auto`: profiled where a DB is shipped, else analytic)."""


def make_perf_model(name: str, cluster, **kwargs) -> PerfModel:
    """Performance models by name: `profiled` reads a ProfileDB, `analytic` is the roofline,
    `auto` is the measured profile shipped for this hardware when there is one, else analytic."""
    if name == "auto":
        from mosaic.profile.db import has_shipped_db

        given = kwargs.get("db") is not None
        name = "profiled" if given or has_shipped_db(cluster.gpu.name) else "analytic"
    accumulation = kwargs.get("accumulation", 1)
    if name == "analytic":
        return AnalyticModel(cluster).accumulating(accumulation)
    if name == "profiled":  # lazy: scipy and the DB are only needed when asked for
        from mosaic.perf.engine_term import gpu_engine_kind
        from mosaic.perf.profiled import ProfiledModel

        # Predictions are for the engine a plan will run on: by default the GPU engine
        # (compiled modules, CUDA graphs), whose surfaces and engine term the profile holds.
        return ProfiledModel(cluster, kwargs.get("db"), interference=kwargs.get("interference", "aware"),
                             engine=kwargs.get("engine", gpu_engine_kind(cluster.num_gpus))
                             ).accumulating(accumulation)
    raise PerfModelError(f"unknown perf model {name!r}; choose one of {', '.join(PERF_MODELS)}")
