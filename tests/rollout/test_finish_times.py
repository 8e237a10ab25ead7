"""spmd_rl/rollout/finish_times.py: the tail of a step's generate calls, from when their requests finish,
recorded through vLLM's progress-bar hook (driven here the way vLLM 0.26's LLM.generate drives it;
through vLLM itself: gpu_check's training runs)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from spmd_rl.rollout.base import SamplingParams
from spmd_rl.rollout.finish_times import GenerateTail
from tests.helpers.stand_in_vllm import stand_in_engine


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def vllm_generate(use_tqdm, prompts: list, finish_at: list[float], n: int, clock: Clock) -> None:
    """What vLLM 0.26's LLM.generate does with a callable `use_tqdm` (entrypoints/offline_utils.py and
    utils/tqdm_utils.py): it wraps the prompts it renders in one bar, then makes a bar over the engine's
    requests and, as each output finishes (here: prompt i at finish_at[i]), reads the bar's elapsed time,
    sets its postfix, updates it by the output's sample count and refreshes it when all are in."""
    for _ in use_tqdm(prompts, desc="Rendering prompts"):
        clock.t += 0.001
    pbar = use_tqdm(total=len(prompts) * n, desc="Processed prompts", dynamic_ncols=True,
                    postfix=f"est. speed input: {0:.2f} toks/s, output: {0:.2f} toks/s")
    for t in sorted(finish_at):
        clock.t = t
        _ = pbar.format_dict["elapsed"]
        pbar.postfix = "est. speed input: 1.00 toks/s, output: 1.00 toks/s"
        pbar.update(n)
        if pbar.n == len(prompts) * n:
            pbar.refresh()
    pbar.close()


def test_the_tail_of_the_steps_calls_is_the_wall_after_90_percent_of_each_calls_samples():
    clock = Clock()
    tail = GenerateTail(clock)
    # call 1 from t = 0: ten prompts of one sample, nine done by t = 9, the last at 30; returns at 30.5
    bar = tail.progress_bar()
    vllm_generate(bar, list(range(10)), [1, 2, 3, 4, 5, 6, 7, 8, 9, 30], 1, clock)
    clock.t = 30.5
    tail.done()
    assert tail.calls[0].finishes == [1, 2, 3, 4, 5, 6, 7, 8, 9, 30]  # one a sample, none from rendering
    # call 2 from t = 40: five prompts of one sample, done at 41, 42, 43, 44, 45; returns at 45
    clock.t = 40.0
    vllm_generate(tail.progress_bar(), list(range(5)), [41.0, 42.0, 43.0, 44.0, 45.0], 1, clock)
    tail.done()
    # after the 9th of 10 finishes (t = 9): 21.5 s of 30.5; after the 5th of 5 (ceil(4.5)): 0 s of 5
    assert tail.metrics() == {"rollout/generate_tail_share": pytest.approx((21.5 + 0.0) / (30.5 + 5.0))}
    assert tail.metrics() == {}  # read once: the next step's calls start afresh


def test_a_call_that_raised_or_finished_nothing_gives_no_share():
    clock = Clock()
    tail = GenerateTail(clock)
    tail.progress_bar()  # the call raised before done()
    tail.progress_bar()
    tail.done()  # returned with nothing finished
    assert tail.metrics() == {}


class _LLM:
    """Stands in for vllm.LLM: generate answers each prompt with `n` samples of 3 tokens, finishing the
    prompts at `finish_at` on the shared clock, through the progress bar it is given."""
    clock = Clock()
    finish_at: list[float] = []

    def __init__(self, **kwargs):
        pass

    def sleep(self, level):
        pass

    def generate(self, prompts, sps, use_tqdm=False, **kw):
        vllm_generate(use_tqdm, prompts, self.finish_at, sps[0].n, self.clock)
        return [SimpleNamespace(outputs=[SimpleNamespace(index=i, token_ids=[5, 6, 7], logprobs=None,
                                                         finish_reason="length", stop_reason=None)
                                         for i in range(sp.n)]) for sp in sps]


class _SamplingParams(SimpleNamespace):
    pass


def test_the_vllm_engine_reports_the_tail_of_its_generate_calls(monkeypatch, tmp_path):
    _LLM.clock.t, _LLM.finish_at = 0.0, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 10.0]
    with stand_in_engine(monkeypatch, tmp_path, _LLM, _SamplingParams, ["rollout.tensor_parallel_size=1",
                         "rollout.max_num_seqs=64"], config={"hidden_size": 64}) as engine:
        monkeypatch.setattr(engine, "_check_ready", lambda: None)
        engine.tail.clock = _LLM.clock
        out = engine.generate([[1, 2]] * 10, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs_every=0))
        metrics = engine.scheduling_metrics()
    assert [len(g) for g in out] == [2] * 10
    # 20 samples, the 18th (90%) finished at t = 1 of a call from t = 0 (rendering: 0.01) to t = 10
    assert metrics == {"rollout/generate_tail_share": pytest.approx(9.0 / 10.0)}
