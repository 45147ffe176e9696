"""mosaic: train multimodal models faster by colocating modules on GPUs with SM quotas.

Data flows one way: graph -> profile -> performance model -> planner -> plan -> engine -> report.
"""

__version__ = "0.1.0"


_API = ("graph_from_modules", "train")
"""`mosaic.graph_from_modules` and `mosaic.train` (mosaic.api), imported on first use so that
`import mosaic` imports no torch. (`mosaic.plan` is the plan module: plan with mosaic.api.plan.)"""


def __getattr__(name: str):
    if name in _API:
        from mosaic import api

        return getattr(api, name)
    raise AttributeError(f"module 'mosaic' has no attribute {name!r}")
