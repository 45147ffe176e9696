"""Inductor's max-autotune log -> JSON: for each GEMM/convolution it tuned, the fastest
choice, the ATen (cuBLAS/cuDNN) kernel's time, and the seconds spent benchmarking.

    python benchmarks/autotune_choices.py results/autotune-kernels-h200/X.err --out X.json

Inductor prints one block per tuned operator on stderr (`AUTOTUNE op(shapes)`, its top
choices as `name time ms share%`, then `... benchmarking takes S seconds ...`); the ATen
kernel is listed only when it is among the top choices, else its time is "not in the top".
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ATEN = {"mm", "addmm", "bias_addmm", "bmm", "baddbmm", "convolution"}
HEADER = re.compile(r"^AUTOTUNE (\w+)\((.*)\)\s*$")
CHOICE = re.compile(r"^\s+(\w+) ([0-9.]+) ms ([0-9.]+)%")
TIMING = re.compile(r"AUTOTUNE benchmarking takes ([0-9.]+) seconds and ([0-9.]+) seconds "
                    r"precompiling for (\d+) choices")


def parse(text: str) -> list[dict]:
    """One dict per AUTOTUNE block that ran to its timing line."""
    blocks, current = [], None
    for line in text.splitlines():
        if match := HEADER.match(line):
            current = {"op": match[1], "shapes": match[2], "choices": []}
        elif current is not None and (match := CHOICE.match(line)):
            current["choices"].append({"name": match[1], "ms": float(match[2])})
        elif current is not None and (match := TIMING.search(line)):
            blocks.append(summarise(current, float(match[1]) + float(match[2]), int(match[3])))
            current = None
    return blocks


def summarise(block: dict, seconds: float, choices: int) -> dict:
    best = min(block["choices"], key=lambda c: c["ms"])
    aten = [c["ms"] for c in block["choices"] if c["name"] in ATEN]
    return {"op": block["op"], "shapes": block["shapes"], "best": best["name"],
            "best_ms": best["ms"], "aten_ms": aten[0] if aten else None,
            "slowest_listed_ms": max(c["ms"] for c in block["choices"]),
            "tuning_s": seconds, "choices": choices}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    blocks = parse(args.log.read_text(errors="replace"))
    args.out.write_text(json.dumps({"log": args.log.name, "tuned": blocks}, indent=2) + "\n")
    print(f"{len(blocks)} tuned operators -> {args.out}")


if __name__ == "__main__":
    main()
