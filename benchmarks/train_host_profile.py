"""Where `mosaic train` spends the host's time launching a step, once it is steady.

Runs `mosaic train ARGS...` with cProfile enabled only while steps from --from-step on are
launched (the first steps compile, capture and warm up), then prints the launch's callees and
the functions by own time:

    PYTHONPATH=src python benchmarks/train_host_profile.py OUT.prof --from-step 50 -- \
        train clip --preset small --batch 32 --bf16-weights --steps 300 --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys

from mosaic.cli import main as mosaic_main
from mosaic.engine import trainer


def profile_launches(from_step: int) -> cProfile.Profile:
    profiler = cProfile.Profile()
    launch = trainer._StepPipeline.launch

    def profiled(self, step, rows):
        if step < from_step:
            return launch(self, step, rows)
        profiler.enable()
        try:
            return launch(self, step, rows)
        finally:
            profiler.disable()

    trainer._StepPipeline.launch = profiled
    return profiler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="where the profile's stats go (pstats format)")
    parser.add_argument("--from-step", type=int, default=50)
    ours, _, argv = " ".join(sys.argv[1:]).partition(" -- ")
    args = parser.parse_args(ours.split())
    profiler = profile_launches(args.from_step)
    code = 0
    try:
        mosaic_main(argv.split())
    except SystemExit as done:  # the CLI always exits; the profile is read after it
        code = done.code
    finally:
        profiler.dump_stats(args.out)
    if not profiler.getstats():
        sys.exit(f"no step from {args.from_step} on was launched (mosaic exit status {code})")
    stats = pstats.Stats(args.out).sort_stats("tottime")
    stats.print_callees(r"launch_step")
    stats.print_callees(r"session.py:\d+\(step\)")
    stats.print_callees(r"\(step_health\)")
    stats.print_stats(30)
    sys.exit(code)


if __name__ == "__main__":
    main()
