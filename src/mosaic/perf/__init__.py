"""Performance models: predict module, stage and iteration times for any plan."""

from mosaic.perf.analytic import AnalyticModel
from mosaic.perf.base import PerfModel, Work

__all__ = ["AnalyticModel", "PerfModel", "Work", "make_perf_model"]


def make_perf_model(name: str, cluster, **kwargs) -> PerfModel:
    """Performance models by name: `analytic` now; `profiled` reads a ProfileDB."""
    if name == "analytic":
        return AnalyticModel(cluster)
    if name == "profiled":  # lazy: scipy and the DB are only needed when asked for
        from mosaic.perf.profiled import ProfiledModel

        return ProfiledModel(cluster, kwargs.get("db"), interference=kwargs.get("interference", "aware"))
    raise ValueError(f"unknown perf model {name!r}; choose 'analytic' or 'profiled'")
