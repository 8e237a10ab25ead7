"""Routing replay (spmd_rl.model.routing) on the qwen3-moe-tiny preset (8 experts, top-2), float64.

The reference every replayed forward is checked against is written here, independently of the
module: each sparse-MoE block's forward replaced by one that takes the given experts and weights
them with the block's own router softmax, renormalised (norm_topk_prob)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from spmd_rl.batching.batch import Batch, build_rollout_batch
from spmd_rl.batching.packing import PackedLayout, PaddedLayout
from spmd_rl.batching.sequence_parallel import SlicedLayout
from spmd_rl.errors import UserError
from spmd_rl.model import routing
from spmd_rl.model.loading import prepare_policy, random_model_config
from spmd_rl.rollout.base import Completion
from spmd_rl.runtime.sp_groups import SPGroups
from spmd_rl.train.actor import forward_logprobs


def moe_model(seed=0):
    torch.manual_seed(seed)
    config = random_model_config("qwen3-moe-tiny")
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").to(torch.float64)  # float64: no grouped_mm
    for name, p in model.named_parameters():  # a router far from uniform: top-2 choices well separated
        if name.endswith("mlp.gate.weight"):
            torch.nn.init.normal_(p, std=0.5)
    return model


def ragged_batch(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lens):
        ids[i, :n] = torch.randint(2, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return Batch({"input_ids": ids, "attention_mask": mask, "response_mask": mask.double()})


def perturb_routers(model, scale=2.0, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def own_routes(model, mb):
    """[B, L, layers, k] routes of the model's own padded forward, recorded by hooks on the routers
    (not through spmd_rl.model.routing)."""
    got = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, i=i: got.__setitem__(i, out[2]))
             for i, m in enumerate(m for n, m in model.named_modules() if n.endswith("mlp.gate"))]
    with torch.no_grad():
        model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    for h in hooks:
        h.remove()
    b, length = mb["input_ids"].shape
    return torch.stack([got[i].view(b, length, -1) for i in sorted(got)], dim=2).to(torch.int16)


def padded_logprobs_with(model, mb, forwards: dict) -> torch.Tensor:
    """Padded log-probs [B, L] (column t: log p(token t)) of `model` with each module of `forwards` running
    the function given for it instead of its own forward."""
    saved = [(m, m.forward) for m in forwards]
    for m, f in forwards.items():
        m.forward = f
    try:
        logits = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    finally:
        for m, f in saved:
            m.forward = f
    logp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, mb["input_ids"][:, 1:, None])[..., 0]
    return F.pad(logp, (1, 0))


def reference_logprobs(model, mb, routes):
    """Padded log-probs [B, L] with every MoE block forced to `routes` [B, L, layers, k] by the reference
    formula."""
    blocks = [m for n, m in model.named_modules() if n.endswith(".mlp") and hasattr(m, "gate")]
    flat = routes.reshape(-1, *routes.shape[2:]).long()

    def forced(block, layer):
        def forward(hidden):
            b, s, h = hidden.shape
            x = hidden.reshape(-1, h)
            probs = torch.softmax(x @ block.gate.weight.t(), dim=-1, dtype=torch.float32)  # as the router's
            experts = flat[:, layer]
            w = probs.gather(-1, experts)
            w = w / w.sum(-1, keepdim=True)
            return block.experts(x, experts, w.to(x.dtype)).reshape(b, s, h)
        return forward

    return padded_logprobs_with(model, mb, {block: forced(block, layer) for layer, block in enumerate(blocks)})


def test_replay_fixes_the_experts_and_weights_them_by_the_routers_own_probabilities():
    """Routes of model A replayed in a model B whose routers were perturbed: B's log-probs and
    router gradients are the reference formula's at A's routes; without replay B picks other
    experts and its log-probs move."""
    base = moe_model()
    mb = ragged_batch([7, 12, 3, 10], base.config.vocab_size)
    routes = own_routes(base, mb)
    perturbed = copy.deepcopy(base)
    perturb_routers(perturbed)
    assert (own_routes(perturbed, mb) != routes)[mb["attention_mask"].bool()].any()  # off: other experts

    ref_model = copy.deepcopy(perturbed)
    want = reference_logprobs(ref_model, mb, routes)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    want[keep].sum().backward()

    own = own_routes(perturbed, mb)
    model = prepare_policy(perturbed, remove_padding=False, chunked_logprobs=False)
    assert routing.install(model) == 2
    logp, _ = forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: routes}), 1.0)
    torch.testing.assert_close(logp[keep], want[keep].detach(), rtol=0, atol=1e-10)
    # what replay changed: the (token, layer) decisions, padded ones too, where B's own set of experts is not A's
    changed = (own.sort(-1).values != routes.sort(-1).values).any(-1)
    assert routing.take_changed(model) == (float(changed.sum()), float(changed.numel())) and changed.sum() > 0
    assert routing.take_changed(model) == (0.0, 0.0)  # taken: counting starts again
    logp[keep].sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        if name.endswith("mlp.gate.weight"):
            assert p.grad.abs().sum() > 0  # the router still learns through the gathered probabilities
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=name)

    off, _ = forward_logprobs(model, mb, 1.0)  # no routes in the batch: the perturbed router's own
    assert (off[keep] - logp[keep]).abs().max() > 1e-3


def test_replaying_a_models_own_routes_changes_nothing():
    """The model's own routes replayed: the log-probs of the plain forward (the weights are the
    router's own scores at its own choice)."""
    base = moe_model()
    mb = ragged_batch([9, 4], base.config.vocab_size)
    routes = own_routes(base, mb)
    model = prepare_policy(base, remove_padding=True)
    routing.install(model)
    with torch.no_grad():
        plain, _ = forward_logprobs(model, mb, 1.0)
        replayed, _ = forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: routes}), 1.0)
    torch.testing.assert_close(replayed, plain, rtol=0, atol=1e-12)
    assert routing.take_changed(model) == (0.0, (9 + 4) * 2)  # packed: the real tokens, 2 layers; none changed


