"""mosaic: train multimodal models faster by colocating modules on GPUs with SM quotas.

Data flows one way: graph -> profile -> performance model -> planner -> plan -> engine -> report.
"""

__version__ = "0.1.0"
