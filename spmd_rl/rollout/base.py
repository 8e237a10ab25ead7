"""The rollout-engine interface: what the trainer needs from an inference engine.

Token ids in; token ids, per-token sampled log-probs (of the prompts that ask for them) and a
finish reason out. The engine owns a copy of the policy weights that the trainer refreshes every
step with `load_weights`, streamed from the FSDP shards (spmd_rl/rollout/weight_sync.py). Engines that
share the GPU with training (vLLM) free their memory in `sleep()` and take it back in `wake_up()`.

The trainer's call order each step, for every engine:

    engine.wake_up(["weights"])         # memory for the weights only
    engine.load_weights(stream)         # iterator of (hf_name, full tensor), a bucket at a time
    engine.wake_up(["kv_cache"])        # now the KV cache (no forward pass before this)
    outputs = engine.generate(prompts, sampling)
    engine.sleep()

With LoRA's adapter sync (model.lora_sync = "adapter") the first sync's `load_weights` gives the
base alone and every sync calls `engine.load_adapter(tensors)` with the adapter (PEFT's names, full
tensors) before the KV cache wakes; the engine keeps the base across sleeps.

Log-probs are of the *sampled* token under logits / temperature (what the actor computes),
so the training/inference mismatch metric compares like with like.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch


@dataclass
class SamplingParams:
    """Sampling settings of one generate call (built from RolloutConfig)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0
    """Seed of this call's sampling; the trainer derives it from (trainer.seed, step, replica)
    so a resumed run samples exactly what an uninterrupted one would."""
    ignore_eos: bool = False
    """Every response runs to its token limit: the stop tokens (the model's and stop_token_ids) end
    nothing (rollout.length_profile's benchmarks)."""
    logprobs_every: int = 1
    """Which prompts' completions carry log-probs (`asks_logprobs`): 1 = every prompt, k = prompts
    0, k, 2k, ... of the caller's list, 0 = none. The others' `Completion.logprobs` is None: asking
    costs the engine time (Config.rollout_logprobs_plan says who needs them)."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def per_prompt(self, count: int, max_new_tokens: list[int] | None = None,
                   asks_logprobs: list[bool] | None = None) -> tuple[list[int], list[bool]]:
        """Each of `count` prompts' token limit and whether it asks for log-probs: the caller's lists
        (RolloutEngine.generate's arguments), or this call's max_new_tokens and `asks_logprobs` rule."""
        return (list(max_new_tokens) if max_new_tokens else [self.max_new_tokens] * count,
                list(asks_logprobs) if asks_logprobs is not None else self.asks_logprobs(count))

    def asks_logprobs(self, count: int) -> list[bool]:
        """For each of `count` prompts of one caller (a rank), whether its completions get log-probs:
        with any prompt at all, the first one always does when logprobs_every > 0."""
        return [self.logprobs_every > 0 and i % self.logprobs_every == 0 for i in range(count)]


@dataclass
class Completion:
    """One sampled response to one prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    """log p(token_t | prefix) under logits / temperature (greedy: temperature 1); None when its
    prompt did not ask for them (SamplingParams.logprobs_every)."""
    finish_reason: str
    """"stop" (EOS or a stop token, which is included in token_ids) or "length"; "" for a request an
    engine run stopped before its end (EngineRun.stop)."""
    mask: list[int] | None = None
    """Multi-turn trajectories (spmd_rl/rollout/multiturn/): 1 on the tokens the model sampled, 0 on
    the tool/environment tokens between its turns (their log-probs are 0). None: every token is
    the model's (a single-turn response)."""
    reward: float | None = None
    """Multi-turn: the environment's reward for the trajectory, when it gave one (otherwise the
    reward function scores the response)."""
    messages: list[dict] | None = None
    """Multi-turn: the trajectory after the prompt as chat messages (the model's turns as assistant
    messages, the tool / environment messages between them), for a reward model. None: single-turn."""
    routes: torch.Tensor | None = None
    """A mixture-of-experts engine's routing (actor.router_replay = "engine"): int16 [n, layers,
    top_k], the experts each of the row's first n tokens (prompt, then response) went through,
    spmd_rl.model.routing.NO_ROUTE where it gave none. n may be short of the row (vLLM never feeds
    the last sampled token). None: the engine gave no routing."""

    def copy(self) -> "Completion":
        return Completion(list(self.token_ids), None if self.logprobs is None else list(self.logprobs),
                          self.finish_reason, None if self.mask is None else list(self.mask), self.reward,
                          None if self.messages is None else [dict(m) for m in self.messages], self.routes)


class EngineRun(Protocol):
    """Requests an engine runs until the caller stops them (partial rollouts, spmd_rl/rollout/partial.py):
    what an engine's optional `start(prompts, sampling, max_new_tokens, asks_logprobs)` returns, with
    the arguments of `generate` and one completion per prompt. Collective like generate."""

    def advance(self, steps: int) -> list[tuple[int, Completion]]:
        """Up to `steps` more tokens per running request: the requests that finished in them, as
        (index among the caller's prompts, its completion)."""

    def add(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
            asks_logprobs: list[bool] | None = None) -> None:
        """More requests into the running run, as `start` takes them; their indices follow the earlier
        ones (partial rollouts' refill)."""

    def stop(self) -> list[tuple[int, Completion]]:
        """End the run: every unfinished request, with its tokens and log-probs so far (finish_reason "")."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
                 asks_logprobs: list[bool] | None = None) -> list[list[Completion]]:
        """For each prompt (token ids), `sampling.n` completions. Every rank calls this with its own
        prompts; engines with tensor parallelism gather their group's prompts themselves.
        `max_new_tokens`: a limit per prompt (<= sampling.max_new_tokens) instead of the call's;
        `asks_logprobs`: per prompt, whether its completions get log-probs, instead of
        `sampling.asks_logprobs` (a multi-turn trajectory keeps its choice over its turns)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy full (unsharded) tensors, named as in the Hugging Face model, into the engine."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take GPU memory back: tags None = everything, or "weights" / "kv_cache"."""

    def sleep(self) -> None:
        """Give GPU memory back until the next wake_up."""
