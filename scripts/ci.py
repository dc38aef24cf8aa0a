"""Run the CI sessions (``nox -t ci``) in two lanes side by side: the newest megatron-core's ``tests`` session in
one, every other CI session in the other.

Why: on the 2-core CI machine a serial ``nox -t ci`` took 33-37 minutes though its processes kept 1.2 cores busy on
average (most tests start two to four ranks that wait on each other, on process start-up and on collectives). The
newest release's ``tests`` session alone is about 60% of the work; the other sessions fit beside it.

Each lane is one ``nox`` process; both always run to the end (nox runs every session it was given, even after a
failure), their output is printed as it comes, each line prefixed with its lane, and the exit status is nonzero
when either lane failed. The second lane gets its own default rendezvous port (``MASTER_PORT``): code that
initialises a single-process group without one falls back to a fixed port, and two lanes must not share it.

    uv run python scripts/ci.py            # the two lanes
    uv run python scripts/ci.py --serial   # plain `nox -t ci`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

NOX = [sys.executable, "-m", "nox"]
SECOND_LANE_MASTER_PORT = "29712"  # not the single-process default of verl_mcore_utils.parallel (29512)


def ci_sessions(*, command: list[str] = NOX) -> list[str]:
    """The CI-tagged nox sessions, in the noxfile's order."""
    listing = subprocess.run(
        [*command, "-t", "ci", "-l", "--json"], capture_output=True, text=True, check=True
    )
    return [entry["session"] for entry in json.loads(listing.stdout)]


def lanes(sessions: list[str]) -> list[list[str]]:
    """[the newest megatron-core's tests session], [every other session]; one lane when there is no tests session."""
    tests = sorted((s for s in sessions if s.startswith("tests(")), key=_release)
    if not tests:
        return [sessions]
    newest = tests[-1]
    return [[newest], [s for s in sessions if s != newest]]


def _release(session: str) -> tuple[int, ...]:
    return tuple(int(part) for part in session[len("tests(") : -1].split("."))


def _pump(name: str, proc: subprocess.Popen[str], lock: threading.Lock) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        with lock:
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()


def run_lanes(groups: list[list[str]], *, command: list[str] = NOX) -> int:
    """Run ``command -s <group>`` for every group at once; 0 when every one exited 0."""
    lock = threading.Lock()
    procs, pumps, names = [], [], []
    start = time.monotonic()
    for index, group in enumerate(groups):
        env = dict(os.environ)
        if index:
            env.setdefault("MASTER_PORT", SECOND_LANE_MASTER_PORT)
        name = group[0] if len(group) == 1 else f"lane{index + 1}"
        print(f"ci: {name}: nox -s {' '.join(group)}", flush=True)
        proc = subprocess.Popen(
            [*command, "-s", *group],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        pump = threading.Thread(target=_pump, args=(name, proc, lock), daemon=True)
        pump.start()
        procs.append(proc)
        pumps.append(pump)
        names.append(name)
    codes = []
    for name, proc, pump in zip(names, procs, pumps, strict=True):
        codes.append(proc.wait())
        pump.join()
        print(
            f"ci: {name} finished with exit status {codes[-1]} at {time.monotonic() - start:.0f} s",
            flush=True,
        )
    return 0 if all(code == 0 for code in codes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serial", action="store_true", help="run `nox -t ci` as one process instead")
    args = parser.parse_args(argv)
    if args.serial:
        return subprocess.run([*NOX, "-t", "ci"]).returncode
    return run_lanes(lanes(ci_sessions()))


if __name__ == "__main__":
    raise SystemExit(main())
