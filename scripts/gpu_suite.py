#!/usr/bin/env python3
"""The GPU test suite: every test marked ``gpu`` on the GPUs of one machine, in chunks that each fit one
10-minute device command.

A chunk is a set of test files and the number of GPUs its tests need (``VERL_TEST_GPUS``: the root conftest
keeps only tests needing exactly that many). ``run`` schedules the chunks that fit the machine onto its GPUs,
several at once (four one-GPU chunks on four GPUs, or two two-GPU chunks), each with its own
``CUDA_VISIBLE_DEVICES``, and writes per chunk ``<chunk>.log``, ``<chunk>.xml`` (junit) and ``<chunk>.json``
(GPU, versions, commit, seconds, outcome counts) into the output folder. A run that would pass its time
budget stops its chunks and says so in their records, so a command never dies silently at the device limit.
``report`` checks a folder: every chunk the machine's GPU count calls for has run, green. ``check`` (on CPU)
fails when a test file's tests needing n GPUs are in no chunk of n GPUs, so a new GPU test cannot fall out of
the suite.

Results go to ``benchmarks/results/gpu_suite/<gpu>x<count>/`` (``scripts/compat_matrix.py gpu`` adds them to
the compatibility matrix). Standard library only: it runs on the device machine with ``python3``.

    # on the device machine (wheelhouse/ carried), two commands on a 4-GPU machine:
    python3 scripts/gpu_suite.py run --install wheelhouse --out /tmp/s --commit SHA --chunks packed4,engine2
    python3 scripts/gpu_suite.py run --install wheelhouse --out /tmp/s --commit SHA --chunks construct2,fsdp2,...
    tar czf $OUT/suite.tgz -C /tmp s   # the device returns few files: one archive
    python3 scripts/gpu_suite.py report benchmarks/results/gpu_suite/h200x4
    python3 scripts/gpu_suite.py check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path("/tmp/site")
RESULTS = ROOT / "benchmarks" / "results" / "gpu_suite"
OUTCOMES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class Chunk:
    """Test files whose tests needing exactly ``gpus`` GPUs run together; ``seconds`` is the measured time of
    the last green run (for the schedule and for splitting commands), not a limit."""

    name: str
    gpus: int
    paths: tuple[str, ...]
    seconds: int


CHUNKS: tuple[Chunk, ...] = (
    Chunk(
        "engine1",
        1,
        (
            "tests/test_gpu_engine.py",
            "tests/test_gpu_engine_packed.py",
            "tests/test_gpu_engine_kernels.py",
            "tests/test_engine_no_host_sync.py",
            "tests/test_engine_optimizer.py",
            "tests/test_gpu_decoder_graph.py",
        ),
        260,
    ),
    Chunk(
        "state1",
        1,
        (
            "tests/test_gpu_lora.py",
            "tests/test_gpu_weights.py",
            "tests/test_gpu_offload.py",
            "tests/test_gpu_engine_lifetime.py",
            "tests/test_gpu_router_replay.py",
        ),
        280,
    ),
    Chunk(
        "packages1",
        1,
        (
            "packages/verl-dyncp/tests/test_attention.py",
            "packages/verl-dyncp/tests/test_fused_rope.py",
            "packages/verl-dyncp/tests/test_gpu_graph_layout.py",
            "packages/verl-engine/tests/test_gpu_vocab_kernels.py",
            "packages/verl-mcore-utils/tests/test_bridges.py",
            "packages/verl-mcore-utils/tests/test_gpu_swiglu.py",
            "packages/verl-mcore-utils/tests/test_multi_tensor.py",
            "packages/verl-mcore-utils/tests/test_parallel.py",
            "tests/test_gpu_construction.py",
            "tests/test_gpu_fused_adam.py",
            "tests/test_gpu_grouped_experts.py",
            "tests/test_gpu_wgrad_fusion.py",
            "tests/test_gpu_mfsdp.py",
            "tests/test_gpu_mfsdp_memory.py",
        ),
        210,
    ),
    Chunk("lifecycle2", 2, ("tests/test_gpu_mfsdp_lifecycle.py",), 175),  # 174 s green at 721c67c
    Chunk(
        "engine2",
        2,
        (
            "tests/test_gpu_engine.py",
            "tests/test_gpu_engine_packed.py",
            "tests/test_gpu_pipeline.py",
        ),
        240,
    ),
    Chunk(
        "moe2",
        2,
        (
            "tests/test_gpu_moe.py",
            "tests/test_gpu_router_replay.py",
            "tests/test_gpu_moe_glm.py",
            "tests/test_gpu_moe_pp.py",
        ),
        460,
    ),
    Chunk("moetp2", 2, ("tests/test_gpu_moe_tp.py",), 230),
    Chunk("construct2", 2, ("tests/test_gpu_construction.py", "tests/test_gpu_offload.py"), 280),
    Chunk(
        "fsdp2",
        2,
        (
            "tests/test_gpu_mfsdp.py",
            "packages/verl-dyncp/tests/test_attention.py",
            "packages/verl-mcore-utils/tests/test_bridges.py",
        ),
        370,  # 492 s at 721c67c with the memory tests, now in fsdpmem2: 5 two-GPU runs of about 60 s, 30 s more
    ),
    Chunk("graphcp2", 2, ("tests/test_gpu_decoder_graph_cp.py",), 240),  # new: 2 layouts x 2 two-rank runs
    Chunk("fsdpmem2", 2, ("tests/test_gpu_mfsdp_memory.py",), 150),  # 2 tests of 2 runs, 61 + 70 s at 721c67c
    Chunk("packed4", 4, ("tests/test_gpu_engine_packed.py",), 230),
    Chunk("pipeline4", 4, ("tests/test_gpu_pipeline.py", "tests/test_gpu_moe_pp.py"), 170),
)
_GPU_MARK = re.compile(r"pytest\.mark\.(gpu|num_gpus)\b")


class SuiteError(Exception):
    pass


def chunks_for(gpus: int) -> list[Chunk]:
    """The chunks a machine with ``gpus`` GPUs runs: those whose tests need at most that many."""
    return [c for c in CHUNKS if c.gpus <= gpus]


def select(names: str | None, *, gpus: int) -> list[Chunk]:
    """``names``: comma-separated chunk names, ``rest`` (those without a record yet: see ``run``), or None."""
    fitting = chunks_for(gpus)
    if not names:
        return fitting
    known = {c.name: c for c in CHUNKS}
    chosen = []
    for name in names.split(","):
        if name == "rest":
            continue
        if name not in known:
            raise SuiteError(f"unknown chunk {name!r}; chunks: {', '.join(known)}")
        if known[name].gpus > gpus:
            raise SuiteError(f"chunk {name!r} needs {known[name].gpus} GPUs, this machine has {gpus}")
        chosen.append(known[name])
    return chosen


def gpu_test_files(root: Path = ROOT) -> list[str]:
    """Every test module (repository-relative) that holds a test marked ``gpu`` or ``num_gpus``."""
    found = []
    for folder in [root / "tests", *sorted((root / "packages").glob("*/tests"))]:
        for path in sorted(folder.glob("test_*.py")):
            if _GPU_MARK.search(path.read_text()):
                found.append(str(path.relative_to(root)))
    return found


def gpu_inventory(root: Path = ROOT) -> dict[str, list[int]]:
    """Test file -> the GPU counts its GPU tests need, from pytest's collection (the root conftest writes it)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "inventory.json"
        env = {**os.environ, "VERL_TEST_GPU_INVENTORY": str(target)}
        env.pop("VERL_TEST_GPUS", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", "gpu",
               *gpu_test_files(root)]  # fmt: skip
        done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not target.exists():
            raise SuiteError(
                f"collecting the GPU tests failed (rc {done.returncode}):\n{done.stdout[-3000:]}"
            )
        return json.loads(target.read_text())


