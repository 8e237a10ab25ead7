"""Routing replay for mixture-of-experts models: every router of a model selects given experts, or
records the experts it selects.

Routes are int16 [tokens, layers, top_k]: for each token of a forward (in the order the model sees
them: rows flattened, or a packed row, or a sequence-parallel slice of one; see the layouts'
`token_rows`), for each decoder layer (`config.num_hidden_layers`; layers without a router are
ignored), the experts chosen. `NO_ROUTE` (-1) in a token's first slot of a layer means "none given":
that token routes as the router itself decides (tokens the engine did not route, padding).

`install(model)` wraps the forward of every router (`routers`: modules with `top_k`, `num_experts`
and a `weight` [num_experts, hidden] whose forward returns (router_logits, router_scores,
router_indices): the top-k softmax routers of transformers 5, Qwen3-MoE's `Qwen3MoeTopKRouter`
among them). Nothing in transformers is edited; a model without routers is left as it is (a
dense model: replay is a no-op). Every router runs the same wrapped code: a router's layer is never
a constant in it (replay hands each router its own layer's routes as a tensor, `GIVEN`), so a
compiled decoder layer (model.fused_kernels = "compile") is one graph for all its layers, not one
per layer. Then:

- `replay(model, routes)`: while the block runs, a router takes the given experts and weights them
  with its own scores gathered at them (softmax probabilities; sigmoid scores for the routers with a
  score correction bias, DeepSeek-V3's and GLM-4.7-Flash's, whose bias and expert groups only steer the
  choice), renormalised over the top-k when the router normalises its own (`norm_topk_prob`, Mixtral
  always), times its `routed_scaling_factor` where it has one. Gradients flow to the router through
  those scores; the choice itself is fixed. `take_changed` counts the decisions where the router's
  own choice was another (what replay changed).
- `capture(model)`: the block's forward records each router's own choices; `.routes` is then the
  int16 [tokens, layers, top_k] routes of that forward (NO_ROUTE in layers without a router).
- `checkpoint_contexts`: the `context_fn` of every activation checkpoint (spmd_rl.model.loading,
  fused_kernels): the backward's recompute of a layer routes as its forward did, although it runs
  after `replay`'s block has ended, and counts nothing twice.

The weight formula is checked against each router's own scores at its own choice: every replayed
router writes whether they differ (`FORMULA`), and a model's first replayed forward reads it, once
its block ends, on the host; a router that weights experts another way is refused with a
`UserError` before any update uses its weights. Nothing in a router's forward branches on a
tensor's value or on a per-layer constant, so the router is traced inside its layer's graph
(a branch on a value would break the graph there and compile what follows apart, with every size
symbolic, the expert count included).
"""

from __future__ import annotations

import contextlib
import re
import types
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from spmd_rl.errors import UserError

NO_ROUTE = -1
BATCH_KEY = "routes"
"""The batch's [B, L, layers, top_k] int16 routes of every row's tokens (spmd_rl.batching.batch)."""
ROUTES_DTYPE = torch.int16
GIVEN = "spmd_given_routes"
"""A router's attribute: while replaying, its layer's routes [tokens, top_k], else None (read by its forward)."""
OWN, LOGITS, CHANGED, DECIDED, FORMULA = ("spmd_own_routes", "spmd_router_logits", "spmd_changed", "spmd_decided",
                                          "spmd_formula_differs")
"""A router's attributes its forward writes (never reads): its own top-k while capturing, its logits while
`router_logits` collects, its replay's counts (changed, decided) and whether its own weights differ from
the replay formula's (a bool tensor); collected when the block ends."""
WRITTEN = (OWN, LOGITS, CHANGED, DECIDED, FORMULA)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_STATES: "weakref.WeakSet[RoutingState]" = weakref.WeakSet()
"""Every installed model's routing state (checkpoint_contexts)."""


