"""Write a ProfileDB's busy fractions as JSON (the raw data of BENCHMARKS.md's busy table).

    python benchmarks/export_busy.py DB OUT.json
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str] | None = None) -> int:
    from mosaic.profile.db import ProfileDB

    db_path, out = (argv if argv is not None else sys.argv[1:])[:2]
    with ProfileDB.open(db_path) as db:
        names: dict[str, list[str]] = {}
        for record in db.modules():
            names.setdefault(record.signature, []).append(f"{record.model}/{record.module}")
        points = [{"signature": p.signature, "modules": sorted(names.get(p.signature, [])),
                   "per_gpu_batch": p.per_gpu_batch, "alone_s": p.alone_s, "pair_s": p.pair_s,
                   "fraction": p.fraction, "spread": p.spread, "repeats": p.repeats}
                  for p in db.busy()]
        meta = {k: v for k, v in db.meta.items() if k.endswith(".busy") or k in ("torch", "gpu")}
    with open(out, "w") as f:
        json.dump({"db": str(db_path), "meta": meta, "points": points}, f, indent=1)
    print(f"{len(points)} busy fractions -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