def replayed_case(lens):
    """A perturbed model, a batch of rows of `lens` tokens carrying the unperturbed model's routes, and the
    positions whose log-prob counts (real tokens but each row's first)."""
    base = moe_model()
    mb = ragged_batch(lens, base.config.vocab_size)
    routes = own_routes(base, mb)
    perturb_routers(base)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    return base, Batch({**mb.tensors, routing.BATCH_KEY: routes}), keep


def test_packed_equals_padded_with_replay():
    base, batch, keep = replayed_case([5, 11, 2, 9, 11])
    out = {}
    for packed in (False, True):
        model = prepare_policy(copy.deepcopy(base), remove_padding=packed, chunked_logprobs=packed)
        routing.install(model)
        logp, _ = forward_logprobs(model, batch, 0.8)
        logp[keep].sum().backward()
        out[packed] = (logp.detach(), {n: p.grad for n, p in model.named_parameters()})
    torch.testing.assert_close(out[True][0][keep], out[False][0][keep], rtol=0, atol=1e-12)
    for n, g in out[False][1].items():
        torch.testing.assert_close(out[True][1][n], g, rtol=0, atol=1e-10, msg=n)


@pytest.mark.parametrize("kernels", ["none", "compile"])
def test_a_checkpointed_layer_recomputes_with_the_routes_of_its_forward(kernels, monkeypatch):
    """Activation checkpointing of every layer (transformers' for "none", the compiled layer's own for
    "compile"): the backward's recompute, after replay's block, routes as the forward did, so the
    gradients are those without checkpointing; the replayed decisions are counted once."""
    from spmd_rl.model import fused_kernels
    from spmd_rl.model.loading import set_gradient_checkpointing

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    base, batch, keep = replayed_case([7, 12, 3, 10])
    out = {}
    for share in (0, 1.0):
        model = prepare_policy(copy.deepcopy(base), remove_padding=True, fused_kernels=kernels)
        routing.install(model)
        set_gradient_checkpointing(model, share)
        model.train()
        logp, _ = forward_logprobs(model, batch, 1.0)
        logp[keep].sum().backward()
        out[share] = ({n: p.grad for n, p in model.named_parameters()}, routing.take_changed(model))
    assert out[1.0][1] == out[0][1] and out[0][1][0] > 0  # (changed, replayed) decisions: the forward's only
    for name, grad in out[0][0].items():
        torch.testing.assert_close(out[1.0][0][name], grad, rtol=0, atol=1e-10, msg=name)


