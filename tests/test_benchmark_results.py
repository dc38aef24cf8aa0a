"""scripts/check_benchmark_results.py: docs/benchmarks.md names every file under benchmarks/results/."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import check_benchmark_results as cbr  # noqa: E402


def test_every_results_file_is_named_by_the_doc() -> None:
    assert cbr.main() == 0, f"not named by docs/benchmarks.md: {cbr.unnamed()}"


def test_a_name_counts_only_as_a_whole_file_name(tmp_path: Path) -> None:
    results = tmp_path / "results"
    (results / "logs").mkdir(parents=True)
    for name in ("run.json", "run_repeat.json", "logs/a.log", "b.txt"):
        (results / name).write_text("{}")
    doc = tmp_path / "benchmarks.md"
    doc.write_text("Raw: `benchmarks/results/run_repeat.json`, results/logs/a.log. The b.txt.gz archive.\n")
    assert cbr.unnamed(results=results, doc=doc) == ["b.txt", "run.json"]
    (results / "suite" / "x4").mkdir(parents=True)
    (results / "suite" / "x4" / "one.log").write_text("")
    assert "suite/x4/one.log" in cbr.unnamed(results=results, doc=doc)
    doc.write_text(doc.read_text() + "The suite's files: `benchmarks/results/suite/x4/`.\n")
    assert "suite/x4/one.log" not in cbr.unnamed(results=results, doc=doc)


def test_a_record_carries_the_common_keys_beside_its_numbers(tmp_path: Path) -> None:
    import torch  # noqa: F401  (a GPU benchmark has it imported: the record then reads its threads)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _record

    out = tmp_path / "results" / "x.json"
    record = _record.write_record(
        out, benchmark="x", config={"n": 1}, numbers={"tokens_per_s": 2.5}, device="test device"
    )
    assert json.loads(out.read_text()) == record
    assert set(record) == _record.COMMON_KEYS | {"tokens_per_s"}
    assert record["device"] == "test device"
    assert record["versions"]["python"] == platform.python_version()
    # the host it ran on: CPUs, quota, torch's threads and a probe of small host work (leases differ in it)
    host = record["host"]
    assert host["cpus"] >= 1 and host["torch_threads"] >= 1
    assert host["probe_us"]["repeat_interleave"] > 0 and host["probe_us"]["python_loop"] > 0
    with pytest.raises(ValueError, match="common keys"):
        _record.write_record(out, benchmark="x", config={}, numbers={"device": "clash"})


def test_the_loss_parity_table_in_the_docs_is_the_committed_json() -> None:
    import loss_parity_table

    data = json.loads((ROOT / "benchmarks" / "results" / "verl_loss_parity.json").read_text())
    assert data["verl"] == "0.9.1"
    assert loss_parity_table.table(data) in (ROOT / "docs" / "engine.md").read_text()


def test_gpu_timeline_splits_a_profile_into_idle_exposed_nccl_and_compute() -> None:
    """benchmarks/_common.gpu_timeline: the numbers the issue-36 profiles report, on a hand-made kernel list."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _common

    def kernel(name: str, start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [
        kernel("gemm", 0, 1000),
        kernel("ncclDevKernel_AllGather", 500, 1500),  # half hidden behind the GEMM, half exposed
        kernel("elementwise", 2000, 2500),  # 500 us of idle before it
        kernel("ncclDevKernel_ReduceScatter", 2600, 3000),  # exposed, after 100 us idle
        kernel("aten::mm", 0, 5000, device=DeviceType.CPU),  # host events are not kernels
    ]
    got = _common.gpu_timeline(events)
    want = {"window": 3.0, "idle": 0.6, "nccl": 1.4, "exposed_nccl": 0.9, "compute": 1.5}
    assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want), got
    assert _common.gpu_timeline([]) == {}


