"""Write a ProfileDB's busy fractions as JSON (the raw data of BENCHMARKS.md's busy tables).

    python benchmarks/export_busy.py DB OUT.json [--preset P] [--kernels K]

--preset and --kernels keep the points of modules profiled at that preset with those kernels
only (a module shared by two presets' models stays in both).
"""

from __future__ import annotations

import argparse
import json


def main(argv: list[str] | None = None) -> int:
    from mosaic.profile.db import ProfileDB

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("db")
    parser.add_argument("out")
    parser.add_argument("--preset", help="only modules profiled at this preset")
    parser.add_argument("--kernels", help="only modules profiled with these kernels")
    args = parser.parse_args(argv)
    with ProfileDB.open(args.db) as db:
        names: dict[str, list[str]] = {}
        kernels: dict[str, str] = {}
        for record in db.modules():
            if args.preset in (None, record.preset) and args.kernels in (None, record.kernels):
                names.setdefault(record.signature, []).append(f"{record.model}/{record.module}")
                kernels[record.signature] = record.kernels
        points = [{"signature": p.signature, "modules": sorted(names[p.signature]),
                   "kernels": kernels[p.signature], "per_gpu_batch": p.per_gpu_batch,
                   "alone_s": p.alone_s, "pair_s": p.pair_s, "fraction": p.fraction,
                   "spread": p.spread, "repeats": p.repeats}
                  for p in db.busy() if p.signature in names]
        meta = {k: v for k, v in db.meta.items() if k.endswith(".busy") or k in ("torch", "gpu")}
    with open(args.out, "w") as f:
        json.dump({"db": str(args.db), "preset": args.preset, "kernels": args.kernels,
                   "meta": meta, "points": points}, f, indent=1)
    print(f"{len(points)} busy fractions -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
