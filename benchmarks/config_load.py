"""Time loading + validating the full ppo_trainer config (target: under 100 ms).

Measures, in a fresh process: the import of verl_config, the first load of a process with an empty
tree cache (builds the typed default tree, ~once per install), the first load of a process whose
tree cache is on disk (every later launch), and the median / p90 of repeated loads, for both engines
with a realistic command line (about 25 overrides, like verl's example scripts). Writes JSON under
benchmarks/results/.

    uv run python benchmarks/config_load.py --out benchmarks/results/config_load_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from _record import results_path, write_record

COMMON = [
    "data.train_batch_size=512",
    "data.max_prompt_length=1024",
    "data.max_response_length=2048",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "actor_rollout_ref.actor.ppo_mini_batch_size=128",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.model.lora.rank=32",
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=false",
    "trainer.logger=[console,wandb]",
    "trainer.project_name=bench",
    "trainer.experiment_name=qwen7b",
    "trainer.n_gpus_per_node=8",
    "trainer.nnodes=2",
    "trainer.save_freq=20",
    "trainer.test_freq=5",
    "trainer.total_epochs=15",
]
ENGINE = {
    "fsdp": ["model_engine=fsdp", "actor_rollout_ref.actor.fsdp_config.param_offload=true"],
    "megatron": [
        "model_engine=megatron",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=1",
        "actor_rollout_ref.actor.megatron.override_ddp_config.bucket_size=50000000",
    ],
}


def _load_ms_in_new_process(overrides: list[str]) -> float:
    """load_config's time in a fresh interpreter (after its import), which finds the disk cache of this run."""
    code = (
        "import json, sys, time, verl_config; t0 = time.perf_counter();"
        " verl_config.load_config('ppo_trainer', overrides=json.loads(sys.argv[1]));"
        " print((time.perf_counter() - t0) * 1e3)"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, json.dumps(overrides)],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ.copy(),
    )
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=results_path("config_load_cpu.json"))
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    os.environ["VERL_CONFIG_CACHE_DIR"] = tempfile.mkdtemp(prefix="verl-config-bench-")  # starts empty
    t0 = time.perf_counter()
    import verl_config

    import_ms = (time.perf_counter() - t0) * 1e3
    results = {}
    for engine, extra in ENGINE.items():
        overrides = [*COMMON, *extra]
        t0 = time.perf_counter()
        verl_config.load_config("ppo_trainer", overrides=overrides)
        cold = (time.perf_counter() - t0) * 1e3
        warm_process = _load_ms_in_new_process(
            overrides
        )  # the tree comes from the disk cache written just now
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            verl_config.load_config("ppo_trainer", overrides=overrides)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        results[engine] = {
            "overrides": len(overrides),
            "first_load_empty_cache_ms": round(cold, 2),
            "first_load_ms": round(warm_process, 2),
            "median_ms": round(statistics.median(times), 2),
            "p90_ms": round(times[int(0.9 * (len(times) - 1))], 2),
            "max_ms": round(times[-1], 2),
        }
    record = write_record(
        args.out,
        benchmark="config_load",
        config={"repeat": args.repeat},
        extra_versions=("omegaconf",),
        numbers={
            "what": "verl_config.load_config('ppo_trainer', overrides=...) = compose + parse + merge + resolve + build + validate",
            "target_ms": 100,
            "import_ms": round(import_ms, 2),
            "repeat": args.repeat,
            "results": results,
        },
    )
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
