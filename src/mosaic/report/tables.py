"""Rich tables for people; the same data goes out as JSON for machines."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from mosaic.graph import MMGraph


def _console() -> Console:
    return Console(width=140)


def print_plan_table(summary: dict) -> None:
    table = Table(title=(f"{summary['model']} ({summary['preset']}, batch {summary['global_batch']}) "
                         f"on {summary['gpus']} x {summary['hardware']}"))
    for column in ("planner", "predicted iteration", "speedup vs megatron", "predicted GPU util",
                   "stages (sharing)", "plan"):
        table.add_column(column, justify="right" if column != "planner" else "left")
    for row in summary["plans"]:
        table.add_row(
            row["planner"],
            f"{row['predicted_iteration_s'] * 1e3:.2f} ms",
            f"{row['speedup_vs_megatron']:.2f}x" if row["speedup_vs_megatron"] else "-",
            f"{row['predicted_gpu_util'] * 100:.1f}%",
            f"{row['num_stages']} ({', '.join(sorted(set(row['sharing'])))})",
            row["plan_file"],
        )
    console = _console()
    console.print(table)
    console.print(f"performance model: {summary['perf_model']}", markup=False)  # "[alpha=...]" is text


def models_table(graphs: list[MMGraph]) -> None:
    table = Table(title=f"model zoo (preset {graphs[0].preset if graphs else '-'})")
    for column in ("model", "module", "kind", "layers", "dim", "params (M)", "TFLOPs / iter", "batch"):
        table.add_column(column, justify="left" if column in ("model", "module", "kind") else "right")
    for g in graphs:
        for i, m in enumerate(g.modules):
            table.add_row(
                g.name if i == 0 else "", m.name, m.kind, str(m.num_layers), str(m.hidden_dim),
                f"{m.num_params / 1e6:.1f}", f"{m.flops_per_sample * g.global_batch / 1e12:.2f}",
                str(g.global_batch) if i == 0 else "",
            )
        table.add_section()
    _console().print(table)