def uncovered(inventory: dict[str, list[int]]) -> list[str]:
    """``file (n GPUs)`` for every test file whose n-GPU tests no chunk of n GPUs runs."""
    return [
        f"{path} ({n} GPUs)"
        for path, counts in sorted(inventory.items())
        for n in counts
        if not any(c.gpus == n and path in c.paths for c in CHUNKS)
    ]


def count_junit(path: Path) -> dict[str, int]:
    counts = dict.fromkeys(OUTCOMES, 0)
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def _install(wheelhouse: Path) -> dict[str, str]:
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    if not wheels:
        raise SuiteError(f"no wheels in {wheelhouse}; build them with scripts/wheelhouse.py")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
         "--upgrade", "--target", str(SITE), *wheels],
        check=True,
    )  # fmt: skip
    return {"PYTHONPATH": str(SITE)}


def _machine(env: dict[str, str]) -> dict[str, object]:
    probe = (
        "import json, torch, importlib.metadata as m\n"
        "def v(n):\n"
        "    try:\n        return m.version(n)\n    except m.PackageNotFoundError:\n        return None\n"
        "print(json.dumps({'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,"
        " 'gpus': torch.cuda.device_count(), 'torch': torch.__version__, 'megatron_core': v('megatron-core'),"
        " 'transformer_engine': v('transformer-engine'), 'mbridge': v('mbridge'),"
        " 'verl_engine': v('verl-engine')}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_installed(machine: dict[str, object]) -> None:
    """Refuse, before any chunk starts, a machine whose Python cannot import megatron-core or verl-engine.

    A device machine handed back between two commands comes back bare: without this, every chunk fails at
    import in seconds and the command's records read as test failures.
    """
    missing = [name for name in ("megatron_core", "verl_engine") if not machine.get(name)]
    if missing:
        raise SuiteError(
            f"{' and '.join(n.replace('_', '-') for n in missing)} not installed for this Python (a fresh"
            " machine?): pass --install wheelhouse (the folder scripts/wheelhouse.py wrote)"
        )


def gpu_tag(machine: dict[str, object]) -> str:
    """``h200x4`` from the device name and count."""
    name = str(machine.get("gpu") or "cpu").lower()
    model = next((m for m in ("h200", "h100", "a100", "b200", "l40s") if m in name), name.split()[-1])
    return f"{model}x{machine['gpus']}"


def run(
    *, out: Path, chunk_names: str | None, commit: str, budget_s: float, env: dict[str, str], machine: dict
) -> int:
    gpus = int(machine["gpus"])
    if gpus < 1:
        raise SuiteError("no CUDA device visible: the GPU suite runs on a GPU machine")
    out.mkdir(parents=True, exist_ok=True)
    pending = select(chunk_names, gpus=gpus)
    if chunk_names and "rest" in chunk_names.split(","):
        pending += [c for c in chunks_for(gpus) if not (out / f"{c.name}.json").exists() and c not in pending]
    pending.sort(key=lambda c: (-c.gpus, -c.seconds))
    start = time.monotonic()
    free = list(range(gpus))
    running: list[tuple[Chunk, list[int], subprocess.Popen, float]] = []
    worst = 0
    started = False
    while pending or running:
        left = budget_s - (time.monotonic() - start)
        for chunk in list(pending):
            # the first chunk always starts; a later one only if its last green time fits what is left (a chunk
            # started without that time is stopped at the budget and says nothing: device time spent for nothing)
            if chunk.gpus <= len(free) and (not started or chunk.seconds <= left):
                ids, free = free[: chunk.gpus], free[chunk.gpus :]
                running.append((chunk, ids, _start(chunk, ids, out=out, env=env), time.monotonic()))
                pending.remove(chunk)
                started = True
        if not running:  # every GPU is free, so what is pending needs more time than is left
            for chunk in pending:
                print(
                    f"{chunk.name}: not started (its last green run took {chunk.seconds} s, {left:.0f} s left)"
                )
            return max(worst, 1)
        time.sleep(2)
        over = time.monotonic() - start > budget_s
        for item in list(running):
            chunk, ids, proc, began = item
            if proc.poll() is None and not over:
                continue
            timed_out = proc.poll() is None
            if timed_out:
                proc.kill()
                proc.wait()
            rc = _record(chunk, ids, out=out, rc=proc.returncode, seconds=time.monotonic() - began,
                         timed_out=timed_out, commit=commit, machine=machine)  # fmt: skip
            worst = max(worst, rc)
            running.remove(item)
            free = sorted(free + ids)
        if over:
            for chunk in pending:
                print(f"{chunk.name}: not started (the run's budget of {budget_s:.0f} s is spent)")
            return max(worst, 1) if pending else worst
    return worst


def _start(chunk: Chunk, ids: list[int], *, out: Path, env: dict[str, str]) -> subprocess.Popen:
    child = {**os.environ, **env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, ids)),
             "VERL_TEST_GPUS": str(chunk.gpus), "PYTHONUNBUFFERED": "1"}  # fmt: skip
    log = open(out / f"{chunk.name}.log", "w")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfEs", "--durations=20",
           f"--junitxml={out / f'{chunk.name}.xml'}", *chunk.paths]  # fmt: skip
    print(f"{chunk.name}: started on GPU {','.join(map(str, ids))}", flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=child, stdout=log, stderr=subprocess.STDOUT)


