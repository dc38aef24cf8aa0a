#!/usr/bin/env python3
"""Build an offline wheelhouse for an air-gapped GPU host that already has torch.

    python scripts/wheelhouse.py --out wheelhouse [--python-version 3.12]
        [--platform manylinux_2_28_x86_64] [--mcore 0.19.2] [--extra mbridge] [--extra peft]

Puts into one folder: wheels of the five workspace packages (built from this checkout) and, for the
chosen Python version / platform / megatron-core version, the wheels such a host still lacks
(megatron-core, omegaconf and its antlr4 runtime, pyyaml, tqdm, packaging, tensordict with cloudpickle and
pyvers; mbridge / peft with --extra). Versions come from uv.lock, so the GPU host runs what CI tested. Pure-Python packages that
PyPI ships only as source are built into wheels here. Install there with the one line printed at
the end (also written to INSTALL.txt):

    python3 -m pip install --no-index --no-deps --target /tmp/site wheelhouse/*.whl && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = [
    "megatron-core", "omegaconf", "antlr4-python3-runtime", "pyyaml", "tqdm", "packaging",
    "tensordict", "cloudpickle", "pyvers",  # verl-engine's losses read verl's TensorDict batches
]  # fmt: skip
EXTRAS = {"mbridge": ["mbridge"], "peft": ["peft", "safetensors"], "hf": ["safetensors"]}
PLATFORM_TAGS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def locked_versions() -> dict[str, str]:
    lock = tomllib.loads((ROOT / "uv.lock").read_text())
    return {p["name"]: p["version"] for p in lock["package"] if "version" in p}


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="wheelhouse", type=Path)
    ap.add_argument("--python-version", default="3.12")
    ap.add_argument(
        "--platform", action="append", help="pip --platform tag (repeatable); default: manylinux x86_64 tags"
    )
    ap.add_argument("--mcore", help="megatron-core version (default: the locked one)")
    ap.add_argument("--extra", action="append", default=[], choices=sorted(EXTRAS))
    args = ap.parse_args(argv)

    out: Path = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    versions = locked_versions()
    if args.mcore:
        versions["megatron-core"] = args.mcore
    names = RUNTIME + [n for e in args.extra for n in EXTRAS[e]]
    pins = [f"{n}=={versions[n]}" for n in dict.fromkeys(names)]

    run(["uv", "build", "--all-packages", "--wheel", "--out-dir", str(out), str(ROOT)])
    platforms = args.platform or PLATFORM_TAGS
    plat_args = [a for p in platforms for a in ("--platform", p)]
    for pin in pins:
        try:
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--implementation",
                    "cp",
                    "--python-version",
                    args.python_version,
                    *plat_args,
                    "-d",
                    str(out),
                    pin,
                ]
            )
        except subprocess.CalledProcessError:
            # Only a source distribution (e.g. antlr4-python3-runtime): build a pure-Python wheel here.
            run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), pin])
    for f in out.iterdir():
        if f.suffix != ".whl":
            f.unlink()
    line = f"python3 -m pip install --no-index --no-deps --target /tmp/site {out.name}/*.whl && export PYTHONPATH=/tmp/site"
    (out / "INSTALL.txt").write_text(line + "\n")
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
    print(
        f"\n{len(list(out.glob('*.whl')))} wheels, {size:.1f} MiB in {out}\ninstall on the GPU host with:\n  {line}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