def test_idle_gaps_name_the_host_op_open_in_each_of_the_longest_gpu_idle_stretches() -> None:
    """benchmarks/_common.idle_gaps: longest first, at least min_ms, the host ops open at each gap's middle
    (outermost first), Python frames outside torch where the profile kept stacks."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _common

    def event(name: str, start: float, end: float, device: DeviceType, stack: list[str] | None = None):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end), stack=stack
        )

    gpu, cpu = DeviceType.CUDA, DeviceType.CPU
    events = [
        event("k1", 0, 1000, gpu),
        event("k2", 3000, 4000, gpu),  # 2 ms idle before it, while the host copies rows
        event("k3", 4000, 9000, gpu),  # back to back: no gap
        event("k4", 20000, 21000, gpu),  # 11 ms idle before it, the host between ops at its middle
        event("k5", 21300, 22000, gpu),  # 0.3 ms: below min_ms
        event("step", 0, 12000, cpu),
        event(
            "rows",
            1500,
            2600,
            cpu,
            ["/x/verl_engine/rl_batch.py(200): rows", "/y/site-packages/torch/a.py(1): f"],
        ),
    ]
    gaps = _common.idle_gaps(events, min_ms=0.5)
    assert gaps == [
        {"at_ms": 9.0, "ms": 11.0, "host": []},
        {
            "at_ms": 1.0,
            "ms": 2.0,
            "host": ["step", "rows"],
            "frames": ["/x/verl_engine/rl_batch.py(200): rows"],
        },
    ]
    assert _common.idle_gaps(events, top=1, min_ms=0.5) == gaps[:1]
    assert _common.idle_gaps([]) == []


def test_best_target_stores_the_best_record_of_one_device_and_commit(tmp_path: Path) -> None:
    """benchmarks/best_target.py: the best layout's number, with that record's device, commit and path; records
    from different machines or commits are refused (a comparison of layouts, not of leases)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import best_target

    def record(name: str, mfu: float, commit: str = "abc1234") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"device": "NVIDIA H200", "commit": commit, "date": "d", "mfu": mfu}))
        return path

    a, b = record("ddp.json", 0.57), record("fsdp.json", 0.45)
    targets = tmp_path / "targets.json"
    targets.write_text(json.dumps({"other": {"value": 1.0}}))
    assert (
        best_target.main(
            ["--key", "mfu_7b_4gpu", "--metric", "mfu", "--targets", str(targets), str(b), str(a)]
        )
        == 0
    )
    got = json.loads(targets.read_text())
    assert got["other"] == {"value": 1.0}
    assert got["mfu_7b_4gpu"]["value"] == 0.57 and got["mfu_7b_4gpu"]["source"].endswith("ddp.json")
    assert got["mfu_7b_4gpu"]["gpu"] == "NVIDIA H200" and got["mfu_7b_4gpu"]["commit"] == "abc1234"
    best_target.main(["--key", "m", "--metric", "mfu", "--lowest", "--targets", str(targets), str(a), str(b)])
    assert json.loads(targets.read_text())["m"]["value"] == 0.45
    c = record("other_commit.json", 0.6, commit="def5678")
    with pytest.raises(SystemExit, match="different devices or commits"):
        best_target.main(["--key", "k", "--metric", "mfu", "--targets", str(targets), str(a), str(c)])


