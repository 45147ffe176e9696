"""Prove the SM partition pool on a GPU: disjoint SMs, time following the quota, setup cost.

    PYTHONPATH=src python3 benchmarks/green_probe.py --out DIR

Sections (each recorded even if another fails):
  1. disjointness: 3 unequal partitions (72/32/16) and 2 (64/64), a %smid kernel on every
     partition's stream at once; SM-id sets must be disjoint and as large as the context.
  2. quota follows SMs: 8192^3 bf16 matmul on caps of 8..128 SMs and on the whole GPU.
  3. setup cost: SMPartitionPool.create for 1, 3, 8 partitions (time, device memory), and
     creating a context + stream inside a step (idle GPU, busy GPU) against a pooled lookup.
  4. caps overlap (96 + 64 SMs on 132) and free streams with priorities.
Prints a short table; writes everything to DIR/green_probe.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from mosaic.engine.green import SMIdProbe, SMPartitionPool, StreamRequest

N = 8192
TIMER_NOTES: set[str] = set()


def part(key: str, num_sms: int, group: int = 0) -> StreamRequest:
    return StreamRequest(key=key, mode="partition", num_sms=num_sms, group=group)


def cap(key: str, num_sms: int) -> StreamRequest:
    return StreamRequest(key=key, mode="cap", num_sms=num_sms)


def env() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("cuda-bindings", "cupy-cuda13x", "cuda-core"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    props = torch.cuda.get_device_properties(0)
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda, "device": props.name,
            "num_sms": props.multi_processor_count, "priority_range": list(torch.cuda.Stream.priority_range()),
            **versions}


def matmul_ms(stream: Any, repeats: int = 10) -> tuple[float, float]:
    """Median ms of one 8192^3 bf16 matmul on `stream` (CUDA events; wall clock if events refuse
    a green stream), and its relative error against the same product on the default stream."""
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    ref = (a @ b).float()
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        for _ in range(3):
            out = a @ b
        times = []
        for _ in range(repeats):
            try:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                out = a @ b
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end))
            except RuntimeError as exc:
                TIMER_NOTES.add(f"events failed on this stream ({exc}); wall clock instead")
                stream.synchronize()
                t0 = time.perf_counter()
                out = a @ b
                stream.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
    stream.synchronize()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return statistics.median(times), err


def probe_sms(pool: SMPartitionPool, keys: list[str], probe: SMIdProbe) -> dict[str, Any]:
    pending = {k: probe.launch(pool.stream(k)) for k in keys}  # all in flight together
    got = {k: probe.result(p) for k, p in pending.items()}
    sets = {k: set(v[0]) for k, v in got.items()}
    overlaps = {f"{a}&{b}": len(sets[a] & sets[b]) for i, a in enumerate(keys) for b in keys[i + 1:]}
    starts, ends = [v[1] for v in got.values()], [v[2] for v in got.values()]
    return {
        "sm_ids": {k: sorted(s) for k, s in sets.items()},
        "num_seen": {k: len(s) for k, s in sets.items()},
        "num_context": {k: pool.num_sms(k) for k in keys},
        "requested": {k: pool.requests[k].num_sms for k in keys},
        "shared_sms": overlaps,
        "ran_concurrently": max(starts) < min(ends),
        "sm_ranges": {k: pool.sm_ranges()[k] for k in keys},
    }


def section_disjoint(out: dict[str, Any]) -> None:
    probe = SMIdProbe(num_blocks=2048, spin_us=500)
    full = probe.result(probe.launch(torch.cuda.current_stream()))
    out["whole_gpu_sms_seen"] = len(full[0])
    for name, sizes in (("three_way", (72, 32, 16)), ("two_way", (64, 64))):
        keys = [f"p{n}_{i}" for i, n in enumerate(sizes)]
        with SMPartitionPool.create([part(k, n) for k, n in zip(keys, sizes, strict=True)]) as pool:
            res = probe_sms(pool, keys, probe)
            res["describe"] = pool.describe()
            res["disjoint"] = not any(res["shared_sms"].values())
            res["sizes_match"] = all(res["num_seen"][k] == res["num_context"][k] for k in keys)
            out[name] = res


def section_matmul(out: dict[str, Any]) -> None:
    sizes = (8, 16, 32, 64, 128)
    with SMPartitionPool.create([cap(f"sm{n}", n) for n in sizes]) as pool:
        out["describe"] = pool.describe()
        for n in sizes:
            ms, err = matmul_ms(pool.stream(f"sm{n}"))
            out[f"sm{n}"] = {"num_sms": pool.num_sms(f"sm{n}"), "ms": ms, "rel_err": err,
                             "tflops": 2 * N**3 / ms / 1e9}
    ms, err = matmul_ms(torch.cuda.Stream())
    out["whole_gpu"] = {"num_sms": torch.cuda.get_device_properties(0).multi_processor_count,
                        "ms": ms, "rel_err": err, "tflops": 2 * N**3 / ms / 1e9}


def busy(ms_target: float = 30.0) -> None:
    """Queue about `ms_target` of matmuls on the current stream (no sync)."""
    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(int(ms_target / 1.5)):
        a @ a


def section_setup(out: dict[str, Any]) -> None:
    for count in (1, 3, 8):
        sizes = [16] * count
        runs = []
        for _ in range(2):  # the second is the steady cost; the first may load driver state
            torch.cuda.synchronize()
            free_before = torch.cuda.mem_get_info()[0]
            pool = SMPartitionPool.create([part(f"m{i}", n) for i, n in enumerate(sizes)])
            free_after = torch.cuda.mem_get_info()[0]
            runs.append({"setup_s": pool.setup_s, "mem_mib": (free_before - free_after) / 2**20,
                         "backend": pool.backend, "num_sms": [pool.num_sms(f"m{i}") for i in range(count)]})
            pool.close()
        out[f"partitions_{count}"] = runs
    # the ablation: a quota stream looked up from the pool vs created inside the step
    with SMPartitionPool.create([part("x", 32)]) as pool:
        t0 = time.perf_counter()
        for _ in range(1000):
            pool.stream("x")
        out["lookup_us"] = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    in_step = SMPartitionPool.create([part("x", 32)])
    out["create_in_step_idle_s"] = time.perf_counter() - t0
    in_step.close()
    torch.cuda.synchronize()
    busy()
    t0 = time.perf_counter()
    in_step = SMPartitionPool.create([part("x", 32)])
    out["create_in_step_busy_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    out["busy_work_left_after_create_s"] = time.perf_counter() - t1
    in_step.close()


def section_caps_and_free(out: dict[str, Any]) -> None:
    probe = SMIdProbe(num_blocks=2048, spin_us=500)
    with SMPartitionPool.create([cap("c96", 96), cap("c64", 64)]) as pool:
        res = probe_sms(pool, ["c96", "c64"], probe)
        res["sizes_match"] = all(res["num_seen"][k] == res["num_context"][k] for k in ("c96", "c64"))
        out["caps"] = res
    requests = [StreamRequest(key="hi", mode="free", num_sms=None, priority=1),
                StreamRequest(key="lo", mode="free", num_sms=None),
                StreamRequest(key="seq", mode="temporal", num_sms=None)]
    with SMPartitionPool.create(requests) as pool:
        hi, lo = pool.stream("hi"), pool.stream("lo")
        out["free"] = {"backend": pool.backend, "hi_priority": hi.priority, "lo_priority": lo.priority,
                       "temporal_is_current": pool.stream("seq") == torch.cuda.current_stream()}
        out["free"]["hi_matmul_rel_err"] = matmul_ms(hi, repeats=2)[1]
        # latency of one small matmul submitted behind ~7 ms of work queued on 4 normal streams
        a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        c = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        loaders = [torch.cuda.Stream() for _ in range(4)]
        for name, stream in (("hi", hi), ("lo", lo), ("hi", hi), ("lo", lo)):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            done = torch.cuda.Event(enable_timing=True)
            start.record(loaders[0])
            for loader in loaders:
                loader.wait_event(start)
                with torch.cuda.stream(loader):
                    for _ in range(10):
                        a @ a
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                c @ c
                done.record(stream)
            torch.cuda.synchronize()
            out["free"][f"small_matmul_latency_ms_{name}"] = start.elapsed_time(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"env": env()}
    for name, fn in (("disjoint", section_disjoint), ("matmul", section_matmul),
                     ("setup", section_setup), ("caps_free", section_caps_and_free)):
        result[name] = {}
        try:
            fn(result[name])
        except Exception:
            result[name]["error"] = traceback.format_exc()
            print(f"[{name}] FAILED\n{result[name]['error']}")
    result["timer_notes"] = sorted(TIMER_NOTES)
    (args.out / "green_probe.json").write_text(json.dumps(result, indent=1, default=str))
    print_table(result)


def print_table(r: dict[str, Any]) -> None:
    e = r["env"]
    print(f"\n{e['device']} ({e['num_sms']} SMs) torch {e['torch']} cuda-bindings {e['cuda-bindings']} "
          f"cupy {e['cupy-cuda13x']} priority_range {e['priority_range']}")
    d = r["disjoint"]
    if "three_way" in d:
        print(f"\n1. disjointness (whole GPU probe saw {d['whole_gpu_sms_seen']} SMs)")
        print(f"{'pool':10} {'requested':>14} {'context SMs':>14} {'SMs seen':>14} {'shared':>10} concurrent")
        for name in ("three_way", "two_way"):
            x = d[name]
            keys = list(x["requested"])
            print(f"{name:10} {str([x['requested'][k] for k in keys]):>14} "
                  f"{str([x['num_context'][k] for k in keys]):>14} {str([x['num_seen'][k] for k in keys]):>14} "
                  f"{sum(x['shared_sms'].values()):>10} {x['ran_concurrently']}")
        print(f"units from the split: {d['three_way']['describe']['unit_sms']}")
    m = r["matmul"]
    if "whole_gpu" in m:
        print("\n2. 8192^3 bf16 matmul vs SM quota")
        print(f"{'quota':>8} {'SMs':>5} {'ms':>8} {'TFLOP/s':>8} {'rel err':>9}")
        for key in ("sm8", "sm16", "sm32", "sm64", "sm128", "whole_gpu"):
            x = m[key]
            print(f"{key:>8} {x['num_sms']:>5} {x['ms']:>8.2f} {x['tflops']:>8.0f} {x['rel_err']:>9.1e}")
    s = r["setup"]
    if "create_in_step_busy_s" in s:
        print("\n3. setup cost (second of two creates)")
        for count in (1, 3, 8):
            x = s[f"partitions_{count}"][1]
            print(f"  {count} partitions: {x['setup_s'] * 1e3:7.2f} ms, {x['mem_mib']:6.1f} MiB, SMs {x['num_sms']}")
        print(f"  pooled lookup: {s['lookup_us']:.2f} us; create in step: idle {s['create_in_step_idle_s'] * 1e3:.2f} ms, "
              f"busy GPU {s['create_in_step_busy_s'] * 1e3:.2f} ms (work left after: "
              f"{s['busy_work_left_after_create_s'] * 1e3:.2f} ms)")
    c = r["caps_free"]
    if "free" in c:
        x = c["caps"]
        print(f"\n4. caps {x['requested']} -> context SMs {x['num_context']}, seen {x['num_seen']}, "
              f"shared {x['shared_sms']}, ranges {x['sm_ranges']}")
        f = c["free"]
        print(f"   free: priorities hi {f['hi_priority']} lo {f['lo_priority']}, temporal=current "
              f"{f['temporal_is_current']}; small matmul behind 4 loaded streams: hi "
              f"{f['small_matmul_latency_ms_hi']:.2f} ms, lo {f['small_matmul_latency_ms_lo']:.2f} ms")


if __name__ == "__main__":
    main()