def compiled_counts(monkeypatch, layers: int, remove_padding: bool, replayed: bool = True) -> tuple[int, int]:
    """(graph breaks, graphs) dynamo makes for two no-grad forwards of a fresh qwen3-moe-tiny of `layers` layers
    with model.fused_kernels = "compile" (aot_eager), routes in the batch, replayed where routing is installed."""
    from torch._dynamo.utils import counters

    from spmd_rl.model import fused_kernels

    monkeypatch.setattr(fused_kernels, "COMPILE_OPTIONS", {"backend": "aot_eager"})
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = random_model_config("qwen3-moe-tiny")
    config.num_hidden_layers = layers
    base = AutoModelForCausalLM.from_config(config)
    plain = copy.deepcopy(base)  # its routes, outside the compiled model
    model = prepare_policy(base, remove_padding=remove_padding, fused_kernels="compile")
    if replayed:
        routing.install(model)
    with torch.no_grad():
        for lens in ([5, 9], [4, 7, 2]):
            mb = ragged_batch(lens, config.vocab_size)
            forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: own_routes(plain, mb)}), 1.0)
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def test_one_compiled_graph_serves_the_routers_of_every_layer(monkeypatch):
    """model.fused_kernels = "compile" with replay: the compiled decoder layer's graphs are as many for
    6 layers as for 2 (a router's layer is no constant of the traced code; one graph per layer would
    pass torch.compile's recompile limit on a 48-layer model and run the rest eagerly)."""
    made = {layers: compiled_counts(monkeypatch, layers, remove_padding=True)[1] for layers in (2, 6)}
    assert made[6] == made[2] > 0, made


def test_replay_adds_no_graph_break_or_graph_to_a_compiled_layer(monkeypatch):
    """model.fused_kernels = "compile": the replayed routers are traced inside their layer's graph, as the
    plain model's: no graph break (a break at the router compiled the rest of the block apart, every size
    symbolic, the expert count included) and no graph more than the plain model's, whichever layer."""
    made = {replayed: compiled_counts(monkeypatch, 3, remove_padding=False, replayed=replayed)
            for replayed in (False, True)}
    assert made[True] == made[False], made


def test_missing_routes_route_as_the_trainer_does_per_token():
    """NO_ROUTE on some tokens: those tokens take the router's own choice, the others the given."""
    base = moe_model()
    mb = ragged_batch([8, 6], base.config.vocab_size)
    routes = own_routes(base, mb)
    perturbed = copy.deepcopy(base)
    perturb_routers(perturbed)
    mine = own_routes(perturbed, mb)
    partial = routes.clone()
    partial[0, :4] = routing.NO_ROUTE
    want = routes.clone()
    want[0, :4] = mine[0, :4]
    ref = reference_logprobs(copy.deepcopy(perturbed), mb, want).detach()
    model = prepare_policy(perturbed, remove_padding=True)
    routing.install(model)
    logp, _ = forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: partial}), 1.0)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    torch.testing.assert_close(logp[keep], ref[keep], rtol=0, atol=1e-10)