def test_scaling_efficiency_compares_the_same_work_on_one_gpu_type(tmp_path: Path) -> None:
    """benchmarks/scaling_efficiency.py: per-GPU tokens/s of the run over the fastest one-GPU baseline, stored
    with the run's device and commit; a baseline of other work, another GPU type or several GPUs is refused by
    name (the ratio would compare settings or machines, not scaling)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import scaling_efficiency

    work = {
        "shape": "qwen2.5-1.5b",
        "seq": 4096,
        "seqs_per_replica": 16,
        "micro_batch": "m",
        "recompute": True,
    }

    def record(name: str, gpus: int, per_gpu: float, **change: object) -> Path:
        rec = {"device": "NVIDIA H200", "commit": "abc1234", "date": "d", "gpus": gpus, "config": dict(work)}
        rec["tokens_per_s_per_gpu"] = per_gpu
        for key, value in change.items():
            (rec["config"] if key in work else rec)[key] = value
        path = tmp_path / name
        path.write_text(json.dumps(rec))
        return path

    slow, fast, run = (
        record("a.json", 1, 30000.0),
        record("b.json", 1, 36000.0),
        record("dp4.json", 4, 35000.0),
    )
    targets, out = tmp_path / "targets.json", tmp_path / "eff.json"
    argv = ["--run", str(run), "--out", str(out), "--key", "dp4", "--targets", str(targets)]
    assert scaling_efficiency.main(["--baseline", str(slow), "--baseline", str(fast), *argv]) == 0
    got = json.loads(targets.read_text())["dp4"]
    assert (
        abs(got["value"] - 35000 / 36000) < 1e-12
        and got["commit"] == "abc1234"
        and got["gpu"] == "NVIDIA H200"
    )
    rec = json.loads(out.read_text())
    assert rec["baseline_used"] == str(fast) and set(rec["baseline_tokens_per_s_per_gpu"]) == {
        str(slow),
        str(fast),
    }
    for bad, match in (
        (record("c.json", 1, 1.0, recompute=False), "config recompute"),
        (record("d.json", 1, 1.0, device="NVIDIA H100 80GB HBM3"), "device"),
        (record("e.json", 2, 1.0), "ran on 2 GPUs"),
    ):
        with pytest.raises(SystemExit, match=match):
            scaling_efficiency.main(["--baseline", str(bad), *argv])


def test_loss_curves_agree_within_a_measured_bf16_band(tmp_path: Path) -> None:
    """benchmarks/loss_curves.py: the run agrees when its largest relative difference from the reference is within
    2 x that of the reference re-run with another gradient-reduction precision; exit 1 when it is not; curves of
    a fixed batch, other work or another length are refused by name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import loss_curves

    def record(name: str, losses: list[float], **config: object) -> Path:
        base = {"shape": "s", "seq": 4096, "batch": "a new batch every step (seed = step)"}
        rec = {"device": "NVIDIA H200", "commit": "abc1234", "date": "d", "config": {**base, **config}}
        rec["losses"] = losses
        path = tmp_path / name
        path.write_text(json.dumps(rec))
        return path

    ref = record("ref.json", [1.0, 0.9, 0.8])
    noise = record("noise.json", [1.0, 0.901, 0.798])  # band 2.5e-3
    out = tmp_path / "out.json"

    def check(run: Path) -> int:
        argv = ["--reference", str(ref), "--noise", str(noise), "--run", str(run), "--out", str(out)]
        return loss_curves.main(argv)

    assert check(record("good.json", [1.0, 0.903, 0.796])) == 0  # 5e-3 <= 2 x 2.5e-3
    got = json.loads(out.read_text())
    assert got["agree_within_noise"] is True and abs(got["noise_band"] - 2.5e-3) < 1e-12
    assert check(record("bad.json", [1.0, 0.9, 0.79])) == 1  # 1.25e-2
    assert json.loads(out.read_text())["agree_within_noise"] is False
    for bad, match in (
        (record("fixed.json", [1.0, 0.9, 0.8], batch="the same batch every step"), "same batch every step"),
        (record("other.json", [1.0, 0.9, 0.8], seq=2048), "config seq"),
        (record("short.json", [1.0, 0.9]), "2 steps"),
    ):
        with pytest.raises(SystemExit, match=match):
            check(bad)


