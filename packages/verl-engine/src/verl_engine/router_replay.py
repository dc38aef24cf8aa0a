"""Router replay for mixture-of-experts models (verl 0.9.1's ``megatron.router_replay.mode``: R2 / R3).

The log-probs of the policy update must come from the same expert choices as the log-probs they are compared
with, or the importance ratio mixes two routings (the instability router replay exists to remove). verl 0.9.1:

* **R2**: the engine's own old-log-prob pass (``compute_log_prob``, forward only, no ``routed_experts`` in the
  batch) records every MoE layer's top-k experts per token and returns them as ``routed_experts``; the update
  (``update_actor``, the same key in its batch) replays them.
* **R3**: the rollout engine returned the routes (``rollout.enable_rollout_routing_replay``); every actor call
  replays the batch's ``routed_experts`` (the last token of each sequence keeps its own routing: the rollout
  has no route for the last generated token and its output is never used, verl's ``build_r3_replay_mask``).
* The reference policy never records or replays (verl's worker sets ``enable_routing_replay=False`` for it;
  a forward-only engine here has no replay at all).

``routed_experts`` (verl's key and layout): per token, per MoE layer, the ``top-k`` expert ids, in the
input's layout: jagged ``[B, (n_i), L, k]`` next to jagged ``input_ids``, or padded ``[B, S, L, k]`` aligned
with ``attention_mask`` (the rollout's layout before verl's ``left_right_2_no_padding``). ``L`` is the number
of MoE layers (or every layer, verl's R3 layout; the MoE layers are then picked by layer number). Recorded
routes come back int16, as verl's.

Replay is our own and works on megatron-core 0.14 to 0.19: each router's ``routing`` is wrapped per instance
and megatron-core's ``topk_routing_with_score_function`` (looked up in its router module) is replaced by a
function that, inside a wrapped router, records the experts the router chose, or takes the recorded experts
and computes their probabilities from the current logits exactly as the score function does (softmax over
all experts then gather, or softmax over the top-k logits; sigmoid normalised), so gradients still reach the
router weights. The experts stay the recorded ones through the backward's activation recompute: a
micro-batch's targets stay set until the next micro-batch sets its own. Every replaying forward counts the
routers that replayed and raises if one did not (verl #7340 / #7106: replay that silently did nothing).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from verl_engine.rl_batch import RLBatch, is_jagged, read_scalar
from verl_engine.router_replay_stages import decoder_routers, stage_problems

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

__all__ = [
    "ReplaySettings",
    "RouterReplayMixin",
    "decoder_routers",
    "install_router_replay",
    "refuse_router_replay_layout",
    "router_replay_settings",
]

KEY = "routed_experts"
_MODE = "megatron.router_replay.mode"


@dataclass(frozen=True)
class ReplaySettings:
    """Checked replay settings of a training engine: ``mode`` R2 or R3, the model's ``num_experts`` / ``topk``."""

    mode: str
    num_experts: int
    topk: int
    num_layers: int


def refuse_router_replay_layout(engine: Any, *, trains: bool) -> None:
    """The megatron section's replay refusals (files, layout), before any parallel state or model exists."""
    config, use_remove_padding = engine.router_replay, engine.use_remove_padding
    mode = getattr(config, "mode", "disabled")
    if mode == "disabled":
        return
    problems = [
        f"megatron.router_replay.{key}={getattr(config, key)!r}: verl 0.9.1 declares it but never reads it"
        " (routes travel in the batch as routed_experts); set it to null"
        for key in ("record_file", "replay_file")
        if getattr(config, key, None) is not None
    ]
    if trains and not use_remove_padding:
        problems.append(
            "megatron.use_remove_padding=false: replay follows the packed (THD) token order, as verl's"
        )
    if problems:
        raise NotImplementedError(f"{_MODE}={mode}: " + "; ".join(problems))