@dataclass(eq=False)  # compared and hashed by identity: one per model (the WeakSet of installed states)
class RoutingState:
    """What a model's routers do in the current forward (one per model, `model.spmd_routing`). A
    router's forward reads `capturing`, `collecting` and its own `GIVEN`: the same values for every
    router of a forward (`GIVEN`: a tensor of the same shape), so a compiled decoder layer traces one
    graph for all layers."""

    num_layers: int
    top_k: int
    routers: list[tuple[int, torch.nn.Module]] = field(default_factory=list)
    """(decoder layer, router) of every router (`routers`), in the order a forward calls them."""
    routes: torch.Tensor | None = None
    """[tokens, layers, top_k] to replay, or None (the routers' own choice); each router holds its
    layer's part as `GIVEN` (`give`)."""
    capturing: bool = False
    """Whether `capture` records the routers' own choices."""
    collecting: bool = False
    """Whether `router_logits` collects the routers' logits."""
    checked: bool = False
    """Whether the weight formula was checked (at the end of the first replayed forward; read on the host,
    never by a router's forward)."""
    changed: torch.Tensor | None = None
    """Of the router decisions (token x layer) replayed since `take_changed`: those where the router's
    own top-k is another set of experts than the given one (a count on the routers' device)."""
    decided: torch.Tensor | None = None
    """The router decisions replayed since `take_changed` (tokens with a given route x layers)."""

    def give(self, routes: torch.Tensor | None) -> None:
        """Replay `routes` from now on (None: the routers' own choice): each router gets its layer's."""
        self.routes = routes
        for layer, router in self.routers:
            setattr(router, GIVEN, None if routes is None else routes[:, layer])

    def take(self, name: str) -> list[torch.Tensor]:
        """What every router wrote to its attribute `name` in the last forward, in call order; cleared."""
        out = [getattr(r, name) for _, r in self.routers]
        for _, r in self.routers:
            setattr(r, name, None)
        return [t for t in out if t is not None]

    def count_replays(self) -> None:
        """Add the routers' counts of the last forward to `changed` and `decided`."""
        changed, decided = self.take(CHANGED), self.take(DECIDED)
        if changed:
            changed, decided = torch.stack(changed).sum(), torch.stack(decided).sum()
            self.changed = changed if self.changed is None else self.changed + changed
            self.decided = decided if self.decided is None else self.decided + decided


def is_router(module: torch.nn.Module) -> bool:
    w = getattr(module, "weight", None)
    e = getattr(module, "num_experts", None)
    return (isinstance(getattr(module, "top_k", None), int) and isinstance(e, int) and w is not None
            and w.dim() == 2 and w.shape[0] == e)


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, router) of every router of `model`, in module order; the layer comes
    from the module's name (`...layers.<i>....`), else the router's position."""
    found = [(name, m) for name, m in model.named_modules() if is_router(m)]
    out = []
    for pos, (name, m) in enumerate(found):
        hit = _LAYER.search(name)
        out.append((int(hit.group(1)) if hit else pos, m))
    return out


def install(model: torch.nn.Module) -> int:
    """Wrap the forward of every router of `model` for `replay` and `capture` (once; a second call
    changes nothing). Returns the number of routers (0: a dense model, left as it is)."""
    if hasattr(model, "spmd_routing"):
        return len(routers(model))
    found = routers(model)
    if not found:
        return 0
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_layers = max(getattr(config, "num_hidden_layers", 0), max(layer for layer, _ in found) + 1)
    state = RoutingState(num_layers, found[0][1].top_k, found)
    for _, router in found:
        for name in (GIVEN, *WRITTEN):
            setattr(router, name, None)
        router.forward = types.MethodType(_routed_forward(type(router).forward, state), router)
    model.spmd_routing = state
    _STATES.add(state)
    return len(found)


def state_of(model: torch.nn.Module) -> RoutingState | None:
    """The routing state `install` gave `model` (a PEFT wrapper passes the attribute on), None if none."""
    return getattr(model, "spmd_routing", None)


@contextlib.contextmanager
def replay(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """The forward of `model` in the block (one) takes `routes` ([tokens, layers, top_k], see the module
    doc). No-op when `routes` is None or the model has no routers installed."""
    state = state_of(model)
    if state is None or routes is None:
        yield
        return
    if routes.dim() != 3 or routes.shape[1] != state.num_layers or routes.shape[2] != state.top_k:
        raise UserError(f"routing replay: routes of shape {tuple(routes.shape)} do not fit this model's "
                        f"[tokens, {state.num_layers} layers, top-{state.top_k}]: the engine's model is not the "
                        'trainer\'s; set actor.router_replay = "off"')
    before = state.routes
    state.give(routes)
    try:
        yield
        state.count_replays()
        differs = state.take(FORMULA)
        if not state.checked and differs:
            _refuse_other_formulas(state, differs)
    finally:
        state.give(before)
        for name in (CHANGED, DECIDED, FORMULA):  # a forward that raised counts nothing
            state.take(name)


def checkpoint_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch.utils.checkpoint's `context_fn` (spmd_rl.model.loading, fused_kernels): called when a
    checkpointed layer runs forward, it keeps what every model's routers see then, and returns (a
    no-op for the forward, the recompute's context). The recompute, in backward, after `replay`'s
    block, sees the same: the same routes (without them its routers would choose their own experts:
    other tokens per expert, other gradients), and so the same code path (a compiled layer takes the
    forward's graph and saves the same tensors, which torch checks). What it writes is dropped."""
    saved = [(s, s.routes, s.collecting) for s in list(_STATES)]
    return contextlib.nullcontext(), _recompute(saved)


