"""What is alive at a step's memory peak: torch's CUDA allocator history replayed to its highest point.

``StepProfile`` with ``BENCH_PROFILE_KIND=memory`` records the allocator's history over one step and writes
this summary per rank. Only allocations made during the step are in the history, so the summary is the step's
transient memory on top of what lived before it (weights, optimizer state, buffers). Each live block is charged
to the innermost frame that is ours or megatron-core's (a site), so the answer reads as "the all-gather buffers
of Megatron-FSDP's bucket N" or "the LM head's logits", not as "torch/nn/functional.py".
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_OURS = ("verl_", "megatron", "benchmarks")


def _site(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """The innermost ``depth`` frames in our code or megatron-core's, innermost first."""
    picked = [f for f in frames if any(key in f.get("filename", "") for key in _OURS)][:depth]
    if not picked:
        picked = frames[:1]
    return " < ".join(
        f"{f.get('filename', '?').split('site-packages/')[-1]}:{f.get('line', 0)} {f.get('name', '?')}"
        for f in picked
    )


def peak_composition(snapshot: dict[str, Any], *, device: int, top: int = 15) -> dict[str, Any]:
    """Replay ``device``'s allocator trace: the highest total of live traced blocks, and the sites holding it.

    ``alloc`` adds a block; ``free_completed`` removes it (``free_requested`` only marks it, and the memory stays
    taken until the stream is done). Returns ``peak_gib`` (transient, above the state before recording),
    ``events`` and ``sites``: the ``top`` sites by bytes alive at the peak, each with its GiB and block count.
    """
    traces = snapshot.get("device_traces", [])
    events = traces[device] if device < len(traces) else []
    live: dict[int, int] = {}
    total = peak = 0
    peak_at = -1
    for i, event in enumerate(events):
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > peak:
                peak, peak_at = total, i
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    alive: dict[int, dict[str, Any]] = {}
    for event in events[: peak_at + 1]:  # second pass: the blocks alive at the peak, with their frames
        if event.get("action") == "alloc":
            alive[event["addr"]] = event
        elif event.get("action") == "free_completed":
            alive.pop(event["addr"], None)
    by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for event in alive.values():
        entry = by_site[_site(event.get("frames", []))]
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(by_site.items(), key=lambda item: -item[1][0])[:top]
    gib = float(1 << 30)
    return {
        "peak_gib": peak / gib,
        "events": len(events),
        "sites": [{"gib": size / gib, "blocks": count, "site": site} for site, (size, count) in ranked],
    }