def router_replay_settings(config: Any, *, tf_config: Any, trains: bool) -> ReplaySettings | None:
    """The engine's replay settings from its ``megatron.router_replay`` section (None: no replay). Raises
    NotImplementedError naming every setting it cannot replay exactly, before any model is built (after
    :func:`refuse_router_replay_layout`)."""
    mode = getattr(config, "mode", "disabled")
    if mode == "disabled":
        return None
    experts = getattr(tf_config, "num_moe_experts", None)
    if not experts:
        raise NotImplementedError(
            f"{_MODE}={mode} needs a mixture-of-experts model; this one is dense (no experts to route): set"
            f" {_MODE}=disabled"
        )
    if not trains:  # the reference policy / forward-only engines: verl never replays there either
        return None
    c = tf_config
    fusion, native = getattr(c, "moe_router_fusion", False), getattr(c, "moe_enable_routing_replay", False)
    balancing = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")
    checks = {
        "moe_router_fusion": (
            fusion,
            not fusion,
            "the fused router has no replay hook (verl refuses it too)",
        ),
        "moe_router_load_balancing_type": (
            c.moe_router_load_balancing_type,
            c.moe_router_load_balancing_type in balancing,
            "only top-k routing is replayed",
        ),
        "moe_router_score_function": (
            c.moe_router_score_function,
            c.moe_router_score_function in ("softmax", "sigmoid"),
            "only softmax and sigmoid scores are replayed",
        ),
        "moe_expert_capacity_factor": (
            c.moe_expert_capacity_factor,
            c.moe_expert_capacity_factor is None,
            "token dropping would drop replayed routes",
        ),
        "moe_enable_routing_replay": (
            native,
            not native,
            "megatron-core's own replay would run beside the engine's",
        ),
    }
    problems = [f"{k}={v}: {why}" for k, (v, ok, why) in checks.items() if not ok] + stage_problems(c)
    if problems:
        raise NotImplementedError(f"{_MODE}={mode}: " + "; ".join(problems))
    return ReplaySettings(
        mode=mode, num_experts=int(experts), topk=int(c.moe_router_topk), num_layers=c.num_layers
    )


# ---------------------------------------------------------------------------------------------- the routers
@dataclass
class _RouterState:
    """One router's replay state: ``action`` None (native), "record" or "replay"."""

    layer_number: int
    chunk: int = 0  # the model chunk (virtual pipeline stage) holding the router
    column: int = 0  # the router's MoE layer among all stages' (its column in routed_experts)
    action: str | None = None
    targets: torch.Tensor | None = None  # [local tokens, k] int64
    mask: torch.Tensor | None = None  # [local tokens] bool: replay here, native elsewhere
    recorded: list[torch.Tensor] = field(default_factory=list)
    replayed: int = 0
    seen: list[torch.Tensor] = field(default_factory=list)  # experts used per replayed call (tests)


_CURRENT: list[_RouterState] = []  # the state of the router whose routing runs now (at most one)
_ORIGINAL: dict[str, Any] = {}


def _patch_router_module() -> None:
    """Route megatron-core's router module's ``topk_routing_with_score_function`` through :func:`_topk_routing`
    (once; outside a wrapped router it is the original)."""
    from megatron.core.transformer.moe import router as router_module

    if "topk" not in _ORIGINAL:
        _ORIGINAL["topk"] = router_module.topk_routing_with_score_function
        router_module.topk_routing_with_score_function = _topk_routing


def _topk_routing(logits: torch.Tensor, topk: int, *args: Any, **kwargs: Any) -> Any:
    original = _ORIGINAL["topk"]
    state = _CURRENT[-1] if _CURRENT else None
    if state is None or state.action is None:
        return original(logits, topk, *args, **kwargs)
    if state.action == "record":
        probs, routing_map = original(logits, topk, *args, **kwargs)
        # the chosen experts, highest probability first (each row has exactly top-k: no token dropping here)
        chosen = probs.detach().float().masked_fill(~routing_map, float("-inf")).topk(topk, dim=1).indices
        state.recorded.append(chosen)
        return probs, routing_map
    if args:  # megatron-core 0.14-0.19 pass everything after topk by keyword; another release must be checked
        raise RuntimeError(
            "router replay: this megatron-core passes the routing settings positionally; the replay hook reads"
            " them by keyword (checked on 0.14 to 0.19)"
        )
    return _replayed_routing(logits, topk, state=state, **kwargs)


