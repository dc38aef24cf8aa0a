"""Host-device synchronisations of one SFT step and one log-prob pass, by the Python line that causes them.

    cd benchmarks && python3 sync_points_gpu.py --out results/sync_points_1.5b_h100.txt

torch's sync debug mode warns at every synchronising CUDA call; each warning's stack (our frames) is
counted. A sync per layer or per micro-batch drains the GPU's queue and exposes the host's launch time.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings
from functools import partial
from pathlib import Path

import torch
from _common import SHAPES, build, lengths_for, make_batch, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()

    from verl_engine.losses import sft_loss
    from verl_mcore_utils.parallel import init_parallel

    init_parallel(device="cuda")
    engine, _ = build(args.shape, seq=args.seq, fused=True, sequences=8)
    batch = make_batch(
        lengths_for("fixed", count=8, seq=args.seq, seed=0), vocab=SHAPES[args.shape][5], seed=0
    )
    lines = []
    for name, run, mode in (
        ("sft step", partial(train_step, engine, sft_loss, batch, []), engine.train_mode),
        (
            "log-prob pass",
            partial(engine.infer_batch, {**batch, "calculate_entropy": True}),
            engine.eval_mode,
        ),
    ):
        counts: collections.Counter[str] = collections.Counter()

        def record(message, *_, counts=counts, **__):  # warnings.showwarning's signature
            if "synchroniz" not in str(message):  # other warnings (megatron's deprecations) are not syncs
                return
            frames = [f for f in traceback.extract_stack()[:-1] if "/site-packages/torch/" not in f.filename]
            ours = [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]]
            counts[" <- ".join(reversed(ours))] += 1

        with mode():
            run()
            torch.cuda.synchronize()
            old = warnings.showwarning
            warnings.showwarning = record
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    run()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    warnings.showwarning = old
        lines.append(f"===== {name}: {sum(counts.values())} synchronisations")
        lines += [f"{n:6d}  {where}" for where, n in counts.most_common(40)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
