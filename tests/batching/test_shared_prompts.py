"""Shared prompts (spmd_rl.batching.shared_prompts): each prompt fed once per packed micro-batch gives
the padded path's log-probs and entropy on the response columns (float64, equal to ~1e-12) and its
gradients (to float32 rounding: see the test), for a sliding-window family too; the token-budget plan keeps a prompt's rows together and
counts the prompt once."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from spmd_rl.batching.batch import Batch, iter_micro_batches, plan_micro_batches
from spmd_rl.batching.shared_prompts import SharedPromptLayout, prompt_sets, units
from tests.batching.test_packing import nonzero_value_head, param_grads, tiny_config
from tests.helpers.dist_utils import run_distributed


def grouped_batch(groups, vocab=97, seed=0):
    """Rows of prompts with responses: `groups` = [(prompt length, [response lengths])]; a group's rows
    share its prompt tokens. prompt_lens, response_mask as the rollout builds them."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, responses in groups:
        prompt = torch.randint(1, vocab, (p,), generator=g)
        rows += [(p, torch.cat([prompt, torch.randint(1, vocab, (n,), generator=g)])) for n in responses]
    L = max(len(r) for _, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    attn = torch.zeros(len(rows), L, dtype=torch.long)
    resp = torch.zeros(len(rows), L, dtype=torch.float64)
    for i, (p, r) in enumerate(rows):
        ids[i, :len(r)], attn[i, :len(r)], resp[i, p:len(r)] = r, 1, 1.0
    return Batch({"input_ids": ids, "attention_mask": attn, "response_mask": resp,
                  "prompt_lens": torch.tensor([p for p, _ in rows])})


GROUPS = [(6, [4, 1, 7]), (3, [5, 2]), (9, [3]), (6, [2, 5])]  # the last group: another prompt of length 6


def test_the_layout_feeds_each_prompt_once():
    mb = grouped_batch(GROUPS)
    layout = SharedPromptLayout(mb)
    assert layout.num_tokens == 6 + 12 + 3 + 7 + 9 + 3 + 6 + 7
    # the first prompt, then its three responses, each at its own columns (positions)
    pos = layout.inputs["position_ids"][0].tolist()
    assert pos[:6 + 12] == list(range(6)) + list(range(6, 10)) + [6] + list(range(6, 13))
    assert layout.inputs["cu_seq_lens_q"].tolist()[:5] == [0, 6, 10, 11, 18]
    # a response's keys: its prompt's positions, then its own
    assert layout.inputs["spmd_kv_index"][6:6 + 10].tolist() == list(range(6)) + list(range(6, 10))
    # every response's first log-prob is read at the prompt's last position
    assert layout.output_rows[[0, 4, 5]].tolist() == [5, 5, 5]


@pytest.mark.parametrize("chunked", [True, False])
def test_shared_prompts_give_the_padded_log_probs_entropy_and_gradients(tmp_path, chunked):
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import forward_logprobs

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp_path)
    mb = grouped_batch(GROUPS)
    keep = mb["response_mask"].bool()
    w = torch.randn(keep.shape, dtype=torch.float64)
    outs = {}
    for name, packed, share in (("padded", False, False), ("shared", True, True)):
        model = load_causal_lm(str(tmp_path), torch.float64, remove_padding=packed, chunked_logprobs=chunked,
                               share_prompts=share)
        logp, ent = forward_logprobs(model, mb, 0.8, with_entropy=True, entropy_grad=True)
        ((logp * w)[keep].sum() + 0.1 * (ent * w)[keep].sum()).backward()
        outs[name] = (logp, ent, param_grads(model))
    (lp_a, en_a, g_a), (lp_b, en_b, g_b) = outs["padded"], outs["shared"]
    torch.testing.assert_close(lp_b[keep], lp_a[keep], rtol=0, atol=1e-12)
    torch.testing.assert_close(en_b[keep], en_a[keep], rtol=0, atol=1e-12)
    assert (lp_b[~keep] == 0).all()  # the prompts' and padding's columns get none
    assert g_a.keys() == g_b.keys()
    # transformers' RMSNorm computes in float32 even for float64: a shared prompt position's gradient, summed
    # before its norm's backward instead of after, differs from its copies' sum at float32 rounding (~1e-7)
    for n in g_a:
        assert (g_b[n] - g_a[n]).norm() <= 1e-6 * g_a[n].norm(), n


