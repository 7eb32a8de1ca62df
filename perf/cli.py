"""`pipeline-bench`: the profiling tool's command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeline-bench", description=__doc__)
    sub = parser.add_subparsers(dest="mode", required=True)

    ring = sub.add_parser("ring", help="the shared-memory ring against mp.Queue and pyzmq+msgspec")
    ring.add_argument("--transports", default="ring,mp_queue,zmq_msgspec")
    ring.add_argument("--sizes", default="64,4096,65536,1048576", help="message sizes in bytes")
    ring.add_argument("--scale", type=float, default=1.0, help="scale the message counts")
    ring.add_argument("--json", dest="json_path", help="write the rows as JSON here")

    args = parser.parse_args(argv)
    if args.mode == "ring":
        from perf import ring_bench

        transports = [t for t in args.transports.split(",") if t]
        unknown = set(transports) - set(ring_bench.TRANSPORTS)
        if unknown:
            parser.error(
                f"unknown transports {sorted(unknown)}; choose from {ring_bench.TRANSPORTS}"
            )
        sizes = [int(s) for s in args.sizes.split(",") if s]
        ring_bench.main(transports, sizes, args.scale, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