@contextlib.contextmanager
def _recompute(saved: list[tuple[RoutingState, torch.Tensor | None, bool]]) -> Iterator[None]:
    before = [(s, s.routes, s.collecting) for s, *_ in saved]
    for s, routes, collecting in saved:
        s.give(routes)
        s.collecting = collecting
    try:
        yield
    finally:
        for s, routes, collecting in before:
            for name in (LOGITS, CHANGED, DECIDED, FORMULA):
                s.take(name)
            s.give(routes)
            s.collecting = collecting


@contextlib.contextmanager
def router_logits(model: torch.nn.Module, on: bool = True) -> Iterator[list[torch.Tensor]]:
    """The routers' logits ([tokens, experts] each, with their graph) of the block's forward (one), in
    call order, in the list yielded once the block ends (empty where `on` is false or the model has no
    routers installed)."""
    out: list[torch.Tensor] = []
    state = state_of(model)
    if state is None or not on:
        yield out
        return
    state.collecting = True
    try:
        yield out
        out.extend(state.take(LOGITS))
    finally:
        state.collecting = False
        state.take(LOGITS)


def take_changed(model: torch.nn.Module) -> tuple[float, float]:
    """(decisions changed, decisions replayed) by the replays of `model` since the last call (see
    RoutingState.changed), and start counting again; (0, 0) without replays."""
    state = state_of(model)
    if state is None or state.changed is None:
        return 0.0, 0.0
    out = float(state.changed), float(state.decided)
    state.changed = state.decided = None
    return out


def load_balancing_loss(logits: list[torch.Tensor], top_k: int, real: torch.Tensor) -> torch.Tensor:
    """transformers' load-balancing loss (load_balancing_loss_func: experts x sum over experts of the share
    of routed copies x the mean router probability) over the layers' `logits` at the `real` tokens
    ([tokens] bool: padding left out)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    mask = real.reshape(1, -1).long()
    return load_balancing_loss_func(tuple(logits), logits[0].shape[-1], top_k, mask)


class Captured:
    """What `capture` yields: `.routes` after the block."""

    routes: torch.Tensor | None = None


@contextlib.contextmanager
def capture(model: torch.nn.Module) -> Iterator[Captured]:
    """Record the routers' own choices of the block's forward (one forward) as `.routes` of what is
    yielded, int16 [tokens, layers, top_k]; None for a model without routers installed."""
    out = Captured()
    state = state_of(model)
    if state is None:
        yield out
        return
    state.capturing = True
    try:
        yield out
        own = state.take(OWN)
        if own:
            if len(own) != len(state.routers):
                raise RuntimeError(f"routing capture: {len(own)} of the {len(state.routers)} routers ran in the block")
            routes = torch.full((own[0].shape[0], state.num_layers, state.top_k), NO_ROUTE, dtype=ROUTES_DTYPE,
                                device=own[0].device)
            for (layer, _), idx in zip(state.routers, own):
                routes[:, layer] = idx
            out.routes = routes
    finally:
        state.capturing = False
        state.take(OWN)


def rows_of_routes(routes: list[torch.Tensor | None], length: int) -> torch.Tensor:
    """The batch's routes [B, length, layers, top_k] int16 from each row's engine routes (None: the
    engine gave the row none), NO_ROUTE where a row has none."""
    shape = next(r.shape[1:] for r in routes if r is not None)
    out = torch.full((len(routes), length, *shape), NO_ROUTE, dtype=ROUTES_DTYPE)
    for i, r in enumerate(routes):
        if r is not None:
            if r.shape[1:] != shape:
                raise RuntimeError(f"the engine's routes of row {i} are {tuple(r.shape)}, another row's [*, {shape}]")
            n = min(r.shape[0], length)
            out[i, :n] = r[:n].to(ROUTES_DTYPE)
    return out


def replayed_share(batch) -> tuple[int, int]:
    """(tokens replayed, tokens counted) of a batch (spmd_rl.batching.batch.Batch): counted are the
    tokens whose routing reaches a log-prob, every row's tokens but its last; replayed those of
    them with a route in the batch's `routes` (none without them)."""
    counted = (batch["attention_mask"].sum(-1) - 1).clamp(min=0)
    if BATCH_KEY not in batch:
        return 0, int(counted.sum())
    cols = torch.arange(batch.seq_len)[None, :]
    routed = (batch[BATCH_KEY][..., 0] != NO_ROUTE).any(-1) & (cols < counted[:, None])
    return int(routed.sum()), int(counted.sum())