def test_capture_records_the_routers_own_top_k_and_layouts_cut_routes_like_tokens():
    base = moe_model()
    mb = ragged_batch([5, 9, 3], base.config.vocab_size)
    routes = own_routes(base, mb)
    routing.install(base)
    with torch.no_grad(), routing.capture(base) as got:
        base(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    assert torch.equal(got.routes, routes.reshape(-1, *routes.shape[2:]))

    padded = PaddedLayout(mb["input_ids"], mb["attention_mask"])
    assert torch.equal(padded.token_rows(routes), got.routes)
    packed = PackedLayout(mb["input_ids"], mb["attention_mask"])
    assert torch.equal(packed.token_rows(mb["input_ids"]), packed.inputs["input_ids"][0])
    for size in (2, 3):  # the slices of a sequence-parallel group: the packed row's routes, padded with NO_ROUTE
        parts = [SlicedLayout(packed, SPGroups(size=size, rank=r)) for r in range(size)]
        for part in parts:
            assert torch.equal(part.token_rows(mb["input_ids"], fill=0), part.inputs["input_ids"][0])
        joined = torch.cat([p.token_rows(routes) for p in parts])
        assert torch.equal(joined[:packed.num_tokens], packed.token_rows(routes))
        assert (joined[packed.num_tokens:] == routing.NO_ROUTE).all()


def test_hf_engine_routes_equal_a_separate_forwards_top_k():
    from spmd_rl.rollout.base import SamplingParams
    from spmd_rl.rollout.hf_engine import HFEngine

    engine = HFEngine(moe_model(), pad_token_id=0, eos_token_ids=[1], device=torch.device("cpu"), return_routes=True)
    check = moe_model()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    comps = engine.generate(prompts, SamplingParams(n=2, temperature=0.9, max_new_tokens=9, seed=3))
    for p, group in zip(prompts, comps):
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            want = own_routes(check, Batch({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "response_mask": torch.ones_like(ids)}))[0]
            assert c.routes.dtype == torch.int16 and torch.equal(c.routes, want)
    batch = build_rollout_batch(prompts, comps, pad_id=0)
    assert routing.replayed_share(batch) == (int(batch["attention_mask"].sum()) - len(batch),) * 2
    assert not HFEngine(moe_model(), 0, [1], torch.device("cpu")).return_routes  # replay off: none asked


def test_batch_routes_rows_and_replayed_share():
    """Rows whose engine gave fewer routes than tokens (vLLM: not the last token), or none."""
    r = lambda n, v: torch.full((n, 2, 2), v, dtype=torch.int16)  # noqa: E731
    comps = [[Completion([3, 4, 5], None, "stop", routes=r(4, 1)), Completion([3], None, "stop", routes=r(2, 2))],
             [Completion([6, 7], None, "stop")]]
    batch = build_rollout_batch([[1, 2], [1]], comps, pad_id=0)
    routes = batch[routing.BATCH_KEY]
    assert routes.shape == (3, 5, 2, 2) and routes.dtype == torch.int16
    assert (routes[0, :4] == 1).all() and (routes[0, 4] == routing.NO_ROUTE).all()
    assert (routes[1, :2] == 2).all() and (routes[1, 2:] == routing.NO_ROUTE).all()
    assert (routes[2] == routing.NO_ROUTE).all()
    assert routing.replayed_share(batch) == (4 + 2 + 0, 4 + 2 + 2)
    assert routing.replayed_share(batch.select([0, 1]).trimmed()) == (6, 6)


def test_routes_of_another_shape_and_unreplayable_routers_are_refused():
    model = prepare_policy(moe_model(), remove_padding=True)
    routing.install(model)
    mb = ragged_batch([4], model.config.vocab_size)
    bad = torch.zeros(1, 4, 3, 2, dtype=torch.int16)
    with pytest.raises(UserError, match="router_replay"):
        forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: bad}), 1.0)
    other = prepare_policy(moe_model(), remove_padding=True)
    for layer in other.model.layers:  # scores by sigmoid (DeepSeek-V3's kind): not the softmax formula
        layer.mlp.gate = SigmoidRouter(layer.mlp.gate)
    routing.install(other)
    good = torch.zeros(1, 4, 2, 2, dtype=torch.int16)
    good[..., 1] = 1
    forward_logprobs(model, Batch({**mb.tensors, routing.BATCH_KEY: good}), 1.0)
    with pytest.raises(UserError, match="softmax"):
        forward_logprobs(other, Batch({**mb.tensors, routing.BATCH_KEY: good}), 1.0)


class SigmoidRouter(torch.nn.Module):
    def __init__(self, router):
        super().__init__()
        self.top_k, self.num_experts, self.weight = router.top_k, router.num_experts, router.weight

    def forward(self, hidden):
        logits = F.linear(hidden.reshape(-1, self.weight.shape[1]), self.weight)
        scores, idx = torch.topk(torch.sigmoid(logits), self.top_k, dim=-1)
        return logits, scores, idx


def test_a_dense_model_has_no_routers():
    from tests.model.test_model_families import family_model

    assert routing.install(family_model("qwen3")) == 0


