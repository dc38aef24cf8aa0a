#!/usr/bin/env python3
"""The compatibility matrix of the docs site (docs/compatibility.md), made from the test matrix's results.

The nox sessions write one junit XML per pytest run: ``.nox/junit/<package>-mcore<version>.xml`` and
``cross-mcore<version>.xml`` (``nox -s tests``, every megatron-core release; ``nox -t ci``, the oldest and
newest), and ``verl-config.xml`` (``nox -s config``, without torch). A full matrix takes hours on a small
machine, so the page is not made from those files directly: ``collect`` reduces them to a small committed
summary (docs/compat/results.json: counts per package, test module and megatron-core release, plus where and
when each file was written), and ``render`` makes the page from that summary alone. A test checks that the
committed page equals ``render``'s output, as ``verl-config generate --check`` does for the reference configs.

    # after a run of the matrix (what the docs say to run):
    rm -rf .nox/junit && uv run nox -s config tests; \\
        uv run python scripts/compat_matrix.py update --about "nox -s config tests, <machine>, <date>"
    python scripts/compat_matrix.py collect --about TEXT [--junit-dir .nox/junit] [--results FILE]
    python scripts/compat_matrix.py render [--results FILE] [--out FILE] [--check]
    python scripts/compat_matrix.py gpu benchmarks/results/gpu_suite/h200x4 [...]   # GPU suite runs -> GPU rows

Rows are package x feature; a feature is a group of test modules, named by the explicit mapping below
(FEATURES). A test module the mapping does not know is an error naming it, so a new test file cannot vanish
from the page. Only the standard library is used: the script runs anywhere the repository is checked out.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "compat" / "results.json"
PAGE = ROOT / "docs" / "compatibility.md"
JUNIT_DIR = ROOT / ".nox" / "junit"
NOXFILE = ROOT / "noxfile.py"
PACKAGES = ("verl-config", "verl-mcore-utils", "verl-dyncp", "verl-mfsdp", "verl-engine")
CROSS = "cross"  # junit files of the cross-package tests (tests/)
NO_TORCH = "no torch"  # the column of `nox -s config` (verl-config alone, no torch installed)
RESULTS_VERSION = 1

# (package, feature, test-module patterns): which test modules show which feature. A module of the
# packages/<name>/tests folders counts for <name> only; a cross-package module (tests/) for the package named
# here. GPU modules (test_gpu_*) are listed so that a GPU run's results have a row; the CPU matrix deselects them.
FEATURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "verl-config",
        "loading, YAML, overrides (verl / Hydra syntax)",
        ("test_config_loader", "test_overrides"),
    ),
    ("verl-config", "ppo_trainer schema, engine sections, defaults", ("test_ppo_config", "test_tree_cache")),
    ("verl-config", "verl's validation rules", ("test_verl_rules",)),
    (
        "verl-config",
        "every verl key, default and type (pinned verl)",
        ("test_verl_parity", "test_verl_reference_data", "test_verl_defaults"),
    ),
    ("verl-config", "verl's launch commands", ("test_verl_launch_commands",)),
    ("verl-config", "LoRA block and module names", ("test_lora",)),
    ("verl-config", "generated configs and CLI", ("test_generated_and_cli",)),
    ("verl-mcore-utils", "compat layer (megatron-core differences)", ("test_compat",)),
    ("verl-mcore-utils", "DDP config builder", ("test_ddp_config",)),
    (
        "verl-mcore-utils",
        "model construction (providers, hooks, value head)",
        ("test_module", "test_model_build"),
    ),
    ("verl-mcore-utils", "mbridge without Transformer Engine", ("test_bridges",)),
    ("verl-mcore-utils", "core attention without Transformer Engine", ("test_core_attention",)),
    ("verl-mcore-utils", "HF weights: load, export (TP, PP)", ("test_weights",)),
    ("verl-mcore-utils", "mixture-of-experts models (Qwen3-MoE): HF parity, weights", ("test_moe",)),
    (
        "verl-mcore-utils",
        "mixture-of-experts models (GLM-4.5: DeepSeek-V3 router, shared experts): HF parity, weights",
        ("test_moe_glm",),
    ),
    (
        "verl-mcore-utils",
        "grouped experts without Transformer Engine (torch._grouped_mm)",
        ("test_grouped_experts", "test_gpu_grouped_experts"),
    ),
    ("verl-mcore-utils", "LoRA with peft, HF adapters", ("test_lora",)),
    ("verl-mcore-utils", "offload / onload", ("test_offload",)),
    ("verl-mcore-utils", "fused SwiGLU MLP (Triton)", ("test_swiglu", "test_gpu_swiglu")),
    (
        "verl-mcore-utils",
        "weight-gradient accumulation fused into the GEMM (no apex)",
        ("test_wgrad_fusion",),
    ),
    ("verl-mcore-utils", "sync-free gradient norm and clipping without apex", ("test_multi_tensor",)),
    ("verl-mcore-utils", "multi-process test helper", ("test_testing",)),
    ("verl-mcore-utils", "DDP hooks moved onto parameters for CUDA graphs", ("test_ddp_graph_hooks",)),
    ("verl-mcore-utils", "process groups, CUDA RNG tracker seeding", ("test_parallel",)),
    ("verl-dyncp", "CP groups", ("test_groups",)),
    (
        "verl-dyncp",
        "planner: dynamic / static CP, packing, split, merge, loss",
        ("test_planner", "test_packing"),
    ),
    ("verl-dyncp", "THD zigzag layout", ("test_thd",)),
    ("verl-dyncp", "CP core attention, RoPE kernel", ("test_attention", "test_fused_rope")),
    (
        "verl-dyncp",
        "CUDA-graph layouts, graphed decoder, graph dispatcher",
        ("test_graph_layout", "test_gpu_graph_layout", "test_decoder_graph"),
    ),
    ("verl-dyncp", "model parity: static and dynamic CP vs no CP", ("test_model_parity",)),
    ("verl-dyncp", "package installs alone", ("test_dyncp_package",)),
    ("verl-mfsdp", "Megatron-FSDP DDP settings per release", ("test_settings",)),
    ("verl-mfsdp", "lifecycle API errors (CPU)", ("test_lifecycle_cpu",)),
    ("verl-mfsdp", "package installs alone", ("test_mfsdp_package",)),
    ("verl-mfsdp", "training, offload, export, checkpoints (GPU)", ("test_gpu_mfsdp*",)),
    (
        "verl-engine",
        "RL losses (parity with the verl 0.9.1 wheel), LR schedules, settings refused at build",
        ("test_losses", "test_lr_schedule", "test_refusals", "test_verl_loss_parity"),
    ),
    (
        "verl-engine",
        "verl 0.9.1's TrainingWorker drives the engine (verl backend, nox -s verl)",
        ("test_verl_backend_cpu",),
    ),
    (
        "verl-engine",
        "every verl 0.9.1 engine key honoured, refused at build or not the engine's",
        ("test_config_support", "test_rl_engine_settings_cpu"),
    ),
    (
        "verl-engine",
        "rollout correction (IS weights, rejection sampling), bypass_mode",
        ("test_rollout_correction",),
    ),
    (
        "verl-engine",
        "log-probs, entropy, fused LM head",
        ("test_logprobs", "test_fused_head", "test_gpu_vocab_kernels", "test_vocab_kernels_interpreted"),
    ),
    (
        "verl-engine",
        "batches: packed, padded, verl's layout",
        ("test_packed", "test_rl_batch", "test_engine_data"),
    ),
    ("verl-engine", "RL engine: parity with transformers, DP, TP, CP", ("test_rl_engine_cpu",)),
    (
        "verl-engine",
        "one optimizer path, no host sync between micro-batches",
        ("test_engine_optimizer", "test_engine_no_host_sync"),
    ),
    ("verl-engine", "packed batches, static / dynamic CP", ("test_engine_packed_cpu",)),
    ("verl-engine", "PP, PP x VPP, PP x TP / CP", ("test_rl_engine_pipeline*", "test_gpu_pipeline")),
    ("verl-engine", "MTP", ("test_rl_engine_mtp*",)),
    (
        "verl-engine",
        "mixture of experts with pipeline stages: PP, VPP, PP x DP, EP x PP, router replay",
        ("test_rl_engine_moe_pp*", "test_gpu_moe_pp"),
    ),
    (
        "verl-engine",
        "GLM-4.5 MoE (DeepSeek-V3 router): expert-bias update at DP / CP / dynamic CP",
        ("test_rl_engine_moe_glm*", "test_gpu_moe_glm"),
    ),
    (
        "verl-engine",
        "mixture of experts: aux loss at DP / CP / dynamic CP, expert parallelism",
        ("test_rl_engine_moe*", "test_gpu_moe"),
    ),
    (
        "verl-engine",
        "grouped experts (moe_grouped_gemm) vs sequential: one PPO step",
        ("test_rl_engine_grouped_experts*",),
    ),
    (
        "verl-engine",
        "mixture of experts: router replay (R2 / R3)",
        ("test_rl_engine_router_replay*", "test_gpu_router_replay"),
    ),
    (
        "verl-engine",
        "TP + sequence parallelism without Transformer Engine: dense and MoE",
        ("test_rl_engine_sequence_parallel*", "test_gpu_moe_tp"),
    ),
    ("verl-engine", "LoRA", ("test_rl_engine_lora*",)),
    ("verl-engine", "offload / onload", ("test_rl_engine_offload*",)),
    ("verl-engine", "weights for rollout", ("test_rl_engine_export*",)),
    ("verl-engine", "checkpoints, exact resume", ("test_rl_engine_checkpoint*",)),
    (
        "verl-engine",
        "SFT engine, DP parity, close()",
        ("test_train_cpu", "test_dp_parity_cpu", "test_engine_lifetime*"),
    ),
    ("verl-engine", "GRPO loop, Ray workers, SIGTERM and resume", ("test_grpo*", "test_ray_workers*")),
    ("verl-engine", "verl-config -> megatron-core", ("test_config_to_mcore",)),
    (
        "verl-engine",
        "docs: examples, API entries, documented commands, this matrix",
        ("test_engine_doc", "test_docs_examples", "test_docs_commands", "test_compat_matrix"),
    ),
    (
        "verl-engine",
        "GPU paths",
        (
            "test_gpu_engine*",
            "test_gpu_decoder_graph",
            "test_gpu_decoder_graph_cp",
            "test_decoder_graphs_cpu",
            "test_gpu_construction",
            "test_gpu_weights",
            "test_gpu_offload",
            "test_gpu_lora",
            "test_gpu_fused_adam",
            "test_gpu_wgrad_fusion",
        ),
    ),
    (
        "verl-engine",
        "CLI start-up output, run directories, stop signals",
        ("test_cli_output", "test_run_dir", "test_interrupt"),
    ),
    (
        "verl-engine",
        "packaging rules, structure, benchmark records, GPU suite, CI lanes, release tooling (all packages)",
        (
            "test_packaging",
            "test_structure",
            "test_benchmark_results",
            "test_gpu_suite",
            "test_ci_lanes",
            "test_release_*",
        ),
    ),
)
OUTCOMES = ("passed", "failed", "skipped")
FILE_NAME = re.compile(r"^(?P<group>[a-z][a-z-]*?)(?:-mcore(?P<version>\d+(?:\.\d+)+))?\.xml$")


class CompatMatrixError(ValueError):
    """Bad input to the matrix: the message names the file, module or key and the fix."""


@dataclass(frozen=True)
class FileRun:
    """One junit file: which pytest run it is (group, column) and what it counted per test module."""

    group: str  # a package name or CROSS
    column: str  # a megatron-core version or NO_TORCH
    counts: dict[str, dict[str, int]]  # test module -> outcome -> count
    timestamp: str
    hostname: str


def mcore_versions(noxfile: Path = NOXFILE) -> list[str]:
    """noxfile.MCORE_VERSIONS, read without importing nox (the columns of the page, oldest first)."""
    for node in ast.parse(noxfile.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MCORE_VERSIONS" for t in node.targets
        ):
            return list(ast.literal_eval(node.value))
    raise CompatMatrixError(f"{noxfile} defines no MCORE_VERSIONS list")


def _module_of(case: ET.Element) -> str:
    """The test module of a junit <testcase>: the dotted classname's 'test_*' part (a collection error has
    an empty classname and the module path as its name)."""
    dotted = case.get("classname") or case.get("name") or ""
    for part in dotted.replace("/", ".").split("."):
        if part.startswith("test_"):
            return part.removesuffix(".py")
    raise CompatMatrixError(f"junit testcase {dotted!r} names no test_* module")


def read_junit(path: Path) -> FileRun:
    """Counts per test module of one junit XML file that a nox session wrote."""
    match = FILE_NAME.match(path.name)
    group = match["group"] if match else ""
    if not match or group not in (*PACKAGES, CROSS) or (match["version"] is None and group != "verl-config"):
        raise CompatMatrixError(
            f"{path}: not a junit file of the nox sessions; expected <package>-mcore<version>.xml,"
            f" {CROSS}-mcore<version>.xml or verl-config.xml (packages: {', '.join(PACKAGES)})"
        )
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as err:
        raise CompatMatrixError(f"{path}: not valid XML ({err}); rerun the session that wrote it") from None
    counts: dict[str, dict[str, int]] = {}
    suites = list(root.iter("testsuite"))
    for case in root.iter("testcase"):
        outcome = "passed"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        per_module = counts.setdefault(_module_of(case), dict.fromkeys(OUTCOMES, 0))
        per_module[outcome] += 1
    return FileRun(
        group=group,
        column=match["version"] or NO_TORCH,
        counts=counts,
        timestamp=suites[0].get("timestamp", "") if suites else "",
        hostname=suites[0].get("hostname", "") if suites else "",
    )


def collect(junit_dir: Path, *, about: str) -> dict:
    """The committed summary of every junit file in ``junit_dir`` (the whole matrix is replaced)."""
    paths = sorted(junit_dir.glob("*.xml"))
    if not paths:
        raise CompatMatrixError(
            f"no junit files in {junit_dir}; run the matrix first (uv run nox -s config tests) or pass --junit-dir"
        )
    if not about.strip():
        raise CompatMatrixError("--about is empty: say what run the files came from (command, machine, date)")
    runs: dict[str, dict[str, dict[str, dict[str, int]]]] = {}
    files: dict[str, dict[str, str]] = {}
    for path in paths:
        run = read_junit(path)
        runs.setdefault(run.column, {})[run.group] = run.counts
        files[path.name] = {"timestamp": run.timestamp, "hostname": run.hostname}
    results = {"format": RESULTS_VERSION, "about": about.strip(), "files": files, "runs": runs}
    rows(results)  # refuse now, not at render time, a module the feature mapping does not know
    return results


def _group_of(case: ET.Element) -> str:
    """The package a GPU junit <testcase> belongs to, from its dotted path (``packages.<name>.tests...``)."""
    dotted = (case.get("classname") or case.get("name") or "").replace("/", ".")
    parts = dotted.split(".")
    if len(parts) > 2 and parts[0] == "packages" and parts[1] in PACKAGES:
        return parts[1]
    return CROSS


def collect_gpu(folder: Path) -> tuple[str, dict]:
    """One GPU suite run (``scripts/gpu_suite.py`` records and junit files in ``folder``): its column name
    (the folder's name, e.g. ``h200x4``) and its summary (machine, versions, commits, counts per module)."""
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    if not records:
        raise CompatMatrixError(
            f"{folder}: no GPU suite records (<chunk>.json); run scripts/gpu_suite.py first"
        )
    machine = records[0]["machine"]
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for xml in sorted(folder.glob("*.xml")):
        try:
            root = ET.parse(xml).getroot()
        except ET.ParseError as err:
            raise CompatMatrixError(f"{xml}: not valid XML ({err}); rerun the chunk") from None
        for case in root.iter("testcase"):
            outcome = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                outcome = "failed"
            elif case.find("skipped") is not None:
                outcome = "skipped"
            per = counts.setdefault(_group_of(case), {}).setdefault(
                _module_of(case), dict.fromkeys(OUTCOMES, 0)
            )
            per[outcome] += 1
    entry = {
        "gpu": machine.get("gpu"),
        "gpus": machine.get("gpus"),
        "megatron_core": machine.get("megatron_core"),
        "transformer_engine": machine.get("transformer_engine"),
        "commits": sorted({r["commit"] for r in records}),
        "chunks": {r["chunk"]: _chunk_state(r) for r in records},
        "counts": counts,
    }
    return folder.name, entry


def _chunk_state(record: dict) -> str:
    return "green" if record["green"] else "timed out" if record["timed_out"] else "failed"


def load_results(path: Path) -> dict:
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise CompatMatrixError(f"{path} does not exist; make it with `compat_matrix.py collect`") from None
    if not isinstance(results, dict) or results.get("format") != RESULTS_VERSION:
        raise CompatMatrixError(f"{path}: 'format' must be {RESULTS_VERSION}; regenerate it with `collect`")
    for key in ("about", "files", "runs"):
        if key not in results:
            raise CompatMatrixError(f"{path}: key {key!r} is missing; regenerate it with `collect`")
    return results


def dump_results(results: dict) -> str:
    return json.dumps(results, indent=1, sort_keys=True) + "\n"


def _feature_of(package: str, module: str) -> tuple[str, str]:
    """(package, feature) of a test module run in ``package``'s folder, or in tests/ (package == CROSS)."""
    for pkg, feature, patterns in FEATURES:
        if (package in (CROSS, pkg)) and any(fnmatch.fnmatchcase(module, p) for p in patterns):
            return pkg, feature
    where = "tests/" if package == CROSS else f"packages/{package}/tests/"
    raise CompatMatrixError(
        f"test module {where}{module}.py has no feature: add it to a row of FEATURES in scripts/compat_matrix.py"
    )


def rows(results: dict) -> dict[tuple[str, str], dict[str, dict[str, int]]]:
    """(package, feature) -> column -> outcome -> count, with every row of FEATURES present."""
    table: dict[tuple[str, str], dict[str, dict[str, int]]] = {(p, f): {} for p, f, _ in FEATURES}
    for column, groups in results["runs"].items():
        for group, modules in groups.items():
            for module, counts in modules.items():
                cell = table[_feature_of(group, module)].setdefault(column, dict.fromkeys(OUTCOMES, 0))
                for outcome in OUTCOMES:
                    cell[outcome] += int(counts.get(outcome, 0))
    return table


def gpu_rows(results: dict) -> dict[tuple[str, str], dict[str, dict[str, int]]]:
    """(package, feature) -> GPU run -> outcome -> count, for the rows with any GPU result."""
    table: dict[tuple[str, str], dict[str, dict[str, int]]] = {}
    for column, run in results.get("gpu_runs", {}).items():
        for group, modules in run["counts"].items():
            for module, counts in modules.items():
                row = table.setdefault(_feature_of(group, module), {})
                cell = row.setdefault(column, dict.fromkeys(OUTCOMES, 0))
                for outcome in OUTCOMES:
                    cell[outcome] += int(counts.get(outcome, 0))
    order = [(p, f) for p, f, _ in FEATURES]
    return {key: table[key] for key in order if key in table}


def _gpu_section(results: dict) -> list[str]:
    runs = results.get("gpu_runs", {})
    if not runs:
        return []
    columns = sorted(runs, key=lambda c: (runs[c]["gpus"], c))
    lines = [
        "## GPU runs",
        "",
        "The GPU suite (`scripts/gpu_suite.py`: every test marked `gpu`, in chunks of the GPU count their tests"
        " need) on lent machines. Tests that need Transformer Engine or mbridge skip where those are not"
        " installed (the device machines have neither).",
        "",
        "| run | GPU | count | megatron-core | Transformer Engine | commit(s) | chunks |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in columns:
        r = runs[c]
        chunks = ", ".join(f"{n} {state}" for n, state in sorted(r["chunks"].items()))
        lines.append(
            f"| `{c}` | {r['gpu']} | {r['gpus']} | {r['megatron_core']} | {r['transformer_engine'] or 'no'}"
            f" | {', '.join(r['commits'])} | {chunks} |"
        )
    lines += ["", "| package | feature | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for (pkg, feature), cells in gpu_rows(results).items():
        lines.append(f"| {pkg} | {feature} | " + " | ".join(_cell(cells.get(c)) for c in columns) + " |")
    return [*lines, ""]


def _cell(counts: dict[str, int] | None) -> str:
    if not counts or not any(counts.values()):
        return "not run"
    parts = [f"{counts[o]} {o}" for o in OUTCOMES if counts[o]]
    text = ", ".join(parts)
    return f"**{text}**" if counts["failed"] else text


def render(results: dict, *, versions: list[str]) -> str:
    """docs/compatibility.md from the committed summary."""
    table = rows(results)
    extra = [c for c in results["runs"] if c not in versions and c != NO_TORCH]
    if extra:
        raise CompatMatrixError(
            f"results hold megatron-core {', '.join(sorted(extra))}, which noxfile.MCORE_VERSIONS does not list;"
            " recollect from the current matrix"
        )
    run_columns = [v for v in versions if v in results["runs"]]
    lines = [
        "# Compatibility matrix",
        "",
        "<!-- Generated by scripts/compat_matrix.py from docs/compat/results.json: do not edit by hand. -->",
        "",
        "What the CPU test matrix shows for each package and feature on each megatron-core release: the number of"
        " tests that passed, failed or were skipped, or *not run*. The tests run on CPU (fp32, gloo) with"
        " `-m 'not gpu'`; GPU results are in the [benchmarks](benchmarks.md). Each session installs the packages"
        " from `uv.lock` and then the megatron-core release of its column.",
        "",
        f"**Data:** {results['about']}",
        "",
        f"Releases with results: {', '.join(run_columns) if run_columns else 'none'}"
        + (
            f"; `{NO_TORCH}` is `nox -s config` (verl-config without torch)."
            if NO_TORCH in results["runs"]
            else "."
        ),
        "",
        "To regenerate from a full run of the matrix (hours on a 2-core machine; `nox -t ci` runs the oldest and newest"
        " release only):",
        "",
        "```bash",
        "rm -rf .nox/junit && uv run nox -s config tests; \\",
        '    uv run python scripts/compat_matrix.py update --about "nox -s config tests, <machine>, <date>"',
        "```",
        "",
    ]
    for package in PACKAGES:
        # verl-config touches neither torch nor megatron-core: its tests run once, without torch (`nox -s config`)
        columns = [NO_TORCH] if package == "verl-config" else versions
        lines += [f"## {package}", "", "| feature | " + " | ".join(columns) + " |"]
        lines.append("|---" * (len(columns) + 1) + "|")
        for (pkg, feature), cells in table.items():
            if pkg == package:
                lines.append(f"| {feature} | " + " | ".join(_cell(cells.get(c)) for c in columns) + " |")
        lines.append("")
    lines += _gpu_section(results)
    lines += ["## Test modules per feature", "", "| package | feature | test modules |", "|---|---|---|"]
    for pkg, feature, patterns in FEATURES:
        lines.append(f"| {pkg} | {feature} | {', '.join(f'`{p}`' for p in patterns)} |")
    lines += ["", "## Junit files behind this page", "", "| file | written | host |", "|---|---|---|"]
    for name, meta in sorted(results["files"].items()):
        lines.append(f"| `{name}` | {meta.get('timestamp', '')} | {meta.get('hostname', '')} |")
    return "\n".join(lines) + "\n"


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


def _write_or_check(path: Path, text: str, *, check: bool) -> int:
    if check:
        if not path.exists() or path.read_text() != text:
            print(
                f"{_shown(path)} is stale: run `uv run python scripts/compat_matrix.py render`",
                file=sys.stderr,
            )
            return 1
        print(f"{_shown(path)} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {_shown(path)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("collect", "junit XML files -> the committed summary"),
        ("render", "the committed summary -> docs/compatibility.md"),
        ("update", "collect, then render"),
        ("gpu", "add GPU suite runs (scripts/gpu_suite.py folders) to the summary, then render"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument(
            "--results",
            type=Path,
            default=RESULTS,
            help=f"summary file (default {RESULTS.relative_to(ROOT)})",
        )
        if name in ("collect", "update"):
            p.add_argument("--junit-dir", type=Path, default=JUNIT_DIR, help="default .nox/junit")
            p.add_argument(
                "--about", required=True, help="what run the files came from: command, machine, date"
            )
        if name in ("render", "update", "gpu"):
            p.add_argument("--out", type=Path, default=PAGE, help=f"page (default {PAGE.relative_to(ROOT)})")
        if name == "gpu":
            p.add_argument("folders", type=Path, nargs="+", help="benchmarks/results/gpu_suite/<gpu>x<count>")
        if name == "render":
            p.add_argument("--check", action="store_true", help="fail if the page differs from the summary's")
    args = parser.parse_args(argv)
    try:
        if args.command in ("collect", "update"):
            results = collect(args.junit_dir, about=args.about)
            if args.results.exists():  # the GPU runs come from another command: keep them
                results["gpu_runs"] = load_results(args.results).get("gpu_runs", {})
            _write_or_check(args.results, dump_results(results), check=False)
        if args.command == "gpu":
            results = load_results(args.results)
            for folder in args.folders:
                column, entry = collect_gpu(folder)
                results.setdefault("gpu_runs", {})[column] = entry
            gpu_rows(results)  # a module the feature mapping does not know is an error now
            _write_or_check(args.results, dump_results(results), check=False)
        if args.command in ("render", "update", "gpu"):
            text = render(load_results(args.results), versions=mcore_versions())
            return _write_or_check(args.out, text, check=getattr(args, "check", False))
    except CompatMatrixError as err:
        print(f"compat_matrix: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
