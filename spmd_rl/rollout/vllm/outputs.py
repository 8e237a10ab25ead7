"""vLLM's request outputs turned into Completions, and the log-prob request that makes them cheap.

Holds for vLLM 0.26 (a slim build for Hopper). What costs time there when a request asks
for log-probs (`logprobs=0`: the sampled token's only), measured in docs/performance.md ("Generation
against plain vLLM", "Why the defaults are what they are") and read from vLLM's source:
- on the GPU, once any request of a decode step asks, the sampler runs a log-softmax and a rank
  kernel over the whole batch's logits (vllm/v1/worker/gpu/sample/logprob.py), small next to the
  model;
- on the CPU, for every token of every request that asked, the output processor appends the
  log-prob to the request's container (vllm/v1/engine/logprobs.py). By default the container is
  a list of one `{token_id: Logprob}` dict per token: two tracked objects per token, so the
  garbage collector runs often and scans them while the engine waits. `flat_logprobs=True`
  (SamplingParams; engines without the field get the dicts) keeps plain lists of ints and floats
  instead (`FlatLogprobs`), which the collector does not track; pausing the collector during the
  call removes the rest.

`completion` reads both containers: a `FlatLogprobs` asked with `logprobs=0` holds exactly one
entry per position (the sampled token first, vllm/logprobs.py `append_logprobs_for_next_position`),
so its `logprobs` list is the answer as it is.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

import numpy as np
import torch

from spmd_rl.rollout.base import Completion


def supports_flat_logprobs(sampling_params_cls: Any) -> bool:
    """Whether this vLLM's SamplingParams (a msgspec Struct) has `flat_logprobs`."""
    return "flat_logprobs" in getattr(sampling_params_cls, "__struct_fields__", ())


def logprob_request(asks: bool, flat: bool) -> dict[str, Any]:
    """SamplingParams keywords of a request: the sampled token's log-prob (`logprobs=0`), in flat
    lists when `flat`, or none (`logprobs=None`)."""
    if not asks:
        return {"logprobs": None}
    return {"logprobs": 0, "flat_logprobs": True} if flat else {"logprobs": 0}


@contextlib.contextmanager
def paused_gc(pause: bool = True) -> Iterator[None]:
    """The cyclic garbage collector off for the block (`pause`), back on after it, also on an error,
    if it was on before. Reference counting still frees what the block drops; what a cycle holds
    waits for the next collection after it."""
    was_on = gc.isenabled()
    if pause:
        gc.disable()
    try:
        yield
    finally:
        if pause and was_on:
            gc.enable()


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from a CompletionOutput's `logprobs`: a FlatLogprobs
    (flat lists; `start_indices[i]` is position i's first entry, the sampled token) or a list of
    `{token_id: Logprob}` per position."""
    n = 0 if logprobs is None else len(logprobs)
    if n != len(token_ids):
        raise RuntimeError(f"vLLM returned {n} log-probs for {len(token_ids)} tokens")
    starts = getattr(logprobs, "start_indices", None)
    if starts is None:
        return [float(pos[t].logprob) for pos, t in zip(logprobs, token_ids)]
    values, tokens = logprobs.logprobs, logprobs.token_ids
    if len(values) != len(token_ids):  # more than the sampled token at some position (logprobs > 0)
        values, tokens = [values[s] for s in starts], [tokens[s] for s in starts]
    if tokens != token_ids:
        raise RuntimeError("vLLM's flat log-probs are not those of the sampled tokens")
    return values


def routes(out: Any, num_experts: int = 0) -> torch.Tensor | None:
    """A CompletionOutput's routed experts (`enable_return_routed_experts`: a numpy array [tokens,
    layers, top_k] of uint8 / uint16) as int16 (spmd_rl.model.routing), None when it has none. With
    `num_experts`, an expert id outside [0, num_experts) is refused here, on the host, in one line:
    replayed, it would index past the trainer's experts on the GPU (a device-side assert)."""
    arr = getattr(out, "routed_experts", None)
    if arr is None:
        return None
    arr = np.ascontiguousarray(arr)
    if num_experts and arr.size and int(arr.max()) >= num_experts:
        raise RuntimeError(f"vLLM returned expert {int(arr.max())} among a request's routes, for a model of "
                           f"{num_experts} experts: its routes are not this model's; set actor.router_replay "
                           '= "off" to train without them')
    return torch.from_numpy(arr.astype(np.int16))


def finish_reason(out: Any) -> str:
    """A finished CompletionOutput's reason, "stop" or "length"; any other (an abort) is refused."""
    if out.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM finished a request with reason {out.finish_reason!r} (aborted?)")
    return out.finish_reason


def completion(out: Any, asked: bool, num_experts: int = 0) -> Completion:
    """Our Completion of a vLLM CompletionOutput; log-probs when its request `asked` for them, and
    the routed experts of its prompt and generated tokens when the engine returns them (each below
    `num_experts` where given: `routes`)."""
    ids = list(out.token_ids)
    return Completion(token_ids=ids, logprobs=sampled_logprobs(ids, out.logprobs) if asked else None,
                      finish_reason=finish_reason(out), routes=routes(out, num_experts))