def _normalises(router: torch.nn.Module) -> bool:
    """Whether the router renormalises its top-k probabilities (Mixtral's has no flag and always does)."""
    return bool(getattr(router, "norm_topk_prob", True))


def scores_by_sigmoid(router: torch.nn.Module) -> bool:
    """DeepSeek-V3's router and its kin (GLM-4.7-Flash's): sigmoid scores, a bias that only steers the choice."""
    return hasattr(router, "e_score_correction_bias")


def _weights(router: torch.nn.Module, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The router's scores at `experts` [tokens, top_k] as it weights them: softmax probabilities, or sigmoid
    scores (without the correction bias, which only steers the choice), renormalised over the top-k when it
    does, times its routed_scaling_factor where it has one."""
    if scores_by_sigmoid(router):
        w = torch.sigmoid(logits.float()).gather(-1, experts)
    else:
        w = torch.softmax(logits.float(), dim=-1).gather(-1, experts)
    if _normalises(router):
        w = w / w.sum(-1, keepdim=True)
    return w * getattr(router, "routed_scaling_factor", 1.0)


def _routed_forward(original, state: RoutingState):
    def forward(self, hidden_states, *args, **kwargs):
        out = original(self, hidden_states, *args, **kwargs)
        if state.collecting and isinstance(out, tuple):
            setattr(self, LOGITS, out[0])
        given = getattr(self, GIVEN)
        if given is None and not state.capturing:
            return out
        if not (isinstance(out, tuple) and len(out) == 3):
            raise UserError(f"routing replay: {type(self).__name__}.forward does not return (router_logits, "
                            'router_scores, router_indices); set actor.router_replay = "off" for this model')
        logits, scores, own = out
        if state.capturing:
            setattr(self, OWN, own.to(ROUTES_DTYPE))
        if given is None:
            return out
        setattr(self, FORMULA, _formula_differs(self, logits, scores, own))
        given = given.to(own.device)
        if given.shape[0] != own.shape[0]:
            raise RuntimeError(f"routing replay: {given.shape[0]} routes for the {own.shape[0]} tokens of a forward "
                               "(the routes must be cut like the tokens: see the layouts' token_rows)")
        given_here = given[:, 0] != NO_ROUTE
        other = (given.long().sort(-1).values != own.long().sort(-1).values).any(-1) & given_here
        setattr(self, CHANGED, other.sum())
        setattr(self, DECIDED, given_here.sum())
        experts = torch.where(given[:, :1] == NO_ROUTE, own, given.long())
        return logits, _weights(self, logits, experts).to(scores.dtype), experts.to(own.dtype)

    return forward


def _formula_differs(router, logits: torch.Tensor, scores: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Whether the router's own weights at its own choice differ from `_weights`' (a bool tensor, no branch)."""
    mine = _weights(router, logits.detach(), own.long())
    return (~torch.isclose(mine, scores.detach().float(), rtol=2e-2, atol=1e-3)).any()


def _refuse_other_formulas(state: RoutingState, differs: list[torch.Tensor]) -> None:
    """At the end of a model's first replayed forward: refuse a router whose weights are not `_weights`'."""
    if bool(torch.stack(differs).any()):
        router = state.routers[0][1]
        raise UserError(f"routing replay: {type(router).__name__} does not weight its experts by their softmax "
                        "probability or sigmoid score (renormalised when norm_topk_prob, times routed_scaling_factor), "
                        'so its routing cannot be replayed; set actor.router_replay = "off" for this model')
    state.checked = True