def _record(
    chunk: Chunk,
    ids: list[int],
    *,
    out: Path,
    rc: int,
    seconds: float,
    timed_out: bool,
    commit: str,
    machine: dict,
) -> int:
    xml = out / f"{chunk.name}.xml"
    counts = count_junit(xml) if xml.exists() and not timed_out else None
    green = rc == 0 and counts is not None and counts["failed"] == 0
    record = {
        "chunk": chunk.name, "gpus_needed": chunk.gpus, "paths": list(chunk.paths), "gpu_ids": ids,
        "machine": machine, "commit": commit, "seconds": round(seconds, 1), "rc": rc, "timed_out": timed_out,
        "counts": counts, "green": green,
    }  # fmt: skip
    (out / f"{chunk.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    state = "timed out" if timed_out else ("green" if green else f"FAILED (rc {rc})")
    print(f"{chunk.name}: {state} in {seconds:.0f} s {counts or ''}", flush=True)
    return 0 if green else 1


def report(folder: Path) -> int:
    """Every chunk the folder's machine calls for, with its outcome; non-zero unless all ran green."""
    records = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not records:
        raise SuiteError(f"{folder}: no chunk records; run the suite first")
    gpus = max(int(r["machine"]["gpus"]) for r in records.values())
    bad = 0
    for chunk in chunks_for(gpus):
        r = records.get(chunk.name)
        if r is None:
            print(f"{chunk.name}: not run")
            bad += 1
            continue
        state = "green" if r["green"] else ("timed out" if r["timed_out"] else "FAILED")
        bad += not r["green"]
        print(
            f"{chunk.name} ({chunk.gpus} GPU): {state}, {r['counts']}, {r['seconds']} s, commit {r['commit']}"
        )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run chunks on this machine's GPUs")
    p.add_argument("--out", type=Path, required=True, help="folder for the chunks' logs, junit and records")
    p.add_argument(
        "--chunks", help="comma-separated chunk names; 'rest' adds those without a record in --out"
    )
    p.add_argument(
        "--commit", default=os.environ.get("BENCH_COMMIT", "unknown"), help="the commit under test"
    )
    p.add_argument("--budget", type=float, default=560.0, help="seconds before running chunks are stopped")
    p.add_argument(
        "--install", type=Path, help="install this wheelhouse into /tmp/site first (device machine)"
    )
    r = sub.add_parser("report", help="the outcome of every chunk in a results folder")
    r.add_argument("folder", type=Path)
    sub.add_parser("check", help="fail if a test file with GPU tests is in no chunk")
    sub.add_parser("list", help="the chunks")
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            env = _install(args.install) if args.install else {}
            machine = _machine({**os.environ, **env})
            print(f"{gpu_tag(machine)}: {json.dumps(machine)}", flush=True)
            check_installed(machine)
            return run(out=args.out, chunk_names=args.chunks, commit=args.commit, budget_s=args.budget, env=env,
                       machine=machine)  # fmt: skip
        if args.command == "report":
            return report(args.folder)
        if args.command == "list":
            for c in CHUNKS:
                print(f"{c.name}: {c.gpus} GPU, ~{c.seconds} s: {' '.join(c.paths)}")
            return 0
        inventory = gpu_inventory()
        missing = uncovered(inventory)
        if missing:
            raise SuiteError(f"GPU tests in no chunk of scripts/gpu_suite.py CHUNKS: {', '.join(missing)}")
        print(f"every GPU test of {len(inventory)} files is in a chunk of its GPU count")
        return 0
    except SuiteError as err:
        print(f"gpu_suite: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