def _replayed_routing(
    logits: torch.Tensor, topk: int, *, state: _RouterState, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core's top-k routing with the recorded experts (score functions as its moe_utils).

    Only the choice of experts is replayed: the weights are the current scores at those experts (softmax over
    them, or sigmoid normalised over them), so the router keeps its gradient. What only steers the choice
    (DeepSeek-V3 / GLM-4.5's expert bias and group limit) has nothing to do where the choice is given; tokens
    without routes (``mask`` False) take megatron-core's own choice, with every routing setting.
    """
    targets, mask = state.targets, state.mask
    if targets is None or mask is None or targets.shape != (logits.shape[0], topk):
        raise RuntimeError(
            f"router replay: layer {state.layer_number} routes {logits.shape[0]} tokens but was given targets of"
            f" shape {None if targets is None else tuple(targets.shape)}: the routes do not line up with the tokens"
        )
    use_pre_softmax = kwargs.get("use_pre_softmax", False)
    scaling_factor = kwargs.get("scaling_factor")
    score_function = kwargs.get("score_function", "softmax")
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32) if use_pre_softmax else logits
    else:
        scores = torch.sigmoid(logits.float())
    with torch.no_grad():  # computed for every token: testing the mask first would be a host sync
        own_probs, own_map = _ORIGINAL["topk"](logits.detach(), topk, **kwargs)
        native = own_probs.float().masked_fill(~own_map, float("-inf")).topk(topk, dim=1).indices
    indices = torch.where(mask[:, None], targets, native)
    picked = scores.gather(1, indices)
    if score_function == "softmax":
        probs = picked if use_pre_softmax else torch.softmax(picked, dim=-1, dtype=torch.float32)
    else:
        probs = picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) if topk > 1 else picked
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.int32).scatter(1, indices, 1).bool()
    state.replayed += 1
    if _KEEP_SEEN[0]:
        state.seen.append(indices.detach().clone())
    return routing_probs, routing_map


_KEEP_SEEN = [False]  # tests: keep the experts every replayed routing used (RouterReplay.seen_routes)


def keep_seen(on: bool) -> None:
    """Tests: keep (or stop keeping) the experts every replayed routing uses."""
    _KEEP_SEEN[0] = on


def _wrap_router(router: TopKRouter, state: _RouterState) -> None:
    """Make ``router.routing`` run with ``state`` current (per instance: the class is untouched)."""
    routing = type(router).routing

    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        _CURRENT.append(state)
        try:
            return routing(self, *args, **kwargs)
        finally:
            _CURRENT.pop()

    router.routing = types.MethodType(wrapped, router)


class RouterReplay:
    """The replay machinery of one engine: its routers' states and the settings."""

    def __init__(
        self,
        settings: ReplaySettings,
        routers: Sequence[tuple[int, TopKRouter]],
        *,
        pipeline_group: Any = None,
    ) -> None:
        """``routers``: (model chunk, router) of this rank; ``pipeline_group``: the stages (None: one stage)."""
        from verl_engine.router_replay_stages import moe_layer_ordinals

        numbers = [int(r.layer_number or i + 1) for i, (_, r) in enumerate(routers)]
        columns, self.total = moe_layer_ordinals(numbers, group=pipeline_group)
        if not self.total:
            raise NotImplementedError(f"{_MODE}={settings.mode}: the model has no top-k routers to replay")
        _patch_router_module()
        self.settings, self.pipeline_group = settings, pipeline_group
        self.sp = bool(getattr(routers[0][1].config, "sequence_parallel", False))  # routers see a TP shard
        self.states = [
            _RouterState(layer_number=n, chunk=c, column=col)
            for n, (c, _), col in zip(numbers, routers, columns, strict=True)
        ]
        for (_, router), state in zip(routers, self.states, strict=True):
            _wrap_router(router, state)

    def set_action(self, action: str | None) -> None:
        """Every router's action for the call (``seen`` is kept after the call, for tests)."""
        for s in self.states:
            s.action, s.targets, s.mask, s.replayed = action, None, None, 0
            s.recorded.clear()
            if action is not None:
                s.seen.clear()

    def seen_routes(self) -> list[list[torch.Tensor]]:
        """Per router, the experts each replayed routing of the last call used (with ``keep_seen(True)``)."""
        return [list(s.seen) for s in self.states]

    def layer_rows(self, width: int) -> list[int]:
        """Which slice of the routes' layer dim each router reads (MoE ordinal, or layer number - 1 when the
        routes hold every layer)."""
        if width == self.total:
            return [s.column for s in self.states]
        if width == self.settings.num_layers:
            return [s.layer_number - 1 for s in self.states]
        raise ValueError(
            f"{KEY} holds {width} layers; the model has {self.total} MoE layers of {self.settings.num_layers}"
        )


def install_router_replay(engine: Any, settings: ReplaySettings | None) -> Any:
    """Give a built engine its router replay (None: none). Returns the engine."""
    if settings is not None:
        routers = [(c, r) for c, chunk in enumerate(engine.chunks) for r in decoder_routers([chunk])]
        group = engine.pipeline.group if engine.pipeline.size > 1 else None
        engine.router_replay = RouterReplay(settings, routers, pipeline_group=group)
    return engine


# ---------------------------------------------------------------------------------------------- the engine
@dataclass
class _CallRoutes:
    """One call's routes: ``action`` "record" / "replay" / None, packed ``routes`` [T, L, k] and ``mask`` [T]."""

    action: str | None
    batch: RLBatch | None = None
    routes: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    rows: list[int] = field(default_factory=list)
    per_layer: dict[int, list[Any]] = field(default_factory=dict)  # recorded: column -> per sequence [n, k]
    replay: Any = None

    def attach(self, out: dict[str, Any]) -> dict[str, Any]:
        if self.action == "record" and self.batch is not None and "model_output" in out:
            from verl_engine.router_replay_stages import join_stage_routes

            r = self.replay
            per_seq = join_stage_routes(
                self.per_layer, total=r.total, size=self.batch.size, group=r.pipeline_group
            )
            out["model_output"][KEY] = self.batch.to_input_layout(per_seq)
        return out


class RouterReplayMixin:
    """Mixin of :class:`~verl_engine.engine.RLEngine`: replay / record around each micro-batch's forward."""

    router_replay: RouterReplay | None = None
    _call_routes: _CallRoutes | None = None

    @contextlib.contextmanager
    def route_replay_call(
        self, data: Mapping[str, Any], batch: RLBatch, *, forward_only: bool
    ) -> Iterator[_CallRoutes]:
        """The call's record / replay (see the module doc); states cleared on exit."""
        replay = self.router_replay
        routes = _CallRoutes(action=None)
        if replay is not None and bool(read_scalar(data, "enable_routing_replay", True)):
            routes = _call_routes(replay, data, batch, forward_only=forward_only)
        self._call_routes = routes
        replay_set = replay.set_action if replay is not None else (lambda _a: None)
        try:
            replay_set(routes.action)
            yield routes
        finally:
            replay_set(None)
            self._call_routes = None

    def _stage_forward(self, model: torch.nn.Module, mb: Any, *, packed: Any) -> torch.Tensor:
        routes, replay = self._call_routes, self.router_replay
        if routes is None or routes.action is None or replay is None:
            return super()._stage_forward(model, mb, packed=packed)  # type: ignore[misc]
        from verl_engine.router_replay_stages import chunk_of

        chunk = chunk_of(self.chunks, model)  # type: ignore[attr-defined]
        states = [s for s in replay.states if s.chunk == chunk]
        if routes.action == "replay":
            _set_targets(replay, routes, mb)
        for s in states:
            s.replayed = 0
            s.recorded.clear()
        out = super()._stage_forward(model, mb, packed=packed)  # type: ignore[misc]
        if routes.action == "replay":
            missed = [s.layer_number for s in states if s.replayed == 0]
            if missed:
                raise RuntimeError(
                    f"router replay ({replay.settings.mode}): the routers of layers {missed} did not replay in this"
                    " forward; their routing would be the model's own"
                )
        elif states:
            self._keep_routes(states, routes, mb)
        return out

    def _keep_routes(self, states: list[_RouterState], routes: _CallRoutes, mb: Any) -> None:
        from verl_dyncp.planner import dynamic_cp_merge_output
        from verl_engine.sp_routes import sp_gather_rows

        missing = [s.layer_number for s in states if len(s.recorded) != 1]
        if missing:
            raise RuntimeError(f"router replay (record): layers {missing} did not route exactly once")
        local = torch.stack([s.recorded[0] for s in states], dim=1)  # [local tokens, L of this chunk, k]
        # SP: the TP shards back to the sequence (router_replay is set: _stage_forward checked it)
        local = sp_gather_rows(local, on=self.router_replay.sp)  # type: ignore[union-attr]
        merged = dynamic_cp_merge_output(local, micro_batch=mb.split, groups=self.cp_groups)  # type: ignore[attr-defined]
        assert routes.batch is not None
        offset = 0
        for i in mb.indices:
            n = routes.batch.packed.seq_lens[i]
            for j, s in enumerate(states):
                column = routes.per_layer.setdefault(s.column, [None] * routes.batch.size)
                column[i] = merged[offset : offset + n, j].to(torch.int16).cpu()
            offset += n


def _set_targets(replay: RouterReplay, routes: _CallRoutes, mb: Any) -> None:
    """Every router's targets for this rank's share of micro-batch ``mb``, in the model's token order
    (verl-dyncp's ``dynamic_cp_take``: the same rows the model's input and labels come from). An idle group's
    dummy sequence and THD padding keep their own routing (mask False): nothing of them is kept."""
    from verl_dyncp.planner import dynamic_cp_take
    from verl_engine.sp_routes import sp_shard_rows

    assert routes.routes is not None and routes.mask is not None and routes.batch is not None
    cu = routes.batch.packed.cu_seqlens
    index = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in mb.indices])
    split = mb.split
    local = dynamic_cp_take(routes.routes.index_select(0, index), micro_batch=split, pad_value=0)
    mask = dynamic_cp_take(routes.mask.index_select(0, index), micro_batch=split, pad_value=False)
    device = split.batch.input_ids.device
    local, mask = sp_shard_rows(local.to(device), on=replay.sp), sp_shard_rows(mask.to(device), on=replay.sp)
    for state, row in zip(replay.states, routes.rows, strict=True):
        state.targets, state.mask = local[:, row], mask