def test_replay_through_a_peft_wrapped_model():
    """LoRA: the routers sit under PEFT's wrapper (base_model.model.model.layers.<i>.mlp.gate); the
    replayed forward is the reference's (the adapter starts at zero)."""
    from peft import LoraConfig, get_peft_model

    base = moe_model()
    mb = ragged_batch([6, 10], base.config.vocab_size)
    routes = own_routes(base, mb)
    perturb_routers(base)
    want = reference_logprobs(copy.deepcopy(base), mb, routes).detach()
    peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert routing.install(peft) == 2 and [layer for layer, _ in routing.routers(peft)] == [0, 1]
    with torch.no_grad(), routing.replay(peft, PaddedLayout(mb["input_ids"], mb["attention_mask"]).token_rows(routes)):
        logits = peft(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False).logits
    logp = F.pad(torch.log_softmax(logits, -1)[:, :-1].gather(-1, mb["input_ids"][:, 1:, None])[..., 0], (1, 0))
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False
    torch.testing.assert_close(logp[keep], want[keep], rtol=0, atol=1e-10)


def test_a_multi_turn_trajectory_keeps_the_latest_turns_routes():
    """Each turn's engine call fed the prompt, the earlier turns and the bridges: its routes cover
    them, so the trajectory's are the latest turn's."""
    from spmd_rl.rollout.multiturn.loop import Trajectory

    t = Trajectory(prompt=[1, 2], row={})
    first = torch.zeros(4, 2, 2, dtype=torch.int16)
    t.add_model_turn(Completion([3, 4], None, "stop", routes=first))
    t.add_bridge([5, 6])
    second = torch.ones(8, 2, 2, dtype=torch.int16)
    t.add_model_turn(Completion([7, 8], None, "stop", routes=second))
    c = t.completion()
    assert c.routes is second and c.token_ids == [3, 4, 5, 6, 7, 8]
    batch = build_rollout_batch([t.prompt], [[c]], pad_id=0)
    assert routing.replayed_share(batch) == (7, 7)  # the bridge tokens 5, 6 replayed too


# --------------------------------------------------------------------------- the router's load-balancing loss


@pytest.mark.parametrize("packed", [False, True])
def test_the_router_aux_loss_is_transformers_own_over_the_real_tokens(packed):
    """actor.router_aux_loss_coef's term, from a padded or packed forward, equals what transformers' model
    computes itself (output_router_logits: its aux_loss, padding masked) on the same rows."""
    reference = moe_model()
    mb = ragged_batch([7, 3, 5], reference.config.vocab_size)
    with torch.no_grad():
        expected = reference(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                             output_router_logits=True).aux_loss
    model = prepare_policy(moe_model(), remove_padding=packed, chunked_logprobs=packed)
    routing.install(model)
    aux = []
    forward_logprobs(model, mb, 1.0, router_aux=aux)
    assert len(aux) == 1
    torch.testing.assert_close(aux[0].detach(), expected, rtol=1e-6, atol=0)  # its softmax is float32
    assert aux[0].requires_grad  # it trains the routers


def test_the_logged_router_aux_loss_is_the_term_the_loss_adds():
    """actor/router_aux_loss is, as every metric ending in "loss" (update.LossFn: summed over the
    micro-batches), the micro-batch's share of the mini-batch times its value: what the loss adds over
    the coefficient. Two micro-batches of a mini-batch then log transformers' aux loss of each, weighted by
    their tokens, not their sum."""
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.train.actor import actor_loss_fn

    model = prepare_policy(moe_model(), remove_padding=True)
    routing.install(model)
    halves = [ragged_batch([7, 3], model.config.vocab_size, seed=0), ragged_batch([5], model.config.vocab_size, seed=1)]
    for mb in halves:
        mb["advantages"] = torch.ones_like(mb["response_mask"])
        mb["old_logprobs"] = torch.zeros_like(mb["response_mask"])
    denom = float(sum(mb["response_mask"].sum() for mb in halves))
    logged, expected = 0.0, 0.0
    for mb in halves:
        off, _ = actor_loss_fn(model, ActorConfig(), 1.0)(mb, denom)
        on, metrics = actor_loss_fn(model, ActorConfig(router_aux_loss_coef=0.5), 1.0)(mb, denom)
        with torch.no_grad():
            aux = model(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"],
                        output_router_logits=True).aux_loss
        share = float(mb["response_mask"].sum()) / denom
        torch.testing.assert_close((on - off).detach().double(), 0.5 * share * aux.double(), rtol=1e-6, atol=1e-9)
        logged, expected = logged + metrics["router_aux_loss"].double(), expected + share * aux.double()
    torch.testing.assert_close(logged, expected, rtol=1e-6, atol=1e-9)


