"""Does the GEMM that fails in gahc's OFASys `paper` plan fail on one green context alone?

gahc's plan of OFASys `paper` b8 stops in cuBLAS (`CUBLAS_STATUS_EXECUTION_FAILED`, the
768x256x256 bf16 GEMM of the width-256 `structured` encoder) whenever the `structured` and
`video` encoders share its concurrent stage, with launches blocking, without CUDA graphs or
the caching allocator: so not a race and not a reused block. What differs between the sets
that fail and those that train is which SM groups each capped module's green context gets.
This probe makes SM-partition pools (the engine's own `SMPartitionPool`) for a list of cases
and runs that GEMM, and the motion encoder's (n=392), on every stream of each, printing one
JSON line per stream: case, module, SM range and count, ok or the error.

    PYTHONPATH=src python benchmarks/green_gemm_probe.py OUT.jsonl

Each case runs in this process until one fails; a failed launch may leave the context
unusable, so the script then starts itself again from the next case.
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = ["plan", "plan:structured,video", "plan:structured,imu", "plan:imu,video",
         *(f"cap:{n}" for n in (8, 16, 24, 32, 48, 64, 96, 128, 132)),
         "tail:128+8", "tail:124+8", "tail:120+16", "tail:64+12", "part:120+8", "part:8+112+8"]
CHILD_DONE = 100
GEMMS = {"n256": (256, 256, 768), "n392": (392, 256, 768)}  # rows, in, out: F.linear


def plan_requests(case: str):
    from mosaic.engine.green import requests_for_plan
    from mosaic.hardware import make_cluster
    from mosaic.perf import make_perf_model
    from mosaic.planners import plan_all
    from mosaic.zoo import get_model
    from shared_bf16_plans import reshaped  # benchmarks/ is this script's directory

    cluster = make_cluster(1, "h200")
    graph = get_model("ofasys").graph("paper", global_batch=8)
    perf = make_perf_model("auto", cluster, preset="paper")
    plan = plan_all(graph, cluster, perf, ["gahc"])[0]
    concurrent = case.partition(":")[2]
    plan = reshaped(plan, None, concurrent)
    shares = {p.module: p.sm_share for s in plan.stages for p in s.placements}
    return requests_for_plan(plan, 0, cluster.gpu), shares


def case_requests(case: str):
    from mosaic.engine.green import StreamRequest

    kind, _, arg = case.partition(":")
    if kind == "plan":
        return plan_requests(case)
    if kind == "cap":
        return [StreamRequest(key="probe", mode="cap", num_sms=int(arg))], {}
    sizes = [int(x) for x in arg.split("+")]
    if kind == "part":  # disjoint partitions of one stage, in this request order
        return [StreamRequest(key=f"part{i}", mode="partition", num_sms=n)
                for i, n in enumerate(sizes)], {}
    first, second = sizes  # tail: a cap after one that fills the front
    return [StreamRequest(key="front", mode="cap", num_sms=first),
            StreamRequest(key="probe", mode="cap", num_sms=second)], {}


def run_gemms(stream, torch) -> dict[str, str]:
    out = {}
    for name, (rows, width, features) in GEMMS.items():
        try:
            with torch.cuda.stream(stream):
                x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(features, width, device="cuda", dtype=torch.bfloat16)
                b = torch.randn(features, device="cuda", dtype=torch.bfloat16)
                torch.nn.functional.linear(x, w, b).sum().item()
            out[name] = "ok"
        except RuntimeError as exc:
            out[name] = str(exc).splitlines()[0][:160]
    return out


def run_cases(cases: list[str], out_path: str) -> int:
    """Index of the first case that failed (the process should not go on), or len(cases)."""
    import warnings

    import torch

    from mosaic.engine.green import SMPartitionPool
    from mosaic.hardware import make_cluster

    warnings.simplefilter("ignore")
    gpu = make_cluster(1, "h200").gpu
    for index, case in enumerate(cases):
        requests, shares = case_requests(case)
        failed = False
        with SMPartitionPool.create(requests, 0, gpu) as pool, open(out_path, "a") as out:
            described = pool.describe()
            for r in requests:
                if r.mode == "temporal":
                    continue
                result = run_gemms(pool.stream(r.key), torch)
                module = described["modules"][r.key]
                row = {"case": case, "module": r.key, "mode": r.mode, "share": shares.get(r.key),
                       "priority": r.priority, "num_sms": module["num_sms"],
                       "sm_range": module["sm_range"], "backend": described["backend"],
                       "unit_sms": described["unit_sms"], **result}
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")
                failed = failed or any(v != "ok" for v in result.values())
        if failed:
            return index
    return len(cases)


def main() -> None:
    out_path = sys.argv[1]
    if len(sys.argv) > 2:  # a child: run the named cases; exit 100 + the failed case's index
        sys.exit(CHILD_DONE + run_cases(sys.argv[2].split(";"), out_path))
    remaining = CASES
    while remaining:
        rc = subprocess.run([sys.executable, __file__, out_path, ";".join(remaining)],
                            timeout=120).returncode
        stopped_at = rc - CHILD_DONE if rc >= CHILD_DONE else 0  # a crash: skip its first case
        if rc < CHILD_DONE:
            print(json.dumps({"case": remaining[0], "crashed": rc}), flush=True)
        if stopped_at >= len(remaining):
            break
        remaining = remaining[stopped_at + 1:]


if __name__ == "__main__":
    main()
