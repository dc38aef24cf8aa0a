"""The one way a benchmark writes its JSON record: what ran, where, on which versions and commit, and its numbers.

Every record carries the same common keys (``benchmark``, ``device``, ``host``, ``versions``, ``config``,
``commit``, ``date``) so that a number in docs/benchmarks.md can be traced to the machine and code that produced it;
the benchmark's own keys sit beside them at the top level, as they always have.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# python, torch and megatron-core, then every package of this workspace.
COMMON_KEYS = frozenset({"benchmark", "device", "host", "versions", "config", "commit", "date"})
PACKAGES = (
    "torch",
    "megatron-core",
    "verl-config",
    "verl-mcore-utils",
    "verl-dyncp",
    "verl-mfsdp",
    "verl-engine",
)


def results_path(name: str) -> Path:
    """``benchmarks/results/<name>``, wherever the script is run from (for default ``--out`` paths)."""
    return RESULTS / name


def versions(extra: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Python's version and each installed distribution's (None where it is not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in (*PACKAGES, *extra):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_name() -> str:
    """The CUDA device's name where the benchmark uses torch on a GPU, else the CPU's.

    torch is only looked at when the benchmark already imported it: a CPU benchmark of verl-config
    must not pay for (or need) torch.
    """
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"CPU: {platform.processor() or platform.machine()}"


def host_facts() -> dict[str, Any]:
    """The host CPU a run had: its model, the CPUs this process may use, the container's CPU quota and how often
    it was throttled, torch's intra-op threads, and a probe of how fast small host work runs here.

    Why: two leases of the same GPU type have run the same host-bound step (a graphed one-GPU step, 30 micro-batches)
    at 0.84 s and 1.9 s with the same GPU time; the GPU's name alone cannot tell such records apart.
    """
    facts: dict[str, Any] = {"cpu_model": _cpu_model(), "cpus": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    facts |= _cgroup_cpu()
    facts["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if torch is not None:
        facts["torch_threads"] = torch.get_num_threads()
        facts["probe_us"] = _host_probe(torch)
    return facts


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cgroup_cpu() -> dict[str, Any]:
    """The container's CPU quota as a CPU count (None: no quota) and its throttling counters so far (cgroup v2's
    ``cpu.max`` / ``cpu.stat``, or v1's ``cpu.cfs_quota_us`` / ``cpu.stat``)."""
    out: dict[str, Any] = {}
    v2, v1 = Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/cpu")
    try:
        if (v2 / "cpu.max").is_file():
            quota, period = (v2 / "cpu.max").read_text().split()
            out["cpu_quota"] = None if quota == "max" else int(quota) / int(period)
            stat_file = v2 / "cpu.stat"
        else:
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            out["cpu_quota"] = (
                None if quota_us < 0 else quota_us / int((v1 / "cpu.cfs_period_us").read_text())
            )
            stat_file = v1 / "cpu.stat"
        stat = dict(line.split() for line in stat_file.read_text().splitlines() if line.strip())
    except (OSError, ValueError):
        return out
    # throttled_usec: v2; throttled_time: v1, in nanoseconds
    for key in ("nr_periods", "nr_throttled", "throttled_usec", "throttled_time"):
        if key in stat:
            out[f"cgroup_{key}"] = int(stat[key])
    return out


def _host_probe(torch: Any) -> dict[str, float]:
    """Median microseconds of two small host jobs, 200 times each: a CPU ``repeat_interleave`` of 64 lengths
    (the kind of op that builds a THD layout per micro-batch) and a pure-Python loop of 10,000 additions."""
    import statistics
    import time

    lens = torch.full((64,), 32, dtype=torch.int64)

    def op() -> None:
        torch.repeat_interleave(torch.arange(64), lens)

    def loop() -> None:
        total = 0
        for i in range(10_000):
            total += i

    out = {}
    for name, job in (("repeat_interleave", op), ("python_loop", loop)):
        times = []
        for _ in range(200):
            start = time.perf_counter()
            job()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def commit() -> str | None:
    """The checkout's commit (``+dirty`` with uncommitted changes); ``BENCH_COMMIT`` where there is no git.

    GPU runs happen on a copy of the working tree (without ``.git``, or with a stale one): the launcher passes
    the commit in.
    """
    if os.environ.get("BENCH_COMMIT"):  # the launcher's word wins: a copied tree's .git may be stale
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parent

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return os.environ.get("BENCH_COMMIT")
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def save_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (tensors / numpy scalars as floats, paths as strings)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    return path


def write_record(
    out: str | Path,
    *,
    benchmark: str,
    config: dict[str, Any],
    numbers: dict[str, Any],
    device: Any = None,
    extra_versions: tuple[str, ...] = (),
    more_versions: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write one run's record to ``out`` and return it.

    ``numbers`` (what was measured) keeps its keys at the top level; ``device`` defaults to
    :func:`device_name`; ``extra_versions`` names more distributions to record, ``more_versions`` adds
    versions that are not distributions (CUDA, cuDNN).
    """
    clash = COMMON_KEYS & numbers.keys()
    if clash:
        raise ValueError(f"numbers must not set the common keys {sorted(clash)}")
    record = {
        "benchmark": benchmark,
        "device": device_name() if device is None else device,
        "host": host_facts(),
        "versions": {**versions(extra_versions), **(more_versions or {})},
        "config": config,
        **numbers,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    save_json(out, record)
    return record


def _jsonable(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


TARGETS = RESULTS / "targets.json"


def update_target(
    key: str, value: float, *, goal: str, source: str | Path, record: dict[str, Any], targets: Path = TARGETS
) -> dict[str, Any]:
    """Set one measured target of the GPU issue in ``benchmarks/results/targets.json`` (never edited by hand).

    ``source`` is the result JSON the number came from (stored relative to the repository), ``record`` that
    JSON's own record (its device and commit are copied, so each key says where and at which code it was
    measured), ``goal`` the bar it is held to in words. Other keys of the file are kept.
    """
    current = json.loads(targets.read_text()) if targets.exists() else {}
    path = Path(source).resolve()
    try:
        shown = str(path.relative_to(RESULTS.parent.parent))
    except ValueError:
        shown = str(source)
    current[key] = {
        "value": value,
        "goal": goal,
        "gpu": record.get("device"),
        "commit": record.get("commit"),
        "source": shown,
        "date": record.get("date"),
    }
    save_json(targets, dict(sorted(current.items())))
    return current[key]


# What makes two scaling_gpu.py records the same work per replica (compared by scaling_efficiency.py and
# loss_curves.py before they divide one record's numbers by another's).
SAME_WORK = ("shape", "seq", "seqs_per_replica", "micro_batch", "recompute", "fused_kernels")


def refuse_other_work(
    name: str, rec: dict[str, Any], ref: dict[str, Any], *, keys: tuple[str, ...] = SAME_WORK
) -> None:
    """SystemExit naming the first config key, device or commit where ``rec`` differs from ``ref``: a ratio of
    such records would compare settings or machines, not what the script measures."""
    for key in keys:
        if rec["config"].get(key) != ref["config"].get(key):
            raise SystemExit(
                f"{name}: config {key} {rec['config'].get(key)!r} is not the reference's {ref['config'].get(key)!r}"
            )
    for key in ("device", "commit"):
        if rec.get(key) != ref.get(key):
            raise SystemExit(f"{name}: {key} {rec.get(key)!r} is not the reference's {ref.get(key)!r}")
