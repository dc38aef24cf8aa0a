"""Ray launch of RL engines: one actor per rank in a placement group (``pip install 'verl-engine[ray]'``).

:class:`RayWorkerGroup` reserves one bundle per rank (CPUs, GPUs) in a placement group, starts an
:class:`EngineWorker` actor in each, gives every actor the launcher environment torchrun would give it
(``MASTER_ADDR`` / ``MASTER_PORT`` of rank 0's node, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` /
``LOCAL_WORLD_SIZE`` per node), and initialises torch.distributed there. Engines of several roles (actor,
reference, critic) are built in the same actors, so colocated roles share the bundles and process groups.

Dispatch follows the engine's contract (``get_data_parallel_size()`` is 1): each call sends the step's whole
batch to every rank (one ``ray.put``) and returns the result of the rank that owns the outputs
(``is_mp_src_rank_with_outputs``, rank 0); every rank computes the same outputs.

Failure: a call waits for all ranks with a deadline. When an actor dies (its process is killed, its node is
lost) the others may be blocked in a collective forever; the group then kills every actor and raises
:class:`WorkerGroupError` naming the dead rank and its node, instead of hanging. A rank that raises gets its
traceback reported the same way. torchrun remains supported: the engine itself does not depend on Ray.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["EngineWorker", "RayWorkerGroup", "WorkerGroupError"]


class WorkerGroupError(RuntimeError):
    """A rank of a Ray worker group died, raised, or missed the deadline; the group has been shut down."""


class EngineWorker:
    """One rank: its launcher environment, its process group, and the engines of its roles.

    A plain class turned into a Ray actor by :class:`RayWorkerGroup` (so it is importable without Ray).
    """

    def __init__(self) -> None:
        self.engines: dict[str, Any] = {}
        self.configs: dict[str, Any] = {}
        self.rank = -1

    def node_and_port(self) -> tuple[str, str, int]:
        """(node id, address, a free TCP port on it): what rank 0 offers as MASTER_ADDR / MASTER_PORT."""
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), port

    def setup(self, *, env: dict[str, str], backend: str, timeout_s: int) -> int:
        """Set the launcher environment and initialise torch.distributed (gloo on CPU, NCCL on GPUs)."""
        import datetime

        import torch
        import torch.distributed as dist

        os.environ.update(env)
        self.rank = int(env["RANK"])
        if backend == "nccl":
            torch.cuda.set_device(int(env["LOCAL_RANK"]) if torch.cuda.device_count() > 1 else 0)
        dist.init_process_group(
            backend=backend,
            rank=self.rank,
            world_size=int(env["WORLD_SIZE"]),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        return self.rank

    def build(
        self,
        *,
        role: str,
        overrides: Sequence[str],
        device: str,
        hf_config: dict[str, Any] | None = None,
    ) -> None:
        """Load the unified config from verl override strings and build ``role``'s engine in this process.

        ``hf_config``: a ``config.json`` content to build a randomly initialised model from (no ``model.path``).
        """
        import torch
        from megatron.core import parallel_state

        from verl_config import load_config
        from verl_engine.build import rl_engine_from_config
        from verl_mcore_utils.parallel import init_parallel

        cfg = load_config(overrides=list(overrides))
        section = {
            "actor": cfg.actor_rollout_ref.actor,
            "ref": cfg.actor_rollout_ref.ref,
            "critic": cfg.critic,
        }[role]
        if not parallel_state.model_parallel_is_initialized():
            m = section.megatron
            init_parallel(
                tensor_model_parallel_size=m.tensor_model_parallel_size,
                pipeline_model_parallel_size=m.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
                expert_model_parallel_size=m.expert_model_parallel_size,
                expert_tensor_parallel_size=m.expert_tensor_parallel_size,
                device=device,
            )
        dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        self.engines[role] = rl_engine_from_config(cfg, role=role, device=dev, hf_config=hf_config)
        self.configs[role] = cfg

    def drop(self, role: str) -> None:
        """Release ``role``'s engine (its parameters, gradients, optimizer state and CP groups): ``close()``."""
        engine = self.engines.pop(role, None)
        self.configs.pop(role, None)
        if engine is not None:
            engine.close()

    def export_weights(self, role: str) -> list[tuple[str, Any]] | None:
        """``role``'s Hugging Face weights as a list of (name, CPU tensor) on the rank with outputs, else None.

        Every rank takes part (the gathers over TP / PP / FSDP are collectives); what crosses a process
        boundary (Ray) has to be a materialised list, not the engine's generator.
        """
        engine = self.engines[role]
        weights, _ = engine.get_per_tensor_param()
        keep = engine.is_mp_src_rank_with_outputs()
        out = [(name, tensor.detach().to("cpu", copy=True)) for name, tensor in weights]
        return out if keep else None

    def call(self, role: str, method: str, data: Any = None, loss: str | None = None, **kwargs: Any) -> Any:
        """``engine.<method>(data, loss_fn, ...)`` in the mode it needs; ``loss`` names a verl loss.

        Returns the result on the rank with outputs, None on the others (what Ray sends back).
        """
        out = self.call_local(role, method, data, loss=loss, **kwargs)
        return out if self.engines[role].is_mp_src_rank_with_outputs() else None

    def call_local(
        self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kwargs: Any
    ) -> Any:
        """:meth:`call` returning this rank's result on every rank (in-process use under torchrun)."""
        from functools import partial

        from verl_engine import losses
        from verl_engine.loss_binding import loss_config

        engine = self.engines[role]
        if method in ("train_batch", "forward_backward_batch"):
            section = loss_config(self.configs[role], role=role)
            fns: dict[str, Callable[..., Any]] = {
                "ppo": losses.ppo_loss,
                "value": losses.value_loss,
                "sft": losses.sft_loss,
            }
            fn = fns[loss or "ppo"]
            with engine.train_mode():
                out = getattr(engine, method)(data, partial(fn, config=section), **kwargs)
        elif method == "infer_batch":
            with engine.eval_mode():
                out = engine.infer_batch(data, **kwargs)
        else:
            out = getattr(engine, method)(*(() if data is None else (data,)), **kwargs)
        return out

    def barrier_after(self, seconds: float) -> int:
        """Sleep, then join a collective (tests use it to have a rank die while the others wait)."""
        import torch.distributed as dist

        time.sleep(seconds)
        dist.barrier()
        return self.rank

    def pid(self) -> int:
        return os.getpid()


