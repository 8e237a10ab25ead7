"""A streamed run: requests added to vLLM's engine that the caller advances a few engine steps at a time
and stops, keeping what every unfinished request has generated so far (partial rollouts:
spmd_rl/rollout/partial.py).

`LLM.generate` runs its requests to the end. A streamed run drives the same `LLMEngine` itself
(`add_request`, `step`, `abort_request`), as `generate` does inside. Its requests ask for DELTA outputs
(VLLMEngine.start sets them), so a request's output carries the tokens (and their log-probs) that are new
since its last one, and the run appends them; `stop` aborts the unfinished requests and hands back their
tokens so far. vLLM sends a running request's new tokens every `stream_interval` tokens (an engine
argument, set by spmd_rl.rollout.vllm.engine.engine_kwargs with partial rollouts), so up to
stream_interval - 1 of an aborted request's last tokens never arrive: they go with it, and the response
samples them again when it goes on.

Collective like `generate`: every rank of a tensor-parallel group holds the group's requests and makes
the same calls, so the ranks' engines step in lockstep; a rank returns only its own requests. `add`
puts more requests into the running run (partial rollouts' refill), gathered over the group as `start`
gathers its first ones; a rank's indices run on over its requests of every add.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from spmd_rl.rollout.base import Completion
from spmd_rl.rollout.vllm.outputs import finish_reason, paused_gc, routes, sampled_logprobs


class StreamedRun:
    """The run of one call of VLLMEngine.start (the EngineRun protocol of spmd_rl/rollout/base.py)."""

    def __init__(self, engine: Any, prompts: list[Any], params: list[Any], asks: list[bool], mine: range,
                 id_prefix: str, lora_request: Any = None, num_experts: int = 0, pause_gc: bool = True,
                 on_stop: Callable[[list[int]], None] | None = None, group: Callable[..., tuple] | None = None):
        """`engine`: vLLM's LLMEngine; `prompts` (vLLM's token inputs), `params` (vLLM SamplingParams asking
        for DELTA outputs) and `asks` (whether each asks for log-probs): the tensor-parallel group's
        requests; `mine`: this rank's among them; `id_prefix`: their request ids' (unique per run);
        `on_stop`: given, at the stop, the tokens each request that finished generated in the run;
        `group(prompts, sampling, max_new_tokens, asks_logprobs)`: the group's requests of an `add`, as
        (prompts, params, asks, mine) like the first ones (VLLMEngine.start's)."""
        self.engine, self.on_stop, self.group, self.id_prefix = engine, on_stop, group, id_prefix
        self.num_experts, self.pause_gc = num_experts, pause_gc
        self.lora = {"lora_request": lora_request} if lora_request is not None else {}
        self.ids: list[str] = []
        self.index: dict[str, int] = {}
        self.mine: dict[int, int] = {}  # this rank's requests: index in the run -> index among its prompts
        self.asks: list[bool] = []
        self.tokens: list[list[int]] = []
        self.logprobs: list[list[float] | None] = []
        self.finished: list[str] = []
        self.routes: dict[int, torch.Tensor | None] = {}  # a finished request's routing (Completion.routes)
        self._add(prompts, params, asks, mine)

    def add(self, prompts: list[list[int]], sampling: Any, max_new_tokens: list[int] | None = None,
            asks_logprobs: list[bool] | None = None) -> None:
        """More requests of this rank into the running run (collective within the tensor-parallel group,
        like VLLMEngine.start); their indices follow this rank's earlier ones."""
        if self.group is None:
            raise RuntimeError("this streamed run was started without a way to add requests")
        self._add(*self.group(prompts, sampling, max_new_tokens, asks_logprobs))

    def _add(self, prompts: list[Any], params: list[Any], asks: list[bool], mine: range) -> None:
        first, mine_first = len(self.ids), len(self.mine)
        for k, (prompt, sp, ask) in enumerate(zip(prompts, params, asks)):
            j = first + k
            self.ids.append(f"{self.id_prefix}{j}")
            self.index[self.ids[-1]] = j
            self.asks.append(ask)
            self.tokens.append([])
            self.logprobs.append([] if ask else None)
            self.finished.append("")
            self.engine.add_request(self.ids[-1], prompt, sp, **self.lora)
        self.mine.update({first + k: mine_first + k - mine.start for k in mine})

    def advance(self, steps: int) -> list[tuple[int, Completion]]:
        """Up to `steps` engine steps (fewer once nothing runs): the requests of this rank that finished
        in them, as (index among this rank's prompts, its completion)."""
        done: list[int] = []
        with paused_gc(self.pause_gc):
            for _ in range(steps):
                if not self.engine.has_unfinished_requests():
                    break
                for out in self.engine.step():
                    j = self.index.get(out.request_id)
                    if j is None:  # not this run's (nothing else runs while it does)
                        continue
                    self._append(j, out.outputs[0])
                    if out.finished:
                        done.append(j)
        return [(self.mine[j], self._completion(j)) for j in done if j in self.mine]

    def stop(self) -> list[tuple[int, Completion]]:
        """Abort the unfinished requests: each of this rank's, with its tokens and log-probs so far
        (finish_reason "")."""
        left = [rid for rid, j in self.index.items() if not self.finished[j]]
        if left:
            self.engine.abort_request(left)
        if self.on_stop is not None:
            self.on_stop([len(t) for t, reason in zip(self.tokens, self.finished) if reason])
        return [(i, self._completion(j)) for j, i in self.mine.items() if not self.finished[j]]

    # ------------------------------------------------------------------ internals
    def _append(self, j: int, out: Any) -> None:
        """A DELTA output's new tokens (and log-probs), and its finish reason and routing once finished."""
        ids = list(out.token_ids)
        self.tokens[j] += ids
        if ids and self.asks[j]:
            self.logprobs[j] += sampled_logprobs(ids, out.logprobs)
        if out.finish_reason is not None:
            self.finished[j] = finish_reason(out)
            self.routes[j] = routes(out, self.num_experts)

    def _completion(self, j: int) -> Completion:
        lps = self.logprobs[j]
        return Completion(list(self.tokens[j]), None if lps is None else list(lps), self.finished[j],
                          routes=self.routes.get(j))
