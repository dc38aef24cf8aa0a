#!/usr/bin/env python3
"""Store in targets.json the best of several layouts measured for one target, on the same lease.

    python3 benchmarks/best_target.py --key mfu_7b_4gpu --metric mfu \
        benchmarks/results/mfu_7b_dp4_ddp_h200x4.json benchmarks/results/mfu_7b_dp4_mfsdp_h200x4.json

Issue 36 asks for the 7B MFU "in the best layout you find": every candidate layout writes its own record
(``scaling_gpu.py``), and this picks the best one by ``--metric`` (highest; ``--lowest`` for memory) and
stores it with that record's device, commit and path, as ``scaling_gpu.py --target`` would. The records must
share the device and commit, so the comparison is one of layouts, not of machines or code. The chosen layout
and the others' values are printed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from _record import TARGETS, update_target

GOALS = {
    "mfu": ">= 0.47 (Megatron-LM's published 7.1B MFU, with Transformer Engine)",
    "scaling_efficiency": ">= 0.95 (tokens/s per GPU against one GPU)",
    "tokens_ratio": ">= 0.9 (tokens/s against the --versus layout)",
    "memory_ratio": "<= 0.6 (peak memory against the --versus layout)",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--key", required=True, help="the targets.json key")
    parser.add_argument("--metric", required=True, choices=sorted(GOALS))
    parser.add_argument("--lowest", action="store_true", help="the lowest value is the best (memory)")
    parser.add_argument("--targets", type=Path, default=TARGETS, help="the targets file (default: results/)")
    parser.add_argument("records", type=Path, nargs="+")
    args = parser.parse_args(argv)
    found = [(path, json.loads(path.read_text())) for path in args.records if path.exists()]
    missing = [str(path) for path in args.records if not path.exists()]
    if missing:
        print(f"not measured (no record): {', '.join(missing)}")
    found = [(path, rec) for path, rec in found if args.metric in rec]
    if not found:
        raise SystemExit(f"none of the records measured {args.metric}")
    machines = {(rec.get("device"), rec.get("commit")) for _, rec in found}
    if len(machines) > 1:
        raise SystemExit(f"the records come from different devices or commits: {sorted(map(str, machines))}")
    for path, rec in found:
        print(f"{path.name}: {args.metric} {rec[args.metric]:.4f}")
    pick = min if args.lowest else max
    path, rec = pick(found, key=lambda item: item[1][args.metric])
    update_target(
        args.key, rec[args.metric], goal=GOALS[args.metric], source=path, record=rec, targets=args.targets
    )
    print(f"{args.key} = {rec[args.metric]:.4f} from {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