def _call_routes(
    replay: RouterReplay, data: Mapping[str, Any], batch: RLBatch, *, forward_only: bool
) -> _CallRoutes:
    mode = replay.settings.mode
    if mode == "R2" and forward_only and KEY not in data:
        return _CallRoutes(action="record", batch=batch, replay=replay)
    if KEY not in data or data[KEY] is None:
        how = (
            "R2 records them in the old-log-prob pass (compute_log_prob returns routed_experts): keep that key in"
            " the update's batch"
            if mode == "R2"
            else "R3 replays the rollout's routes: the rollout must return them"
            " (actor_rollout_ref.rollout.enable_rollout_routing_replay=true)"
        )
        raise ValueError(f"{_MODE}={mode}: the batch has no {KEY!r} to replay; {how}")
    routes, last = _packed_routes(data[KEY], batch, r3=mode == "R3")
    mask = torch.ones(routes.shape[0], dtype=torch.bool)
    if mode == "R3":  # verl's build_r3_replay_mask: the last token of each sequence keeps its own routing
        mask[last] = False
    _check_routes(routes, mask, replay.settings)
    return _CallRoutes(
        action="replay", batch=batch, routes=routes, mask=mask, rows=replay.layer_rows(routes.shape[1])
    )


def _packed_routes(value: Any, batch: RLBatch, *, r3: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``routed_experts`` as packed ``[T, L, k]`` int64 in the batch's token order, and each sequence's last slot."""
    lens = list(batch.packed.seq_lens)
    cu = batch.packed.cu_seqlens
    last = torch.tensor([int(cu[i + 1]) - 1 for i in range(len(lens))], dtype=torch.int64)
    if is_jagged(value):
        parts = list(value.unbind())
        if len(parts) != len(lens):
            raise ValueError(f"{KEY} holds {len(parts)} sequences for a batch of {len(lens)}")
        aligned = []
        for i, (part, n) in enumerate(zip(parts, lens, strict=True)):
            if r3 and part.shape[0] == n - 1:  # the rollout has no route for the last generated token
                part = torch.cat([part, part.new_zeros((1, *part.shape[1:]))])
            if part.dim() != 3 or part.shape[0] != n:
                raise ValueError(f"{KEY}[{i}] has shape {tuple(part.shape)}; expected [{n}, layers, top-k]")
            aligned.append(part)
        return torch.cat(aligned).to(torch.int64).cpu(), last
    if not isinstance(value, torch.Tensor) or value.dim() != 4 or value.shape[0] != batch.size:
        raise ValueError(
            f"{KEY} must be jagged [B, (n), layers, top-k] or padded [B, S, layers, top-k] like input_ids; got"
            f" {getattr(value, 'shape', type(value).__name__)}"
        )
    if value.shape[1] != batch.seq_cols:
        raise ValueError(
            f"{KEY} has {value.shape[1]} columns; input_ids / attention_mask have {batch.seq_cols}"
        )
    rows = [value[i, batch.left_pad[i] : batch.left_pad[i] + n] for i, n in enumerate(lens)]
    return torch.cat(rows).to(torch.int64).cpu(), last


def _check_routes(routes: torch.Tensor, mask: torch.Tensor, settings: ReplaySettings) -> None:
    if routes.shape[2] != settings.topk:
        raise ValueError(f"{KEY} holds top-{routes.shape[2]} experts; the model routes top-{settings.topk}")
    used = routes[mask]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= settings.num_experts):
        raise ValueError(f"{KEY} holds expert ids outside [0, {settings.num_experts})")
    ordered = used.sort(dim=-1).values
    if ordered.shape[-1] > 1 and bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(
            f"{KEY} repeats an expert within a token's top-{settings.topk}: not a recorded route"
        )
