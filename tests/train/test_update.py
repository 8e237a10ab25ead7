"""The distributed, micro-batched update computes the same gradient as one process doing the
whole mini-batch at once, for every loss aggregation mode; and the FSDP2-wrapped model gives
the same log-probs as a plain `from_pretrained` model."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from spmd_rl.batching.batch import Batch
from tests.helpers.dist_utils import run_distributed

MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def tiny_config():
    return Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def make_batch(seed=0, rows=8):
    """Rows with different prompt/response lengths and right padding, plus PPO inputs."""
    from spmd_rl.batching.batch import Batch

    g = torch.Generator().manual_seed(seed)
    L = 12
    ids = torch.randint(2, 50, (rows, L), generator=g)
    attn = torch.zeros(rows, L, dtype=torch.long)
    resp = torch.zeros(rows, L)
    for i in range(rows):
        p = int(torch.randint(2, 5, (1,), generator=g))
        r = int(torch.randint(1, L - p + 1, (1,), generator=g))
        attn[i, :p + r] = 1
        resp[i, p:p + r] = 1
    ids = ids * attn
    return Batch(dict(input_ids=ids, attention_mask=attn, response_mask=resp,
                      old_logprobs=(-torch.rand(rows, L, generator=g) * 3) * resp,
                      advantages=torch.randn(rows, L, generator=g) * resp))


def reference_grads(model, batch, mode):
    """float64, whole batch, written out plainly (no spmd_rl code)."""
    model = model.double()
    reference_loss(model, batch, mode).backward()
    return {n: p.grad.float() for n, p in model.named_parameters()}


def reference_loss(model, batch, mode):
    """The actor's PPO loss (clip 0.2 / 0.28, dual clip 3) of the whole batch for a float64 model,
    written out plainly (no spmd_rl code)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["response_mask"][:, 1:].double()
    ratio = torch.exp(logp - batch["old_logprobs"][:, 1:].double())
    adv = batch["advantages"][:, 1:].double()
    per_tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
    per_tok = torch.where(adv < 0, torch.minimum(per_tok, -adv * 3.0), per_tok)
    if mode == "token-mean":
        loss = (per_tok * mask).sum() / mask.sum()
    elif mode == "seq-mean-token-sum":
        loss = (per_tok * mask).sum(-1).mean()
    else:
        loss = ((per_tok * mask).sum(-1) / mask.sum(-1)).mean()
    return loss


# (remove_padding, chunked_logprobs, max_tokens): the padded full-logits path in micro-batches of one
# row, and packed rows with chunked log-probs in token-budget micro-batches (2-3 rows of <= 12 tokens).
LAYOUTS = {"padded-full-logits": (False, False, 0), "packed-chunked-token-budget": (True, True, 20)}


def _update_body(rank, world, layout):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.model.loading import apply_fsdp, prepare_policy
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.update import ppo_update

    remove_padding, chunked, max_tokens = LAYOUTS[layout]
    mesh = init_device_mesh("cpu", (world,))
    batch = make_batch()
    for mode in MODES:
        torch.manual_seed(0)
        plain = Qwen2ForCausalLM(tiny_config())
        model = Qwen2ForCausalLM(tiny_config())
        model.load_state_dict(plain.state_dict())
        ref = reference_grads(plain, batch, mode)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        apply_fsdp(prepare_policy(model, remove_padding, chunked), mesh, torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # delta = -grad exactly
        cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=mode)
        rows = len(batch) // world
        mine = batch.select(slice(rank * rows, (rank + 1) * rows))
        metrics = ppo_update(model, opt, mine, actor_loss_fn(model, cfg, 1.0), mini_batch_size=rows,
                             micro_batch_size=1, epochs=1, grad_clip=0.0, loss_agg_mode=mode,
                             device=torch.device("cpu"), max_tokens=max_tokens)
        for n, p in model.named_parameters():
            got = before[n] - p.full_tensor()
            torch.testing.assert_close(got, ref[n], rtol=1e-4, atol=1e-6, msg=f"{mode} {n}")
        assert abs(metrics["grad_norm"] - torch.sqrt(sum((g.double() ** 2).sum() for g in ref.values())).item()) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_distributed_micro_batched_update_matches_full_batch_reference(layout):
    run_distributed(_update_body, 2, layout)