def test_the_memory_peak_is_replayed_from_the_allocator_trace_and_charged_to_our_frames() -> None:
    """``BENCH_PROFILE_KIND=memory``: the highest total of live blocks, and who holds them then, in torch's
    snapshot format. A block freed before the peak is not charged; one freed after it is; ``free_requested``
    alone does not free (the stream may still use the memory)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _memory_peak import peak_composition

    gather = [
        {"filename": "torch/distributed/c10d.py", "line": 1, "name": "all_gather"},
        {"filename": "site-packages/megatron/core/distributed/fsdp/x.py", "line": 7, "name": "gather"},
    ]
    logits = [{"filename": "site-packages/verl_engine/head.py", "line": 3, "name": "logits"}]
    gib = 1 << 30
    trace = [
        {"action": "alloc", "addr": 1, "size": 2 * gib, "frames": gather},
        {"action": "alloc", "addr": 2, "size": gib, "frames": logits},
        {"action": "free_requested", "addr": 2, "size": gib},
        {
            "action": "alloc",
            "addr": 3,
            "size": gib,
            "frames": gather,
        },  # the peak: 4 GiB, addr 2 not yet freed
        {"action": "free_completed", "addr": 2, "size": gib},
        {"action": "free_completed", "addr": 1, "size": 2 * gib},
        {"action": "alloc", "addr": 4, "size": gib, "frames": logits},
    ]
    got = peak_composition({"device_traces": [[], trace]}, device=1)
    assert got["peak_gib"] == 4.0 and got["events"] == 7
    assert got["sites"] == [
        {"gib": 3.0, "blocks": 2, "site": "megatron/core/distributed/fsdp/x.py:7 gather"},
        {"gib": 1.0, "blocks": 1, "site": "verl_engine/head.py:3 logits"},
    ]


def test_the_targets_table_in_the_docs_is_the_committed_targets_json() -> None:
    import targets_table

    targets = json.loads(targets_table.TARGETS.read_text())
    assert targets_table.table(targets) in (ROOT / "docs" / "benchmarks.md").read_text()
    assert (
        targets_table.met(0.95, ">= 0.9 (tokens/s)") == "yes"
        and targets_table.met(0.88, "<= 0.6 (memory)") == "no"
    )
    assert targets_table.met(1.9, "measured bound over static CP 4") == "-"


def test_the_dynamic_cp_goal_is_met_only_within_reach_of_the_ideal_bound() -> None:
    """Issue 36: >= 1.3x and within 10% of the measured bound; 95% of the bound where the bound is below 1.3x."""
    import targets_table

    goal = ">= 1.3x over static CP 4 and within 10% of the ideal bound (95% of it if the bound < 1.3x)"
    assert targets_table.met(1.436, goal, ideal_bound=2.419) == "no"  # 1.436 < 0.9 x 2.419
    assert targets_table.met(2.2, goal, ideal_bound=2.419) == "yes"
    assert targets_table.met(1.25, goal, ideal_bound=1.8) == "no"  # within 10% of neither
    assert targets_table.met(1.15, goal, ideal_bound=1.2) == "yes"  # bound < 1.3: 95% of it
    assert targets_table.met(1.1, goal, ideal_bound=1.2) == "no"
    assert targets_table.met(1.5, goal) == "?"


def test_the_targets_table_is_rewritten_in_place(tmp_path: Path) -> None:
    import targets_table

    targets = tmp_path / "targets.json"
    one = {
        "value": 0.5,
        "goal": "<= 0.6 (x)",
        "gpu": "G",
        "commit": "abc",
        "source": "benchmarks/results/r.json",
    }
    targets.write_text(json.dumps({"k": one}))
    doc = tmp_path / "doc.md"
    doc.write_text(f"# T\n\n{targets_table._HEADER}\n|---|\n| `old` | 1 |\n\nAfter.\n")
    targets_table.write(doc, targets)
    assert doc.read_text() == f"# T\n\n{targets_table.table(json.loads(targets.read_text()))}\n\nAfter.\n"
    assert "| `k` | 0.500 | <= 0.6 (x) | yes | G | abc | `r.json` |" in doc.read_text()


def test_both_dynamic_cp_bounds_check_their_one_gpu_record_and_scale_its_median(tmp_path: Path) -> None:
    """benchmarks/dyncp_longtail.py: the ideal bound (one GPU at the pool budget) and the same-budget bound (one GPU
    at the per-rank budget) are the one-GPU record's fastest median (eager or graphed) x ranks over static CP 4's
    median, and a record of other batches or another budget is refused by name."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dyncp_longtail

    lengths = {"per_step_count": [22, 20, 8]}

    def record(name: str, tokens_per_rank: int, repeats: dict[str, list[float]], gpus: int = 1) -> Path:
        path = tmp_path / name
        config = {"tokens_per_rank": tokens_per_rank, "lengths": lengths}
        path.write_text(json.dumps({"gpus": gpus, "config": config, "repeats": repeats}))
        return path

    ideal = record("ideal.json", 8192, {"none": [60.0, 64.0, 70.0]})
    budget = record("budget.json", 2048, {"none": [20.0, 22.0], "none+graph": [30.0, 34.0]})
    args = argparse.Namespace(ideal_from=ideal, budget_bound_from=budget, tokens_per_rank=2048)
    medians = {"static4": 100.0}
    got = dyncp_longtail.ideal_bound(args, lengths, medians, ranks=4)
    assert got["ideal_tokens_per_s"] == 256.0 and got["ideal_bound_speedup_vs_static4"] == 2.56
    args.ideal_from = record("ideal2.json", 8192, {"none": [60.0, 64.0], "none+graph": [90.0, 80.0]})
    got = dyncp_longtail.ideal_bound(args, lengths, medians, ranks=4)  # the fastest way one GPU runs them
    assert got["one_gpu_layout"] == "none+graph" and got["ideal_bound_speedup_vs_static4"] == 3.4
    got = dyncp_longtail.same_budget_bound(args, lengths, medians, ranks=4)
    assert got["one_gpu_layout"] == "none+graph" and got["bound_tokens_per_s"] == 128.0
    assert got["bound_speedup_vs_static4"] == 1.28
    assert dyncp_longtail.same_budget_bound(args, lengths, {}, ranks=4)["bound_speedup_vs_static4"] is None
    wrong_budget = argparse.Namespace(ideal_from=budget, tokens_per_rank=2048)
    with pytest.raises(
        SystemExit, match=r"--ideal-from .* cut other micro-batches \(tokens_per_rank 2048, 8192"
    ):
        dyncp_longtail.ideal_bound(wrong_budget, lengths, medians, ranks=4)
    args.budget_bound_from = record("two.json", 2048, {"none": [1.0]}, gpus=2)
    with pytest.raises(SystemExit, match="--budget-bound-from .* is not a one-GPU run of these batches"):
        dyncp_longtail.same_budget_bound(args, lengths, medians, ranks=4)