def test_shared_prompts_give_the_critic_the_padded_values_and_gradients(tmp_path):
    from spmd_rl.model.loading import load_value_model
    from spmd_rl.train.critic import forward_values

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp_path)
    mb = grouped_batch(GROUPS, seed=2)
    keep = mb["response_mask"].bool()
    outs = []
    for packed, share in ((False, False), (True, True)):
        model = load_value_model(str(tmp_path), torch.float64, remove_padding=packed, share_prompts=share)
        nonzero_value_head(model)
        v = forward_values(model, mb)
        (v[keep] ** 2).sum().backward()
        outs.append((v, param_grads(model)))
    torch.testing.assert_close(outs[1][0][keep], outs[0][0][keep], rtol=0, atol=1e-12)
    assert (outs[1][0][~keep] == 0).all()
    for n in outs[0][1]:  # RMSNorm in float32: see test_shared_prompts_give_the_padded_log_probs_entropy_and_gradients
        assert (outs[1][1][n] - outs[0][1][n]).norm() <= 1e-6 * outs[0][1][n].norm(), n


def test_a_sliding_window_reaches_back_into_the_shared_prompt():
    """Gemma 3's windowed layers (window 4, shorter than the prompts): a response's first tokens see the
    prompt's last window - 1 tokens, as in the whole row."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from spmd_rl.model.loading import prepare_policy
    from spmd_rl.train.actor import forward_logprobs

    config = Gemma3TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    padded, shared = Gemma3ForCausalLM(config).double(), Gemma3ForCausalLM(config).double()
    shared.load_state_dict(padded.state_dict())
    prepare_policy(padded, remove_padding=False, chunked_logprobs=False)
    prepare_policy(shared, remove_padding=True, chunked_logprobs=True, share_prompts=True)
    mb = grouped_batch(GROUPS, seed=3)
    keep = mb["response_mask"].bool()
    want, _ = forward_logprobs(padded, mb, 1.0)
    got, _ = forward_logprobs(shared, mb.to("cpu"), 1.0)  # through Batch.to: laid out on the host's copy
    torch.testing.assert_close(got[keep], want[keep], rtol=0, atol=1e-12)


def test_the_update_and_the_log_prob_pass_with_shared_prompts_equal_whole_rows(tmp_path):
    """compute_logprobs and a token-budget ppo_update through shared prompts give the numbers of whole
    packed rows: the log-probs, the metrics and the gradient norm."""
    from spmd_rl.model.loading import load_causal_lm
    from spmd_rl.train.actor import compute_logprobs
    from spmd_rl.train.update import ppo_update

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp_path)
    batch = grouped_batch(GROUPS * 3, seed=1)
    cpu = torch.device("cpu")
    results = {}
    for share in (False, True):
        model = load_causal_lm(str(tmp_path), torch.float64, remove_padding=True, share_prompts=share)
        logp = compute_logprobs(model, batch, 1.0, 4, cpu, max_tokens=40)
        batch.tensors["advantages"] = torch.linspace(-1, 1, batch["input_ids"].numel()).view_as(logp).double()

        def loss_fn(mb, denom, model=model):
            from spmd_rl.train.actor import forward_logprobs

            lp, _ = forward_logprobs(model, mb, 1.0)
            loss = -(lp * mb["advantages"] * mb["response_mask"]).sum() / denom
            return loss, {"pg_loss": loss.detach()}

        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        metrics = ppo_update(model, opt, batch, loss_fn, mini_batch_size=len(batch), micro_batch_size=4, epochs=1,
                             grad_clip=0.0, loss_agg_mode="token-mean", device=cpu, max_tokens=40)
        results[share] = (logp, metrics)
    torch.testing.assert_close(results[True][0], results[False][0], rtol=0, atol=1e-6)  # float32 columns
    assert results[True][1]["pg_loss"] == pytest.approx(results[False][1]["pg_loss"], rel=1e-12)
    assert results[True][1]["grad_norm"] == pytest.approx(results[False][1]["grad_norm"], rel=1e-6)  # RMSNorm: above


# --------------------------------------------------------------------------- micro-batches by token budget


def test_a_prompts_rows_stay_together_within_the_budget_and_the_prompt_counts_once():
    g = torch.Generator().manual_seed(0)
    groups = [(int(torch.randint(5, 40, (), generator=g)), torch.randint(1, 60, (8,), generator=g).tolist())
              for _ in range(12)]
    batch = grouped_batch(groups)
    lengths = batch["attention_mask"].sum(-1).tolist()
    prompt_lens = batch["prompt_lens"].tolist()
    sets = prompt_sets(batch["input_ids"], lengths, prompt_lens)
    assert sets == [list(range(8 * i, 8 * i + 8)) for i in range(12)]
    budget = 300
    plan = plan_micro_batches(lengths, 4, budget, (prompt_lens, sets))
    assert sorted(r for mb in plan for r in mb) == list(range(96))
    fed = []
    for mb in plan:
        sub = batch.select(mb)
        fed.append(SharedPromptLayout(sub).num_tokens)
        # a prompt's rows are split only where the prompt's rows do not fit the budget together
        for rows in sets:
            inside = [r for r in rows if r in mb]
            if inside and len(inside) < len(rows):
                p = prompt_lens[rows[0]]
                assert p + sum(lengths[r] - p for r in rows) > budget
    assert max(fed) <= budget
    whole = plan_micro_batches(lengths, 4, budget)  # the same rows, prompts counted for every row
    assert len(plan) < len(whole)


def test_units_cut_a_prompts_rows_at_the_budget():
    lengths, prompt_lens = [10 + n for n in (5, 5, 5, 30)], [10] * 4
    got, costs = units(lengths, prompt_lens, [[0, 1, 2, 3]], 30)
    assert got == [[0, 1, 2], [3]] and costs == [25, 40]  # a row over the budget alone


def _agree_shared_body(rank, world):
    # rank 0: one prompt whose 6 short rows fit one micro-batch; rank 1 needs 3: rank 0 cuts its prompt's rows
    if rank == 0:
        batch = grouped_batch([(4, [2] * 6)])
    else:
        batch = grouped_batch([(4, [90, 90]), (5, [90, 90]), (6, [90, 90])], seed=rank)
    plans = [rows for rows, _ in iter_micro_batches(batch, 2, 200, share_prompts=True)]
    assert len(plans) == 3, plans
    assert sorted(r for mb in plans for r in mb) == list(range(6))


def test_the_micro_batch_count_is_agreed_across_ranks_with_shared_prompts():
    run_distributed(_agree_shared_body, 2)


# --------------------------------------------------------------------------- config


def test_shared_prompts_need_packing_and_no_sequence_parallelism():
    from spmd_rl import preflight
    from spmd_rl.config.run_config import config_from_dict
    from spmd_rl.errors import ConfigError

    base = {"model": {"init": "random", "arch": "tiny", "tokenizer": "char", "share_prompts": True}}
    with pytest.raises(ConfigError, match="model.share_prompts = true feeds prompts once in packed rows"):
        preflight.validate(config_from_dict(base))
    cfg = config_from_dict({**base, "model": {**base["model"], "remove_padding": True},
                            "trainer": {"ulysses_size": 2}})
    with pytest.raises(ConfigError, match="which shared prompts"):
        cfg.trainer.check_ulysses(cfg, 2)