def _fsdp_logprobs_body(rank, world, model_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_rl.model.loading import apply_fsdp, load_causal_lm
    from spmd_rl.train.actor import compute_logprobs

    mesh = init_device_mesh("cpu", (world,))
    batch = make_batch(seed=1)
    plain = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    actor = apply_fsdp(load_causal_lm(model_dir, torch.float32), mesh, torch.float32)
    assert actor.lm_head.weight is actor.model.embed_tokens.weight  # still tied after wrapping
    got = compute_logprobs(actor, batch, 0.7, micro_batch_size=3, device=torch.device("cpu"))
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / 0.7
        want = torch.log_softmax(logits.double(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    want = torch.nn.functional.pad(want, (1, 0)).float() * batch["response_mask"]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_fsdp_actor_logprobs_match_plain_from_pretrained(tmp_path):
    from spmd_rl.model.loading import materialize_random_model

    materialize_random_model(str(tmp_path), tiny_config(), seed=3, dtype=torch.float32)
    run_distributed(_fsdp_logprobs_body, 2, str(tmp_path))


# --------------------------------------------------------------------------- the host never waits per micro-batch

HOST_READS = {"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "numpy", "nonzero",
              "equal", "allclose", "is_nonzero", "any", "all"}
"""Tensor methods that read values on the host: on a GPU tensor each waits for all the work queued
before it (`all` and `any` only when their result is then used as a Python bool; counted here
either way)."""


CPU_ONLY = ("_sdpa_per_sequence",)
"""Reads on code paths that run on the CPU only: the packed attention's CPU stand-in reads the
boundaries (on CUDA, PyTorch's varlen kernel takes them as a device tensor)."""


class OnDevice(torch.Tensor):
    """A CPU tensor standing for one on a GPU: each host read of its values (HOST_READS) and of
    the tensors computed from it is recorded with the spmd_rl function that made it."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in (*args[1:], *(kwargs or {}).values()))
        if (name in HOST_READS and not (name in ("any", "all") and kwargs)) or to_host:
            where = _caller()
            if not where.startswith(CPU_ONLY):
                cls.reads.append(f"{name} in {where}")
        return super().__torch_function__(func, types, args, kwargs or {})


def _caller() -> str:
    import sys

    frame = sys._getframe(2)
    while frame is not None and "spmd_rl" not in frame.f_code.co_filename and "transformers" not in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_qualname} ({frame.f_code.co_filename.rsplit('/', 1)[-1]})"


@pytest.fixture
def device_stand_in(monkeypatch):
    """What `Batch.to` and the packed layout put on the device becomes OnDevice."""
    from spmd_rl.batching import packing
    from spmd_rl.batching.batch import Batch

    def on_device(tensor):
        return tensor.as_subclass(OnDevice)

    moved_by = Batch.to

    def to(self, device):
        moved = moved_by(self, device)
        moved.tensors = {k: on_device(v) for k, v in moved.tensors.items()}
        return moved

    monkeypatch.setattr(Batch, "to", to)
    if hasattr(packing, "to_device"):
        monkeypatch.setattr(packing, "to_device", lambda tensor, device: on_device(tensor.to(device)))
    OnDevice.reads = []
    return OnDevice


@pytest.mark.parametrize("own", [False, True], ids=["old-logprobs-given", "on-policy-shortcut"])
def test_update_reads_device_values_once_whatever_its_micro_batches(device_stand_in, own):
    """The packed actor update over 1 and over 4 micro-batches: the host reads values computed on
    the device once per update (the metrics, MetricSums.read), never per micro-batch: no read in the
    layout, the model, the loss or the on-policy log-probs, which on a GPU would each wait for the
    queued forward and backward and leave the GPU idle while the host launches the next work."""
    from spmd_rl.config.actor import ActorConfig
    from spmd_rl.config.algorithm import AlgorithmConfig
    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import actor_loss_fn
    from spmd_rl.train.old_logprobs import UpdateLogprobs
    from spmd_rl.train.update import ppo_update

    batch = make_batch(rows=8)
    reads = {}
    for budget in (200, 20):  # every row in one micro-batch; 4 of 2-3 rows
        torch.manual_seed(0)
        model = prepare_policy(Qwen2ForCausalLM(tiny_config()), remove_padding=True, chunked_logprobs=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        cfg = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, use_kl_loss=False)
        updater = UpdateLogprobs(batch, AlgorithmConfig()) if own else None
        device_stand_in.reads = []
        metrics = ppo_update(model, opt, updater.batch if own else batch, actor_loss_fn(model, cfg, 1.0, updater),
                             mini_batch_size=8, micro_batch_size=1, epochs=1, grad_clip=1.0,
                             loss_agg_mode="token-mean", device=torch.device("cpu"), max_tokens=budget)
        reads[budget] = list(device_stand_in.reads)
        assert {"pg_loss", "entropy", "clipfrac", "ppo_kl", "grad_norm"} <= set(metrics)
        if own:
            assert updater.logprobs(batch["response_mask"]).abs().sum() > 0
    assert reads[200] == reads[20] == ["tolist in MetricSums.read (update.py)"], reads


def test_metric_sums_match_per_micro_batch_reads():
    """MetricSums' sums of tensors and floats, read once, against the same sums read one by one in float64."""
    from spmd_rl.train.update import MetricSums

    g = torch.Generator().manual_seed(0)
    values = [(torch.rand((), generator=g, dtype=torch.float32), float(torch.rand((), generator=g)), 0.1 + i / 7)
              for i in range(5)]
    sums = MetricSums()
    want = {"a": 0.0, "b": 0.0}
    for tensor, number, weight in values:
        sums.add("a", tensor, weight)
        sums.add("b", number, weight)
        want["a"] += float(tensor) * weight
        want["b"] += number * weight
    got = sums.read()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12), k


def test_log_prob_pass_and_critic_update_read_no_device_value_per_micro_batch(device_stand_in, tmp_path):
    """The no-grad log-prob pass (actor.compute_logprobs: old and reference log-probs) reads nothing
    from the device until its queued copies have all landed (HostColumns.result); the critic's update
    reads once, as the actor's. Its log-probs equal the plain padded model's."""
    from spmd_rl.config.critic import CriticConfig
    from spmd_rl.model.loading import load_value_model, prepare_policy
    from spmd_rl.train.actor import compute_logprobs
    from spmd_rl.train.critic import critic_loss_fn
    from spmd_rl.train.update import ppo_update

    batch = make_batch(rows=8)
    torch.manual_seed(0)
    plain = Qwen2ForCausalLM(tiny_config())
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        want = torch.log_softmax(logits.double(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    want = torch.nn.functional.pad(want, (1, 0)).float() * batch["response_mask"]
    plain.save_pretrained(tmp_path)
    model = prepare_policy(plain, remove_padding=True, chunked_logprobs=True)
    critic = load_value_model(str(tmp_path), torch.float32, remove_padding=True)
    critic_batch = Batch({**batch.tensors, "values": torch.zeros(8, 12), "returns": torch.randn(8, 12)})
    opt = torch.optim.SGD(critic.parameters(), lr=0.1)
    for budget in (200, 20):
        device_stand_in.reads = []
        got = compute_logprobs(model, batch, 1.0, 1, torch.device("cpu"), max_tokens=budget)
        assert device_stand_in.reads == [], device_stand_in.reads
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        ppo_update(critic, opt, critic_batch, critic_loss_fn(critic, CriticConfig()), mini_batch_size=8,
                   micro_batch_size=1, epochs=1, grad_clip=1.0, loss_agg_mode="token-mean",
                   device=torch.device("cpu"), max_tokens=budget)
        assert device_stand_in.reads == ["tolist in MetricSums.read (update.py)"], device_stand_in.reads
