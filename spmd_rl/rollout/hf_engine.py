"""A rollout engine on transformers' `generate`, for CPU runs and tests.

It keeps its own plain (unsharded) copy of the policy and is refreshed through the same
streaming `load_weights` as the vLLM engine, so CPU tests exercise the real weight-sync path.

`return_routes` (actor.router_replay = "engine" on a mixture-of-experts model): every completion
carries the routing of its prompt and response tokens (`Completion.routes`), recorded by a
teacher-forced forward of prompt + response through the engine's own model after generating
(spmd_rl.model.routing.capture): the experts the same weights choose for the same tokens.
"""

from __future__ import annotations

from typing import Iterable

import torch

from spmd_rl.model import lora, routing
from spmd_rl.rollout.base import Completion, SamplingParams
from spmd_rl.rollout.weight_sync import checkpoint_buffers


class HFEngine:
    def __init__(self, model: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int],
                 device: torch.device, max_batch_size: int = 256, return_routes: bool = False):
        self.model = model.to(device).eval()
        self.return_routes = return_routes and routing.install(self.model) > 0
        self.params = dict(self.model.named_parameters()) | dict(checkpoint_buffers(self.model))  # what a sync loads
        self.pad_token_id = pad_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.max_batch_size = max_batch_size

    # The copy lives as long as the engine; there is no separate memory pool to give back.
    def sleep(self) -> None:
        pass

    def wake_up(self, tags: list[str] | None = None) -> None:
        pass

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Transformers-named full tensors; a module with PEFT's LoRA layer takes them in its base layer."""
        wrapped = set(lora.lora_layers(self.model)) if lora.has_adapter(self.model) else set()
        for name, tensor in weights:
            name = lora.base_layer_name(name, wrapped)
            if name not in self.params:
                raise KeyError(f"weight {name!r} has no parameter in the rollout model")
            self.params[name].copy_(tensor)

    @torch.no_grad()
    def load_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        """The adapter under PEFT's saved names (spmd_rl.model.lora.peft_tensor_name), into the
        engine's own LoRA layers, rounded to their dtype as vLLM's lora_dtype rounds it."""
        if not lora.has_adapter(self.model):
            raise RuntimeError("load_adapter needs an engine built for the adapter sync (model.lora_rank > 0, "
                               'model.lora_sync = "adapter")')
        for name, tensor in tensors.items():
            own = lora.engine_adapter_name(name)
            if own not in self.params:
                raise KeyError(f"adapter tensor {name!r} has no parameter in the rollout model")
            self.params[own].copy_(tensor)

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, max_new_tokens: list[int] | None = None,
                 asks_logprobs: list[bool] | None = None) -> list[list[Completion]]:
        out: list[list[Completion]] = []
        per_call = max(1, self.max_batch_size // sampling.n)
        limits, asks = sampling.per_prompt(len(prompts), max_new_tokens, asks_logprobs)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(sampling.seed)
            for i in range(0, len(prompts), per_call):
                out += self._generate_chunk(prompts[i:i + per_call], sampling, limits[i:i + per_call],
                                            asks[i:i + per_call])
        return out

    def _generate_chunk(self, prompts: list[list[int]], sp: SamplingParams, limits: list[int],
                        asks: list[bool]) -> list[list[Completion]]:
        """Completions of `prompts`, with log-probs for those whose `asks` is true (None for the
        others). Generates up to the chunk's largest limit and cuts each row at its own: sampling is
        causal, so a row cut at k tokens is what a call with max_new_tokens = k would have sampled."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: generation continues every row at the end
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        stop = [] if sp.ignore_eos else self.eos_token_ids + list(sp.stop_token_ids)
        kwargs = dict(do_sample=not sp.greedy, max_new_tokens=max(limits), eos_token_id=stop or None,
                      pad_token_id=self.pad_token_id, num_return_sequences=sp.n, output_logits=any(asks),
                      return_dict_in_generate=True)
        if not sp.greedy:
            kwargs.update(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0)
        res = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs)
        new = res.sequences[:, width:].cpu()
        logps = None
        if any(asks):  # log p of the sampled token under logits / temperature: what the actor computes
            temperature = sp.temperature if not sp.greedy else 1.0
            logits = torch.stack(res.logits, dim=1).float().cpu() / temperature
            logps = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0]
        stop_set = set(stop)
        completions = []
        for row in range(new.shape[0]):  # rows: the n completions of each prompt, consecutive
            tokens = new[row].tolist()[:limits[row // sp.n]]
            end, reason = len(tokens), "length"
            for j, t in enumerate(tokens):
                if t in stop_set:
                    end, reason = j + 1, "stop"
                    break
            lp = logps[row, :end].tolist() if asks[row // sp.n] else None
            completions.append(Completion(tokens[:end], lp, reason))
        if self.return_routes:
            self._add_routes([prompts[row // sp.n] for row in range(len(completions))], completions)
        return [completions[k * sp.n:(k + 1) * sp.n] for k in range(len(prompts))]

    def _add_routes(self, prompts: list[list[int]], completions: list[Completion]) -> None:
        """Each completion's routes: one forward of the rows prompt + response, right-padded, with
        the routers' choices captured."""
        rows = [p + c.token_ids for p, c in zip(prompts, completions)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        with routing.capture(self.model) as got:
            self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False)
        routes = got.routes.cpu().view(len(rows), width, *got.routes.shape[1:])
        for i, (r, c) in enumerate(zip(rows, completions)):
            c.routes = routes[i, :len(r)].clone()