def test_dyncp_speedups_are_over_the_fastest_static_cp_4_layout_measured(tmp_path: Path) -> None:
    """A graphed dynamic layout is judged against static CP 4 with graphs too when that one runs faster."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dyncp_longtail

    assert dyncp_longtail.baseline({"dynamic": 150.0, "none": 300.0}) is None
    assert dyncp_longtail.baseline({"static4": 100.0, "dynamic+graph": 150.0}) == ("static4", 100.0)
    medians = {"static4": 100.0, "static4+graph": 125.0, "static4+te+graph1": 110.0, "dynamic+graph": 150.0}
    assert dyncp_longtail.baseline(medians) == ("static4+graph", 125.0)
    lengths = {"per_step_count": [3]}
    ideal = tmp_path / "ideal.json"
    config = {"tokens_per_rank": 8192, "lengths": lengths}
    ideal.write_text(json.dumps({"gpus": 1, "config": config, "repeats": {"none+graph": [50.0]}}))
    args = argparse.Namespace(ideal_from=ideal, tokens_per_rank=2048)
    assert (
        dyncp_longtail.ideal_bound(args, lengths, medians, ranks=4)["ideal_bound_speedup_vs_static4"] == 1.6
    )


def test_dyncp_records_are_written_after_every_turn_and_targets_only_after_the_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run cut by a device command's time limit keeps its finished turns; a target from fewer repeats than
    asked is never written (the last turn is where --targets checks what it needs)."""
    import argparse

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import dyncp_longtail

    monkeypatch.setattr(dyncp_longtail.dist, "get_world_size", lambda: 4)
    out = tmp_path / "r.json"
    args = argparse.Namespace(
        out=str(out), device="cpu", median=64.0, sigma=0.5, min_len=16, max_len=128, ideal_from=None,
        budget_bound_from=None, tokens_per_rank=256, targets=True, target_layout="dynamic", repeats=3,
    )  # fmt: skip
    results = {"static4": {"tokens_per_s": 100.0}, "dynamic": {"tokens_per_s": 150.0}}
    repeats = {"static4": [100.0], "dynamic": [150.0]}
    lengths = dyncp_longtail.lengths_summary(args, [[20, 30], [40]])
    dyncp_longtail.write_results(args, lengths, results, repeats, turns=1)  # no --ideal-from: no target
    record = json.loads(out.read_text())
    assert record["turns_completed"] == 1 and record["baseline_layout"] == "static4"
    assert record["speedup_vs_static4_median"]["dynamic"] == 1.5
    with pytest.raises(
        SystemExit, match="--targets needs a static4 layout, the dynamic layout and --ideal-from"
    ):
        dyncp_longtail.write_results(args, lengths, results, repeats, turns=3)


def test_dyncp_layout_names_carry_the_attention_backend_and_which_decoder_graphs() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from dyncp_longtail import layout_options

    assert layout_options("static4") == ("static4", "auto", None)
    assert layout_options("dynamic+graph") == ("dynamic", "auto", "graph")  # every CP size
    assert layout_options("dynamic+te+graph1") == ("dynamic", "te", "graph1")  # CP 1 only
    with pytest.raises(SystemExit, match="at most one attention backend and one of"):
        layout_options("dynamic+graph+graph1")