def test_without_the_aux_loss_no_router_logits_are_kept():
    model = prepare_policy(moe_model(), remove_padding=True)
    routing.install(model)
    seen = []
    state = routing.state_of(model)
    original = state.__class__.__setattr__

    def watch(self, name, value):
        if name == "collecting" and value:
            seen.append(value)
        original(self, name, value)

    state.__class__.__setattr__ = watch
    try:
        forward_logprobs(model, ragged_batch([4, 6], model.config.vocab_size), 1.0)
    finally:
        state.__class__.__setattr__ = original
    assert seen == [] and not model.config.output_router_logits


def glm_model(seed=0):
    """GLM-4.7-Flash's family (glm4_moe_lite) at the tiny preset's size in float64, its routers' score
    correction biases set (random init leaves them 0) so that they steer the choice away from the top-k
    of the scores that weight the experts."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(random_model_config("glm4-moe-lite-tiny"),
                                             experts_implementation="eager").to(torch.float64)
    for name, m in model.named_modules():
        if name.endswith("mlp.gate"):
            torch.nn.init.normal_(m.weight, std=0.5)
            m.e_score_correction_bias.normal_(std=0.5)
    return model


def glm_reference_logprobs(model, mb, routes):
    """Padded log-probs [B, L] with every mixture block forced to `routes` [B, L, layers, k] by
    GLM's formula by hand: the sigmoid scores at the given experts, renormalised, times the scaling
    factor, plus the shared expert."""
    flat = routes.reshape(-1, *routes.shape[2:]).long()

    def forced(block, layer):
        def forward(hidden):
            b, s, h = hidden.shape
            x = hidden.reshape(-1, h)
            experts = flat[:, layer]
            w = torch.sigmoid(x.float() @ block.gate.weight.float().t()).gather(-1, experts)
            w = w / w.sum(-1, keepdim=True) * block.gate.routed_scaling_factor
            return (block.experts(x, experts, w.to(x.dtype)) + block.shared_experts(x)).reshape(b, s, h)
        return forward

    return padded_logprobs_with(model, mb, {block: forced(block, int(name.split(".")[2]))
                                            for name, block in model.named_modules() if hasattr(block, "shared_experts")})


def test_a_sigmoid_router_with_a_correction_bias_replays_glms_formula():
    """GLM-4.7-Flash's router: its own routes replayed give the plain forward (the weights are its
    sigmoid scores without the bias, renormalised, times 1.8); another model's routes give the formula
    by hand at those experts; the dense first layer has no router (its slot stays unused)."""
    base = glm_model()
    mb = ragged_batch([7, 12, 3], base.config.vocab_size)
    got = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: got.__setitem__(n, out[2]))
             for n, m in base.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        base(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], use_cache=False)
    for h in hooks:
        h.remove()
    b, length = mb["input_ids"].shape
    routes = torch.full((b, length, 2, 2), routing.NO_ROUTE, dtype=torch.int16)  # layer 0 is dense
    routes[:, :, 1] = got["model.layers.1.mlp.gate"].view(b, length, 2).to(torch.int16)
    keep = mb["attention_mask"].bool()
    keep[:, 0] = False

    perturbed = copy.deepcopy(base)
    perturb_routers(perturbed)
    want = glm_reference_logprobs(copy.deepcopy(perturbed), mb, routes)
    for model, reference in ((base, None), (perturbed, want)):
        policy = prepare_policy(model, remove_padding=False, chunked_logprobs=False)
        assert routing.install(policy) == 1
        with torch.no_grad():
            plain, _ = forward_logprobs(policy, mb, 1.0)
            replayed, _ = forward_logprobs(policy, Batch({**mb.tensors, routing.BATCH_KEY: routes}), 1.0)
        if reference is None:  # its own routes: the plain forward
            torch.testing.assert_close(replayed[keep], plain[keep], rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(replayed[keep], reference[keep], rtol=0, atol=1e-10)
            assert (replayed[keep] - plain[keep]).abs().max() > 1e-3  # the perturbed router's own choice differs