class RayWorkerGroup:
    """``world_size`` ranks as Ray actors in one placement group (see the module docstring).

    ``strategy``: the placement group's (PACK, SPREAD, STRICT_PACK, STRICT_SPREAD). ``timeout_s``: the
    deadline of every call (and of the process groups' collectives).
    """

    def __init__(
        self,
        *,
        world_size: int,
        cpus_per_rank: float = 1,
        gpus_per_rank: float = 0,
        strategy: str = "PACK",
        timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not ray.is_initialized():
            raise RuntimeError("ray is not initialised: call ray.init(...) (or connect to a cluster) first")
        self.world_size = world_size
        self.timeout_s = timeout_s
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        self.placement_group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.placement_group)
            raise WorkerGroupError(
                f"the placement group of {world_size} bundles {bundle} ({strategy}) was not scheduled within"
                f" {timeout_s:.0f}s: the cluster has {ray.cluster_resources()}"
            ) from None
        actor = ray.remote(EngineWorker)
        runtime_env = {"env_vars": dict(env)} if env else None
        self.workers = [
            actor.options(
                num_cpus=cpus_per_rank,
                num_gpus=gpus_per_rank,
                runtime_env=runtime_env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement_group, placement_group_bundle_index=i
                ),
            ).remote()
            for i in range(world_size)
        ]
        places = self._wait([w.node_and_port.remote() for w in self.workers], what="start")
        self.nodes = [node for node, _, _ in places]
        _, master_addr, master_port = places[0]
        by_node: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            by_node.setdefault(node, []).append(rank)
        backend = "nccl" if gpus_per_rank else "gloo"
        envs = [
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_RANK": str(by_node[node].index(rank)),
                "LOCAL_WORLD_SIZE": str(len(by_node[node])),
            }
            for rank, node in enumerate(self.nodes)
        ]
        self._wait(
            [
                w.setup.remote(env=e, backend=backend, timeout_s=int(timeout_s))
                for w, e in zip(self.workers, envs, strict=True)
            ],
            what="torch.distributed initialisation",
        )

    # -------------------------------------------------------------------------------------------- calls
    def _wait(self, refs: list[Any], *, what: str) -> list[Any]:
        """Every rank's result, or WorkerGroupError as soon as one rank fails (then the group is shut down)."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(pending.values())
                self.shutdown()
                hint = (
                    " (the actors never started: Ray's raylet log says why; a driver run under `uv run` makes Ray"
                    " start its workers through `uv run` as well, which RAY_ENABLE_UV_RUN_RUNTIME_ENV=0 turns off)"
                    if what == "start"
                    else ""
                )
                raise WorkerGroupError(
                    f"{what}: ranks {ranks} did not finish within {self.timeout_s:.0f}s; the group was shut down{hint}"
                )
            done, _ = ray.wait(list(pending), num_returns=1, timeout=min(left, 1.0))
            for ref in done:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as err:
                    self.shutdown()
                    raise WorkerGroupError(
                        f"{what}: rank {rank} (node {self._node(rank)}) died: {type(err).__name__}; the other ranks"
                        " may have been blocked in a collective, so the whole group was shut down"
                    ) from err
                except ray.exceptions.RayTaskError as err:
                    self.shutdown()
                    raise WorkerGroupError(f"{what}: rank {rank} raised:\n{err}") from err
        return [results[r] for r in range(len(refs))]

    def _node(self, rank: int) -> str:
        nodes = getattr(self, "nodes", None)
        return nodes[rank] if nodes else "?"

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``EngineWorker.<method>(*args, **kwargs)`` on every rank; every rank's result."""
        return self._wait([getattr(w, method).remote(*args, **kwargs) for w in self.workers], what=method)

    def build(
        self,
        *,
        roles: Sequence[str],
        overrides: Sequence[str],
        device: str = "cpu",
        hf_config: dict[str, Any] | None = None,
    ) -> None:
        """Build every role's engine on every rank (colocated: the same actors and process groups)."""
        for role in roles:
            self.run("build", role=role, overrides=list(overrides), device=device, hf_config=hf_config)

    def call(
        self, role: str, method: str, data: Any = None, *, loss: str | None = None, **kwargs: Any
    ) -> Any:
        """One engine call with the whole batch on every rank (one object-store copy); rank 0's result."""
        import ray

        ref = ray.put(data) if data is not None else None
        results = self._wait(
            [w.call.remote(role, method, ref, loss=loss, **kwargs) for w in self.workers],
            what=f"{role}.{method}",
        )
        return results[0]

    def shutdown(self) -> None:
        """Kill every actor and free the placement group (safe to call twice)."""
        import ray

        for w in getattr(self, "workers", []):
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.workers = []
        pg = getattr(self, "placement_group", None)
        if pg is not None:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:
                pass
            self.placement_group = None
