"""The training loop: every rank runs this same code (SPMD).

One step:
  1. sync    stream the actor's FSDP shards into the rollout engine (wake weights -> load -> wake KV)
  2. rollout generate n responses per prompt for this rank's prompts, then put the engine to sleep
  3. reward  score the responses (rule scorers by data source, or the user's function; a reward
             model's score added, model/reward_model.py);
     balance  move rows between ranks so each holds about as many tokens (rank_balance.py)
  4. score   old log-probs (actor; on-policy steps take them from the update's forward instead,
             old_logprobs.py), reference log-probs, values (critic)
  5. adv     token rewards (+ KL penalty), advantages (GAE / GRPO / RLOO / REINFORCE++)
  6. update  critic, then actor: ppo_epochs x mini-batches x micro-batches
  7. log, validate, checkpoint, honour a stop signal

What the trainer composes (data, models, rollout engine) is built by spmd_rl/build.py.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import random
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from spmd_rl.algo import algorithms as algos
from spmd_rl.algo.dynamic_sampling import collect_informative_groups
from spmd_rl.algo.rollout_correction import actor_update_batch, mismatch_metrics
from spmd_rl.algo.val_metrics import prompt_means, prompt_sums
from spmd_rl.batching import sequence_parallel
from spmd_rl.batching.batch import Batch, build_rollout_batch, response_token_ids
from spmd_rl.batching.rank_balance import balance_ranks, mini_batch_block_rows
from spmd_rl.build import build_data, build_engine, build_models, check_memory, resume_target
from spmd_rl.checkpoint.checkpointer import Checkpointer, ModelAndOptimizer, saved_world_size
from spmd_rl.config.run_config import Config
from spmd_rl.config.toml_io import to_toml
from spmd_rl.data.prompts import iter_eval_batches
from spmd_rl.data.rewards import RewardFunction, extract_answer
from spmd_rl.exit_codes import EXIT_NOT_SAVED
from spmd_rl.model import fused_kernels, routing
from spmd_rl.model.loading import update_flops_per_token
from spmd_rl.model.lora import adapter_disabled
from spmd_rl.model.reward_model import conversation
from spmd_rl.model.tokenizer import decode_response
from spmd_rl.preflight.memory import OutOfMemory, out_of_memory_message
from spmd_rl.rollout import length_profile, partial
from spmd_rl.rollout.base import SamplingParams
from spmd_rl.rollout.multiturn import MultiTurnRollout, merge_trajectory_metrics
from spmd_rl.rollout.weight_sync import gather_adapter, iter_base_weights, iter_weights
from spmd_rl.runtime.distributed import DistEnv, all_reduce_mean, all_reduce_metrics, all_reduce_sum
from spmd_rl.runtime.gpu_memory import PhaseMemory, allocator_lines_held, free_after_sleep_bytes, is_out_of_memory
from spmd_rl.runtime.memory_plan import MemoryPlan
from spmd_rl.runtime.preemption import StopFlag
from spmd_rl.telemetry import run_summary
from spmd_rl.telemetry.metrics import MetricsLogger, rank_reduction, summary_line
from spmd_rl.telemetry.progress import StepClock
from spmd_rl.telemetry.reward_errors import RewardErrorWarning
from spmd_rl.telemetry.samples import SampleLog
from spmd_rl.telemetry.startup import startup_clock
from spmd_rl.telemetry.step_profiler import phase_range, profiled_step
from spmd_rl.train.actor import actor_loss_fn, compute_logprobs
from spmd_rl.train.critic import compute_values, critic_loss_fn
from spmd_rl.train.offload import TrainStateOffload
from spmd_rl.train.old_logprobs import UpdateLogprobs
from spmd_rl.train.update import ppo_update

log = logging.getLogger("spmd_rl")


class PhaseTimer:
    """Seconds and GPU memory per named phase of a step (memory figures: gpu_memory.PhaseMemory).
    An out-of-memory error inside a phase, PyTorch's or vLLM's (gpu_memory.is_out_of_memory), becomes
    one line naming it (preflight.memory.OutOfMemory), printed by every rank that has it (spmd_rl/ppo.py)."""

    def __init__(self, device: torch.device, plan: MemoryPlan | None = None):
        self.device = device
        self.plan = plan  # the start-up prediction, for the out-of-memory line
        self.metrics: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        memory = PhaseMemory(self.device) if self.device.type == "cuda" else None
        t0 = time.perf_counter()
        with phase_range(name):  # the phase in a profiled step's trace (trainer.profile_steps)
            try:
                yield
            except (torch.OutOfMemoryError, RuntimeError) as e:
                if not is_out_of_memory(e):
                    raise
                raise OutOfMemory(out_of_memory_message(name, self.plan, e)) from None
        if memory is not None:
            self.metrics.update(memory.end(name))
        self.metrics[f"time/{name}"] = self.metrics.get(f"time/{name}", 0.0) + time.perf_counter() - t0


def sampling_seed(seed: int, step: int, replica: int) -> int:
    """Sampling seed of a step: a function of the step, so a resumed run samples the same."""
    return (seed * 1_000_003 + step * 9_973 + replica) % 2**31


class Trainer:
    def __init__(self, cfg: Config, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.device = env.device
        self.run_dir = cfg.run_dir
        self.step = 0
        self.stop = StopFlag.install()
        self.startup = startup_clock()  # logs each phase's seconds; time/startup_* in the first step
        self.checkpointer = Checkpointer(cfg.checkpoint_dir, cfg.trainer.keep_last, cfg.trainer.async_save,
                                         run_dir=self.run_dir)
        self.resume_path = resume_target(self.checkpointer, cfg.trainer.resume)
        # each GPU's predicted peak, one line; a run that cannot fit stops before any model loads
        self.memory_plan = check_memory(cfg, env)
        self.reward_fn = RewardFunction(cfg.reward, defer_errors=True)  # raised by sync_failures, on every rank
        self.reward_warning = RewardErrorWarning(cfg.reward.warn_error_share)
        with self.startup("data"):
            self.tokenizer, self.train_data, self.val_data, self.sampler = build_data(cfg, env, self.reward_fn)
            # rollout.tools / rollout.environment: trajectories of several turns (spmd_rl/rollout/multiturn/)
            self.multi_turn = MultiTurnRollout(cfg.rollout, self.tokenizer) if cfg.rollout.multi_turn else None
        models = build_models(cfg, env, self.tokenizer, self.resume_path is not None, self.startup)
        self.actor, self.actor_opt, self.actor_sched = models.actor, models.actor_opt, models.actor_sched
        self.ref, self.active_params = models.ref, models.active_params
        self.reward_model = models.reward_model  # reward_model.path: model.reward_model.RewardModel
        self.critic, self.critic_opt, self.critic_sched = models.critic, models.critic_opt, models.critic_sched
        self.train_offload = TrainStateOffload(self.device)  # rollout.offload_train_states' host buffers
        # after every input check (data, tokenizer, model files): a run refused for one of them must
        # not add files (TensorBoard events) to an existing run_dir
        self.metrics = MetricsLogger(self.run_dir, env.is_main, cfg.trainer.tensorboard)
        self.samples = SampleLog(self.run_dir, env.is_main, cfg.trainer.log_samples, cfg.trainer.log_samples_every,
                                 self.tokenizer, self.metrics)
        with self.startup("engine"):
            self.engine, self.engine_dtype, self.engine_replica = build_engine(cfg, env, models.model_dir,
                                                                              models.model_key, self.tokenizer)
        self.partial = partial.from_config(cfg, env.world_size, self.device)  # rollout.partial_rollouts
        self.length_profile = (length_profile.parse(cfg.rollout.length_profile) if cfg.rollout.length_profile
                               else None)  # benchmarks' response lengths
        self.engine_has_base = False  # LoRA's adapter sync: the base goes in at the first sync only
        self.kl_ctrl = (algos.AdaptiveKLController(cfg.algorithm.kl_coef, cfg.algorithm.target_kl, cfg.algorithm.kl_horizon)
                        if cfg.algorithm.kl_ctrl == "adaptive" else algos.FixedKLController(cfg.algorithm.kl_coef))
        if env.is_main:
            with open(os.path.join(self.run_dir, "config.toml"), "w") as f:
                f.write(to_toml(cfg, cfg.toml_notes()))
            self.metrics.log_text("config", to_toml(cfg, cfg.toml_notes()))
        with self.startup("checkpoint_load"):
            self._resume()
        # the bytes of a save, keep_last, the peak on disk, the free space: one line, a warning if they do not fit
        self.checkpointer.log_space_plan(self._stateful(), self._trainer_state())
        self.startup.finish()

    # ------------------------------------------------------------------ checkpoints
    def _stateful(self) -> dict:
        # a LoRA actor's checkpoint holds its adapter and the adapter's optimizer (the base is in model.path)
        models = {"actor": ModelAndOptimizer(self.actor, self.actor_opt, trainable_only=self.cfg.model.use_lora)}
        if self.critic is not None:
            models["critic"] = ModelAndOptimizer(self.critic, self.critic_opt)
        return models

    def _trainer_state(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "actor_sched": self.actor_sched.state_dict(),
                "critic_sched": self.critic_sched.state_dict() if self.critic_sched else None,
                "kl_ctrl": self.kl_ctrl.state_dict(), "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate()}

    def save_checkpoint(self, wait: bool = False) -> bool:
        """Checkpoint the current step; `wait`: return only once it is complete (end of the run).
        False: it is not written (skipped for lack of disk space, or its write failed: the
        checkpointer logged why, and the previous complete checkpoint stays the latest); True: it
        is complete (`wait`) or being written in the background."""
        if self.partial is not None:  # the carried-over groups are not saved: a resume goes on without them
            self.partial.drop_all()
        t0 = time.perf_counter()
        path = self.checkpointer.save(self.step, self._stateful(), self._trainer_state())
        if path is None or (wait and not self.checkpointer.wait()):
            return False
        stall = time.perf_counter() - t0
        parts = self.checkpointer.stall_parts if self.checkpointer.async_save and not wait else {}
        self.metrics.log(self.step, {"time/checkpoint": stall, **{f"time/checkpoint_{k}": v for k, v in parts.items()}})
        log.info("checkpoint %s: training stalled %.1fs%s", path, stall,
                 " (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f}s" for k, v in parts.items()) + "), writing in the "
                 "background" if parts else "")
        return True

    def _resume(self) -> None:
        path = self.resume_path
        if path is None:
            return
        state = self.checkpointer.load(path, self._stateful())
        saved_world = saved_world_size(path)
        self.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.actor_sched.load_state_dict(state["actor_sched"])
        if self.critic_sched and state["critic_sched"]:
            self.critic_sched.load_state_dict(state["critic_sched"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if saved_world == self.env.world_size:
            torch.set_rng_state(state["torch_rng"])
            random.setstate(state["python_rng"])
        elif self.env.is_main:  # the sampler's state is global: each step gets the same prompts on any world size
            log.warning("resuming a checkpoint of %d ranks on %d: the models and optimizers are resharded, the data "
                        "order continues exactly; each rank's random state starts afresh (trainer.seed + rank) and "
                        "rollouts are sampled per rank, so samples differ from an uninterrupted run",
                        saved_world, self.env.world_size)
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, self.step, self.sampler.epoch,
                 self.sampler.position)

    # ------------------------------------------------------------------ rollout
    def sync_weights(self, timer: PhaseTimer) -> None:
        """Wake the engine and give it the actor's current weights: all of them (a vLLM engine at
        sleep level 2 has none left after sleeping; a LoRA actor's merged), or with LoRA's adapter
        sync the base at the first sync only (the engine keeps it) and the adapter every time."""
        with timer("wake"), allocator_lines_held():  # vLLM's own out-of-memory line: PhaseTimer's says it
            self.engine.wake_up(["weights"])
        bucket_mb = self.cfg.rollout.weight_sync_bucket_mb
        with timer("weight_sync"):
            if not self.cfg.model.adapter_sync:
                self.engine.load_weights(iter_weights(self.actor, self.engine_dtype, bucket_mb))
            else:
                if not self.engine_has_base:
                    self.engine.load_weights(iter_base_weights(self.actor, self.engine_dtype, bucket_mb))
                    self.engine_has_base = True
                self.engine.load_adapter(gather_adapter(self.actor))
        if self.cfg.rollout.offload_train_states:
            before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            with timer("offload"):
                self.train_offload.offload(*self._train_state())
            if self.device.type == "cuda":
                timer.metrics["memory/offloaded_gb"] = (before - torch.cuda.memory_allocated(self.device)) / 2**30
        with timer("wake"), allocator_lines_held():
            self.engine.wake_up(["kv_cache"])

    def reference(self) -> contextlib.AbstractContextManager[torch.nn.Module]:
        """The reference policy: its own frozen model, or with LoRA the actor with its adapter
        disabled (the base is never held twice)."""
        if self.ref is not None:
            return contextlib.nullcontext(self.ref)
        return adapter_disabled(self.actor)

    def _train_state(self) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
        rm = None if self.reward_model is None else self.reward_model.model
        models = [m for m in (self.actor, self.critic, self.ref, rm) if m is not None]
        actor_opt = None if self.cfg.actor.offload_optimizer else self.actor_opt  # already on CPU
        return models, [o for o in (actor_opt, self.critic_opt) if o is not None]

    def _sampling(self, train: bool, round_: int = 0) -> SamplingParams:
        r, d = self.cfg.rollout, self.cfg.data
        stop = list(r.stop_token_ids)
        seed = sampling_seed(self.cfg.trainer.seed, self.step if train else -1 - self.step, self.engine_replica)
        seed = (seed + round_ * 7_919) % 2**31  # dynamic sampling's extra rounds sample afresh
        if train:  # rollout log-probs for every prompt, a sample of them or none (Config.rollout_logprobs_plan)
            return SamplingParams(r.n, r.temperature, r.top_p, r.top_k, d.max_response_length, stop, seed,
                                  ignore_eos=bool(r.length_profile),
                                  logprobs_every=self.cfg.rollout_logprobs_plan()[0])
        return SamplingParams(r.val_n, r.val_temperature, 1.0 if r.val_temperature == 0 else r.top_p,
                              -1 if r.val_temperature == 0 else r.top_k, d.max_response_length, stop, seed,
                              logprobs_every=0)  # validation reads scores only

    def response_limits(self, count: int, sampling: SamplingParams) -> list[int] | None:
        """Each of `count` training prompts' token limit drawn from rollout.length_profile (None without
        one): the same on a resumed run (the call's seed), other on every rank."""
        if self.length_profile is None:
            return None
        lengths = length_profile.draw(self.length_profile, count, seed=sampling.seed * 65_537 + self.env.rank)
        return [min(n, self.cfg.data.max_response_length) for n in lengths]

    def _more_prompts(self, k: int) -> tuple[list, list[int] | None]:
        """Partial rollouts' k-th refill of a step (rollout.partial_pool_batches): the next batch of
        training prompts and their token limits (drawn with the refill's own seed)."""
        records = [self.train_data[i] for i in self.sampler.next_batch()]
        return records, self.response_limits(len(records), self._sampling(True, k))

    def generate(self, records, train: bool, timer: PhaseTimer, round_: int = 0) -> Batch:
        self.sync_weights(timer)
        with timer("generate"):
            # every rank calls generate, also with no prompts: a TP group gathers its prompts collectively
            sampling = self._sampling(train, round_)
            limits = self.response_limits(len(records), sampling) if train else None
            if train and self.partial is not None:  # the step's complete groups, carried-over ones first
                records, completions, partial_metrics = self.partial.step(
                    self.engine, records, self.step, lambda k: self._sampling(train, k), limits, self._more_prompts)
                timer.metrics.update(partial_metrics)  # already reduced over ranks
            elif self.multi_turn is None:
                completions = self.engine.generate([rec.prompt_ids for rec in records], sampling, max_new_tokens=limits)
            else:
                completions, turn_metrics = self.multi_turn.generate(self.engine, records, sampling,
                                                                     self.cfg.data.max_response_length)
                merge_trajectory_metrics(timer.metrics, turn_metrics)  # over dynamic sampling's rounds too
        with timer("sleep"):
            self.engine.sleep()
        if self.device.type == "cuda":  # what sleep handed back (and, every step, whether anything leaks)
            timer.metrics["memory/free_after_sleep_gb"] = free_after_sleep_bytes(
                self.device, self.cfg.engine_stays_awake()) / 2**30
        if self.cfg.rollout.offload_train_states:
            with timer("reload"):
                self.train_offload.reload()
        if not records:
            return None
        prompts = [rec.prompt_ids for rec in records]
        meta = {"data_source": [r.data_source for r in records], "ground_truth": [r.ground_truth for r in records],
                "extra_info": [r.extra_info for r in records], "index": [r.index for r in records]}
        if self.reward_model is not None or self.multi_turn is not None:  # a conversation starts with the data's prompt
            meta["prompt"] = [r.prompt for r in records]
        return build_rollout_batch(prompts, completions, self.tokenizer.pad_token_id, meta)

    def score(self, batch: Batch, train: bool = True, timer: PhaseTimer | None = None) -> list[str]:
        """batch["scores"]: reward.rule_weight x the rule reward (an environment's, where it gave one,
        else the reward function's) + reward_model.weight x the reward model's score, + DAPO's
        overlong penalty. Collective with a reward model: every rank calls it (score_nothing where it
        has no batch). Returns the decoded responses."""
        texts = [decode_response(self.tokenizer, response_token_ids(batch, i)) for i in range(len(batch))]
        # multi-turn: the environment's reward where it gave one, the reward function for the rest
        env_rewards = batch.meta.pop("env_reward", [None] * len(batch))
        prompts = batch.meta.pop("prompt", [None] * len(batch))
        messages = batch.meta.pop("messages", [None] * len(batch))  # multi-turn: the whole conversation
        rows = [i for i, r in enumerate(env_rewards) if r is None]  # single-turn: every row

        def pick(key: str) -> list:
            return [batch.meta[key][i] for i in rows]

        scored = iter(self.reward_fn(pick("data_source"), [texts[i] for i in rows], pick("ground_truth"),
                                     pick("extra_info"), pick("index")))
        results = [next(scored) if r is None else {"score": r} for r in env_rewards]
        rule = torch.tensor([float(r["score"]) for r in results])
        batch["acc"] = torch.tensor([float(r.get("acc", r["score"] > 0)) for r in results])
        rc = self.cfg.reward
        batch["scores"] = rule * rc.rule_weight
        if self.reward_model is not None:
            with timer("reward_model") if timer is not None else contextlib.nullcontext():
                batch["rm_scores"] = self.reward_model.score([conversation(p, t, m)
                                                              for p, t, m in zip(prompts, texts, messages)])
            batch["rule_scores"] = rule
            batch["scores"] = batch["scores"] + self.cfg.reward_model.weight * batch["rm_scores"]
        if train and rc.overlong_buffer:  # DAPO soft overlong punishment
            batch["overlong_penalty"] = algos.overlong_penalty(batch["response_lens"], self.cfg.data.max_response_length,
                                                               rc.overlong_buffer, rc.overlong_penalty_factor)
            batch["scores"] = batch["scores"] + batch["overlong_penalty"]
        self.samples.offer(batch, texts, prompts, messages)  # trainer.log_samples: the rows it shows
        return texts

    def score_nothing(self) -> None:
        """A rank without responses takes part in the reward model's collective forwards."""
        if self.reward_model is not None:
            self.reward_model.score([])

    def sample_batch(self, timer: PhaseTimer) -> tuple[Batch, dict[str, float]]:
        """This rank's scored rollouts of the step: the next prompts, or with DAPO dynamic sampling
        as many rounds of them as it takes to get enough informative groups."""
        def draw(round_: int) -> Batch:
            draws = 1 if self.partial is None else self.partial.batches_to_draw()  # collective
            batch = self.generate([self.train_data[i] for _ in range(draws) for i in self.sampler.next_batch()], True,
                                  timer, round_)
            with timer("reward"):
                self.score(batch, timer=timer)
            return batch

        alg = self.cfg.algorithm
        if not alg.dynamic_sampling:
            return draw(0), {}
        return collect_informative_groups(draw, self.cfg.data.train_batch_size // self.env.world_size,
                                          alg.dynamic_sampling_max_rounds, self.tokenizer.pad_token_id, self.device)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg, env = self.cfg, self.env
        timer = PhaseTimer(self.device, self.memory_plan)
        t_step = time.perf_counter()
        self.samples.begin_step(self.step + 1)
        scheduling = hasattr(self.engine, "scheduling_metrics")  # vLLM's requests at once ("auto") and tail
        if scheduling:
            self.engine.scheduling_metrics()  # what calls before the step left (validation's): not the step's
        batch, sample_metrics = self.sample_batch(timer)
        if scheduling:  # over the step's calls
            timer.metrics.update(self.engine.scheduling_metrics())
        self.samples.flush()  # collective
        reward_errors = self.reward_fn.sync_failures()  # collective: a failed scorer stops every rank
        with timer("balance"):  # rows move between ranks to even out their tokens (trainer.balance_ranks)
            batch, balance_metrics = balance_ranks(batch, cfg, self.tokenizer.pad_token_id)
            # trainer.ulysses_size: the ranks of a sequence-parallel group train on the same rows
            batch = sequence_parallel.share_rows(batch, mini_batch_block_rows(cfg, env.world_size),
                                                 self.tokenizer.pad_token_id, env.sp)
        temp = cfg.rollout.temperature
        a, c = cfg.actor, cfg.critic
        amb, cmb = cfg.micro_batching("actor"), cfg.micro_batching("critic")
        on_policy = not cfg.old_logprob_pass_reason()  # the update's forward gives the old log-probs (old_logprobs.py)
        if not on_policy:
            with timer("old_logprob"):
                batch["old_logprobs"] = compute_logprobs(self.actor, batch, temp, amb.rows, self.device,
                                                         amb.forward_tokens)
        if cfg.use_reference:
            with timer("ref_logprob"), self.reference() as ref:
                batch["ref_logprobs"] = compute_logprobs(ref, batch, temp, amb.rows, self.device, amb.forward_tokens)
        if self.critic is not None:
            with timer("values"):
                batch["values"] = compute_values(self.critic, batch, cmb.rows, self.device, cmb.forward_tokens)
        with timer("adv"):
            extra = self.compute_advantages(batch)
        n = cfg.rollout.n
        if self.critic is not None:
            with timer("update_critic"):
                cm = ppo_update(self.critic, self.critic_opt, batch, critic_loss_fn(self.critic, c),
                                mini_batch_size=c.mini_batch_rows(n, env.dp_size),
                                micro_batch_size=cmb.rows, epochs=c.ppo_epochs,
                                grad_clip=c.grad_clip, loss_agg_mode=c.loss_agg_mode, device=self.device,
                                max_tokens=cmb.update_tokens)
                self.critic_sched.step()
        # loss mask, IS weights (on-policy: the IS weights come per micro-batch, from the update's forward)
        actor_batch, corr_metrics = actor_update_batch(batch, cfg.algorithm, self.device, correct_rollout=not on_policy)
        own = UpdateLogprobs(actor_batch, cfg.algorithm) if on_policy else None
        with timer("update_actor"):
            am = ppo_update(self.actor, self.actor_opt, actor_batch if own is None else own.batch,
                            actor_loss_fn(self.actor, a, temp, own),
                            mini_batch_size=a.mini_batch_rows(n, env.dp_size),
                            micro_batch_size=amb.rows, epochs=a.ppo_epochs,
                            grad_clip=a.grad_clip, loss_agg_mode=a.loss_agg_mode, device=self.device,
                            max_tokens=amb.update_tokens, offload_optimizer=a.offload_optimizer)
            self.actor_sched.step()
        if own is not None:  # the mismatch and rollout_corr/* metrics, from the log-probs the update used
            batch["old_logprobs"] = own.logprobs(batch["response_mask"])
            corr_metrics = actor_update_batch(batch, cfg.algorithm, self.device)[1]
        self.step += 1
        timer.metrics["time/step"] = time.perf_counter() - t_step
        # the slowest rank's generation: every rank waits for it at the next collective (metrics.rank_reduction)
        timer.metrics["time/generate_max"] = timer.metrics["time/generate"]
        metrics = self.step_metrics(batch, timer.metrics, extra)
        metrics.update({f"actor/{k}": v for k, v in am.items()})
        if self.critic is not None:
            metrics.update({f"critic/{k}": v for k, v in cm.items()})
        metrics = all_reduce_metrics(metrics, self.device, rank_reduction)
        metrics.update(self.global_metrics(batch, timer.metrics))
        metrics.update(mismatch_metrics(batch, self.device))  # over the rows that carry the engine's log-probs
        if routing.state_of(self.actor) is not None:  # actor.router_replay = "engine" on an MoE model
            replayed, counted, changed, decided = all_reduce_sum(torch.tensor(
                [*routing.replayed_share(batch), *routing.take_changed(self.actor)], dtype=torch.float64,
                device=self.device)).tolist()
            metrics["routing/replayed_share"] = replayed / max(counted, 1.0)
            metrics["routing/changed_share"] = changed / max(decided, 1.0)
        metrics.update({**sample_metrics, **balance_metrics, **corr_metrics})  # already reduced over ranks
        metrics["reward/errors"] = float(reward_errors.count)
        warning = self.reward_warning.check(self.step, reward_errors)  # reward.warn_error_share
        if warning and env.is_main:
            log.warning(warning)
        return metrics

    def compute_advantages(self, batch: Batch) -> dict[str, float]:
        alg = self.cfg.algorithm
        mask = batch["response_mask"]
        extra: dict[str, float] = {}
        token_rewards = algos.scores_to_token_rewards(batch["scores"], mask)
        if alg.use_kl_in_reward:
            token_rewards, kl = algos.apply_kl_penalty(token_rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                                       mask, self.kl_ctrl.value, alg.kl_penalty)
            kl = float(all_reduce_mean({"kl": kl}, self.device)["kl"])
            extra.update({"kl/reward_penalty": kl, "kl/coef": self.kl_ctrl.value})
            self.kl_ctrl.update(kl, len(batch) * self.env.dp_size)
        group = self.env.sp.data_group  # each row once (all ranks without sequence parallelism)
        est = alg.adv_estimator
        if est == "gae":
            adv, ret = algos.gae_advantages(token_rewards, batch["values"], mask, alg.gamma, alg.lam, whiten_group=group)
        elif est == "grpo":
            adv, ret = algos.grpo_advantages(batch["scores"], batch["group_ids"], mask, alg.norm_adv_by_std_in_grpo)
        elif est == "rloo":
            adv, ret = algos.rloo_advantages(batch["scores"], batch["group_ids"], mask)
        else:
            adv, ret = algos.reinforce_plus_plus_advantages(token_rewards, mask, alg.gamma, whiten_group=group)
        batch["advantages"], batch["returns"] = adv, ret
        return extra

    def step_metrics(self, batch: Batch, times: dict[str, float], extra: dict[str, float]) -> dict[str, float]:
        """Per-rank means (averaged over ranks by the caller)."""
        mask = batch["response_mask"]
        lens = batch["response_lens"].float()  # the response region: with multi-turn, tool messages too
        model_tokens = mask.sum(-1)
        max_len = self.cfg.data.max_response_length
        m = {
            "reward/mean": batch["scores"].mean().item(),
            "reward/acc": batch["acc"].mean().item(),
            "response/length_mean": model_tokens.mean().item(),
            "response/model_token_share": (model_tokens.sum() / lens.sum().clamp(min=1)).item(),
            "response/clip_ratio": ((lens >= max_len) & ~batch["finished"]).float().mean().item(),
            "prompt/length_mean": batch["prompt_lens"].float().mean().item(),
            "adv/mean": algos.masked_mean(batch["advantages"], mask).item(),
            "returns/mean": algos.masked_mean(batch["returns"], mask).item(),
            **times, **extra,
        }
        if "overlong_penalty" in batch:
            m["reward/overlong_penalty_mean"] = batch["overlong_penalty"].mean().item()
        if "rm_scores" in batch:  # the parts of the score, unweighted
            m["reward/rm_mean"] = batch["rm_scores"].mean().item()
            m["reward/rule_mean"] = batch["rule_scores"].mean().item()
        if "values" in batch:
            m["critic/values_mean"] = algos.masked_mean(batch["values"], mask).item()
        return m

    def global_metrics(self, batch: Batch, times: dict[str, float]) -> dict[str, float]:
        """Metrics that need max/sum over ranks rather than a mean."""
        env = self.env
        lens = batch["response_mask"].sum(-1)  # the model's tokens
        t = torch.tensor([lens.max().item(), batch["scores"].max().item(), -batch["scores"].min().item(),
                          times["time/step"]], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        scores = batch["scores"].double()
        s = all_reduce_sum(torch.tensor([scores.sum(), (scores ** 2).sum(), len(scores),
                                         batch["attention_mask"].sum().item(), batch.num_response_tokens],
                                        dtype=torch.float64, device=self.device)) / env.sp.size  # rows held sp times
        mean = s[0] / s[2]
        var = (s[1] / s[2] - mean ** 2).clamp(min=0) * s[2] / max(s[2] - 1, 1)
        step_time = t[3].item()
        out = {
            "response/length_max": t[0].item(),
            "reward/max": t[1].item(), "reward/min": -t[2].item(), "reward/std": var.sqrt().item(),
            "perf/tokens_per_sec": s[3].item() / step_time,
            "perf/tokens_per_sec_per_gpu": s[3].item() / step_time / env.world_size,
            "data/epoch": float(self.sampler.epoch), "actor/lr_sched": self.actor_sched.get_last_lr()[0],
            "response/tokens": s[4].item(),
        }
        m = self.cfg.model
        if "compile" in (m.fused_kernels, m.fused_logprob_head):  # flat after the first steps; growth = recompiles
            out.update(fused_kernels.compile_stats())
        peak = self.peak_flops()
        if peak and "time/update_actor" in times:
            # Training FLOPs per token (6N; 4N + 2 x the adapter with LoRA), per epoch, over the update's time.
            per_token = update_flops_per_token(*self.active_params)
            flops = per_token * s[3].item() * self.cfg.actor.ppo_epochs / env.world_size
            out["perf/mfu_update_actor"] = flops / times["time/update_actor"] / peak
        return out

    def peak_flops(self) -> float:
        if self.device.type != "cuda":
            return 0.0
        if self.cfg.trainer.peak_tflops:
            return self.cfg.trainer.peak_tflops * 1e12
        name = torch.cuda.get_device_name(self.device)
        return 989e12 if ("H100" in name or "H200" in name) else 0.0

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        if self.val_data is None:
            return {}
        timer = PhaseTimer(self.device, self.memory_plan)
        sums: dict[str, float] = defaultdict(float)
        self.samples.begin_validation(self.step, self.val_data)
        for idx in iter_eval_batches(len(self.val_data), self.cfg.data.val_batch_size, self.env.rank, self.env.world_size):
            records = [self.val_data[i] for i in idx]
            batch = self.generate(records, train=False, timer=timer)
            texts = self.score(batch, train=False) if batch is not None else self.score_nothing()
            self.reward_fn.sync_failures()  # collective: also on ranks without prompts in this batch
            if batch is None:
                continue
            if self.cfg.rollout.val_n > 1:  # mean@k, pass@k, maj@k per prompt
                answers = [extract_answer(s, t, self.cfg.reward.gsm8k_method)
                           for s, t in zip(batch.meta["data_source"], texts)]
                for k, v in prompt_sums(batch["group_ids"], batch["acc"], answers, batch.meta["data_source"]).items():
                    sums[k] += v
            for i, src in enumerate(batch.meta["data_source"]):
                for key in ("", f"/{src}"):
                    sums[f"val{key}/reward_sum"] += float(batch["scores"][i])
                    sums[f"val{key}/acc_sum"] += float(batch["acc"][i])
                    sums[f"val{key}/count"] += 1
        self.samples.flush()  # collective
        # every rank must reduce the same keys: gather the key set first
        keys: list[list[str]] = [None] * self.env.world_size  # type: ignore[list-item]
        dist.all_gather_object(keys, sorted(sums))
        all_keys = sorted(set().union(*keys))
        t = all_reduce_sum(torch.tensor([sums.get(k, 0.0) for k in all_keys], dtype=torch.float64, device=self.device))
        total = dict(zip(all_keys, t.tolist()))
        out = {}
        for k in all_keys:
            if k.endswith("/count"):
                prefix = k[: -len("/count")]
                out[f"{prefix}/reward_mean"] = total[f"{prefix}/reward_sum"] / total[k]
                out[f"{prefix}/acc"] = total[f"{prefix}/acc_sum"] / total[k]
        out.update(prompt_means(total))
        out["time/val"] = timer.metrics.get("time/generate", 0.0)
        return out

    # ------------------------------------------------------------------ the loop
    def _profiled(self, step: int):
        """torch.profiler around the step when trainer.profile_steps names it (spmd_rl/telemetry/step_profiler.py)."""
        if step not in self.cfg.trainer.profile_steps:
            return contextlib.nullcontext()
        return profiled_step(step, os.path.join(self.cfg.run_dir, "profile"), self.env.rank, self.device)

    def fit(self) -> str:
        """Train to trainer.total_steps, then log how the run ended (rank 0: telemetry/run_summary.py).
        Returns "finished", "preempted" after a stop signal (its
        checkpoint is complete), or "not saved" when the last checkpoint -- at the end of training
        (unless trainer.save_every = -1) or on a stop signal -- was not written (no room, or its
        write failed; exit_codes.EXIT_NOT_SAVED). A periodic save that is not written only logs
        why: training goes on, and the next save tries again."""
        t = self.cfg.trainer
        if self.step >= t.total_steps and self.env.is_main:
            log.info(run_summary.already_finished(self.step, t.total_steps))
        status = self._fit()
        if self.env.is_main:
            tensorboard = os.path.join(self.run_dir, "tensorboard") if t.tensorboard else None
            samples = self.samples.path if os.path.isfile(self.samples.path) else None
            log.info(run_summary.summary(status, self.step, t.total_steps,
                                         run_summary.read_steps(self.metrics.jsonl), self.checkpointer.latest(),
                                         tensorboard, samples))
        return status

    def _fit(self) -> str:
        t = self.cfg.trainer
        log.info(self.cfg.describe_layout(self.env.world_size))
        clock = StepClock()  # the time left on the step line
        clock.start()
        if t.val_before_train and self.step == 0:
            self._log_val(self.validate())
        while self.step < t.total_steps:
            with self._profiled(self.step + 1):
                metrics = self.train_step()
            last = self.step == t.total_steps
            if self.val_data is not None and t.val_every >= 0 and (last or (t.val_every and self.step % t.val_every == 0)):
                metrics.update(self.validate())
            metrics.update(self.startup.take_metrics())
            self.metrics.log(self.step, metrics)
            clock.tick()
            if self.step % t.log_every == 0 or last:
                log.info(summary_line(self.step, t.total_steps, metrics, clock.pace(self.step, t.total_steps)))
                if "val/acc" in metrics:
                    log.info("validation: acc %.3f reward %.3f", metrics["val/acc"], metrics["val/reward_mean"])
            if "time/startup_total" in metrics and "perf/compiled_graphs" in metrics:  # this process's first step
                log.info(fused_kernels.compile_line(metrics))
            periodic = t.save_every > 0 and self.step % t.save_every == 0
            saved = None
            if periodic or (last and t.save_every >= 0):
                saved = self.save_checkpoint(wait=last)
                if last and not saved:
                    return self._not_saved("at the end of training")
            if not last and self.stop.requested():
                log.warning("stop signal received: checkpointing at step %d and exiting", self.step)
                if saved is None:
                    saved = self.save_checkpoint()
                # exit with the requeue code only once the checkpoint is complete
                if not (self.checkpointer.wait() and saved):
                    return self._not_saved("on a stop signal")
                return "preempted"
        self.checkpointer.wait()
        return "finished"

    def _not_saved(self, when: str) -> str:
        latest = self.checkpointer.latest()
        log.error("stopped %s at step %d without its checkpoint (see the line above): %s; exiting with status %d",
                  when, self.step, f"the latest complete checkpoint is {latest}" if latest else "there is no checkpoint",
                  EXIT_NOT_SAVED)
        return "not saved"

    def _log_val(self, m: dict[str, float]) -> None:
        if m:
            self.metrics.log(self.step, m)
            log.info("validation at step %d: acc %.3f reward %.3f", self.step, m["val/acc"], m["val/reward_mean"])

    def close(self) -> None:
        """Stop what the trainer started, also on a half-built trainer: the checkpoint save in flight
        completes (or fails) first; training state is released before the vLLM engine shuts down
        (a sleeping engine maps its pool back to do so, and after a failed, say out-of-memory, step
        that memory must not still be held by training tensors); the engine goes before the process
        group; then TensorBoard's writer thread and the start-up heartbeat."""
        if hasattr(self, "checkpointer"):
            self.checkpointer.close()
        # the schedulers too: each holds its optimizer, and with it every parameter and moment
        self.actor = self.ref = self.critic = self.actor_opt = self.critic_opt = self.reward_model = None
        self.actor_sched = self.critic_sched = None
        gc.collect()
        if getattr(self, "device", None) is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        for part in ("multi_turn", "engine", "metrics", "startup"):
            if not hasattr(getattr(self, part, None), "close"):
                continue
            if part != "engine":
                getattr(self, part).close()
                continue
            try:
                with allocator_lines_held():
                    self.engine.close()
            except (torch.OutOfMemoryError, RuntimeError) as e:
                # mapping the pool back ran out of memory (another process holds it): a traceback from
                # the teardown would come after, or in place of, the run's own line
                if not is_out_of_memory(e):
                    raise
                log.info("the rollout engine could not map its memory back to shut down (%s): the process's "
                         "exit releases it", " ".join(str(e).split())[:200])

