"""The DAPO training loop: :meth:`DAPOTrainer.train_step` is one step of the paper's algorithm, top to bottom, on
every rank (global rank 0 also drives the rollout engine). Which folder and module each stage lives in: the step map,
docs/architecture.md.

Each stage runs inside ``self.activity.in_stage(...)`` (:class:`dapo_megatron.run.watchdog.RankActivity`): the rank's
heartbeat carries it, so a rank that stops is named with its step and stage, and an error leaving a stage says where
it happened. The training collectives wait ``parallel.slow_collective_timeout_s`` until the first step of this process
is done and while a checkpoint is written, ``parallel.collective_timeout_s`` otherwise.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dapo_megatron import checkpoint as ckpt
from dapo_megatron.checkpoint.verify import non_finite_optimizer_state, non_finite_weights, set_aside
from dapo_megatron.backend.base import Backend
from dapo_megatron.config import DAPOConfig
from dapo_megatron.platform import seed_everything
from dapo_megatron.policy.actor import build_actor
from dapo_megatron.policy.hf_loader import load_hf_weights, load_model_spec
from dapo_megatron.rank_zero import run_on_rank0, waiting_group
from dapo_megatron.reward.scorer import RewardScorer
from dapo_megatron.rollout.factory import build_rollout_engine, build_rollout_generator
from dapo_megatron.rollout.generator import RolloutGenerator
from dapo_megatron.collectors.asynchronous import AsyncRolloutCollector
from dapo_megatron.trainer.colocation import Colocation
from dapo_megatron.trainer.evaluate import evaluate
from dapo_megatron.metrics.loggers import build_loggers
from dapo_megatron.metrics.writer import MetricsWriter
from dapo_megatron.run.model_source import load_tokenizer
from dapo_megatron.trainer.policy_update import PolicyUpdate
from dapo_megatron.collectors.batch import hand_over_rollouts
from dapo_megatron.collectors.sync import RolloutCollector
from dapo_megatron.run.config_record import record_start
from dapo_megatron.run.console import CONSOLE_LOG, continue_in
from dapo_megatron.metrics.step import StepTimer, policy_metrics, step_metrics, summary_line
from dapo_megatron.run.stop_signals import StopSignals
from dapo_megatron.data.task import eval_prompts, train_sampler
from dapo_megatron.run.progress import WARN_AFTER_STEPS, TrainingProgress
from dapo_megatron.trainer.weight_sync import handoff_metrics, sync_engine_policy
from dapo_megatron.platform import set_collective_timeout
from dapo_megatron.run.restarts import RestartRecord
from dapo_megatron.run.watchdog import RankActivity, collective_limit

logger = logging.getLogger(__name__)


class DAPOTrainer:
    """Every rank builds one, after ``init_distributed``, from the run config, the HF folder the policy starts from
    (:func:`dapo_megatron.run.model_source.prepare_initial_model`) and the platform's backend."""

    def __init__(self, config: DAPOConfig, model_dir: str | Path, backend: Backend, *, resume: bool = False,
                 stop: StopSignals | None = None, activity: RankActivity | None = None,
                 restart: RestartRecord | None = None):
        self.config = config
        self.backend = backend
        logger.info("policy backend: %s", backend.name)
        self.model_dir = Path(model_dir)
        self.resume = resume
        self.stop = stop or StopSignals()  # `train` passes the process's installed handlers
        self.rank = dist.get_rank()
        self.activity = activity or RankActivity(self.rank)  # `train` passes the one its watchdog reports
        self.restart = restart  # rank 0 of a restarted run: its row of restarts.jsonl, written once resumed
        seed_everything(config.trainer.seed)
        self.run_dir = Path(config.trainer.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.first_eval: dict[str, float] | None = None  # validation before any RL step (kept across resumes)
        self.last_eval: dict[str, float] | None = None
        self.last_eval_step: int | None = None
        self._eval_before_step: dict[str, float] | None = None  # last_eval as the step in progress began
        self.run_id: str | None = None  # set by run(): new, or the resumed checkpoint's
        self.resumed_from: Path | None = None
        self.saved_step: int | None = None  # the step of the newest checkpoint this process wrote or resumed from
        self.handoff_bytes: int | None = None  # of the last weight handoff (rank 0); None: none yet
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            continue_in(self.run_dir / CONSOLE_LOG)  # where the output goes on if its reader (`| tee`) dies

        # The policy, on every rank: this rank's Megatron stage, loaded from the HF folder.
        self.tokenizer = load_tokenizer(config, self.model_dir)
        self.spec = load_model_spec(self.model_dir)
        c = config
        self.actor = build_actor(self.spec, backend=backend, model=c.model, parallel=c.parallel, optim=c.optim,
                                 routing_replay=c.algorithm.moe_routing_replay != "none",
                                 micro_batch_tokens=c.trainer.micro_batch_tokens,
                                 temperature=c.rollout.temperature, seed=c.trainer.seed)
        load_hf_weights(self.actor.model, self.spec, self.model_dir)
        self.actor.optimizer.reload_model_params()
        self.policy_update = PolicyUpdate(self.actor, config)
        loggers = build_loggers(config, self.run_dir, resume=resume) if self.rank == 0 else []
        self.writer = MetricsWriter(self.run_dir, enabled=self.rank == 0, loggers=loggers)

        # The rollout side, on rank 0 only; colocated servers start in a generation turn (they size their memory then).
        self.engine = None
        # the one way trajectories are made, for collection and validation (the collector closes it)
        self.rollouts: RolloutGenerator | None = None
        self.collector = None
        self.reward: RewardScorer | None = None
        self.eval_prompts: tuple = ()
        self.colocation = Colocation(config, self.actor.optimizer, lambda: self.engine, device_type=backend.device_type,
                                     model=self.actor.model)
        self.colocation.locate_servers()
        with self.colocation.generating():
            run_on_rank0(self._start_rollout_side, what="starting the rollout side", broadcast_result=False)

    def _start_rollout_side(self) -> None:
        c = self.config
        sampler = train_sampler(c, self.tokenizer)
        self.eval_prompts = eval_prompts(c, self.tokenizer)
        self.reward = RewardScorer(c)  # your reward's worker processes, before the engine
        self.engine = build_rollout_engine(c, self.model_dir, self.run_dir, self.backend,
                                           server_gpus=self.colocation.server_gpus)
        self.rollouts = build_rollout_generator(c.rollout, self.engine, self.tokenizer)  # the run's one tool pool
        collector = AsyncRolloutCollector if c.rollout.mode == "async" else RolloutCollector
        self.collector = collector(self.rollouts, sampler, self.tokenizer, c, self.reward)

    # ------------------------------------------------------------------------------------------------ one step

    def train_step(self, step: int) -> dict[str, float]:
        """DAPO step ``step`` → ``step + 1``, on every rank; returns the metrics it logged as step ``step + 1``."""
        c, timer, done, stage = self.config, StepTimer(), step + 1, self.activity.in_stage
        with timer.phase("step"):
            # 1-4: prompts → G responses → rewards → filter
            with stage("rollout", done), timer.phase("gen"), self.colocation.generating():
                groups, rollout = hand_over_rollouts(lambda: self.collector.collect(step),
                                                     what=f"step {done} rollouts")
            with stage("pi_old", done):
                self.colocation.before_policy_update()  # colocated servers give the GPU memory to the training
                # 5-7: advantages → π_old's log-probs → rollout correction → one update per mini-batch, the DAPO loss
                update = self.policy_update.run(groups, step, timer,
                                                progress=lambda batches: self._progress(batches, done))
            with stage("handoff", done), timer.phase("handoff"):  # 8: the new weights → the rollout engine
                self.hand_off_weights(version=done)
        # 9: metrics (+ validation on schedule) to TensorBoard and metrics.jsonl; a checkpoint on schedule.
        with stage("metrics", done):
            policy = policy_metrics(groups, update.samples, update.old, update.updates, update.correction,
                                    policy_version=step) | update.routing
            metrics = step_metrics(rollout, policy, timer,
                                   weight_version=self.engine.weight_version if self.engine else done)
            metrics.update(handoff_metrics(self.handoff_bytes, self.spec, c.model.lora,
                                           element_bytes=self.actor.model.config.params_dtype.itemsize))
            last = done == c.trainer.total_steps
            if last or (c.eval.every and done % c.eval.every == 0):
                self.last_eval = self.validate(done)
                metrics.update(self.last_eval)
            self.writer.log(done, metrics)
            if self.rank == 0:
                print(summary_line(done, c.trainer.total_steps, metrics), flush=True)
            if last or (c.trainer.save_every and done % c.trainer.save_every == 0):
                self.save(done)
        return metrics

    def hand_off_weights(self, version: int) -> None:
        """The policy as ``version`` to the engine: its weights, or with LoRA what ``model.lora.handoff`` says
        (:func:`~dapo_megatron.trainer.weight_sync.sync_engine_policy`); the bytes sent are logged."""
        r = self.config.rollout
        # SGLang servers this run launched load the model folder, which is a LoRA policy's frozen base
        launched_from_base = r.engine == "sglang" and not r.sglang.urls
        base_served = self.handoff_bytes is not None or launched_from_base
        self.colocation.before_handoff(base_served=base_served)
        self.handoff_bytes = sync_engine_policy(
            self.actor.model, self.spec, self.engine, version=version, lora=self.config.model.lora,
            base_served=base_served,
            bucket_bytes=int(r.handoff_bucket_mb * 2**20), tp_gather=self.backend.tp_gather,
            copies=self.colocation.handoff_copies())

    def validate(self, step: int = 0) -> dict[str, float]:
        """Validation metrics on every rank; rank 0 also logs a sample of the generations at ``step``."""
        def on_rank0() -> dict[str, float]:
            result = evaluate(self.rollouts, self.eval_prompts, self.tokenizer, self.config, self.reward)
            if result.generations:
                self.writer.log_generations(step, result.generations)
            return result.metrics

        with self.activity.in_stage("validation", step), self.colocation.generating():
            return run_on_rank0(on_rank0, what="validation")

    def _progress(self, batches: list, step: int):
        """The mini-batches of step ``step``'s updates: π_old's log-probs are done when they are asked for."""
        self.activity.enter("update", step)
        return tqdm(batches, desc=f"step {step} updates", leave=False, unit="mini-batch",
                    disable=self.rank != 0 or not sys.stderr.isatty())

    # ------------------------------------------------------------------------------------------------ the loop

    def run(self) -> dict:
        """Train from step 0, or from the checkpoint when resuming, to ``trainer.total_steps``; stop early, with a
        checkpoint of the step reached, when a SIGTERM, SIGUSR1 or SIGHUP arrived (``stopped_by`` in the result)."""
        parallel = self.config.parallel
        self._limit_collectives(parallel.slow_collective_timeout_s)  # until this process's first step is done
        with self.activity.in_stage("resume"):
            step = self.restore() if self.resume else 0
        self.run_id = run_on_rank0(lambda: self._record_start(step), what="recording the run's config")
        if step == 0:
            self.writer.truncate_after(-1)  # a fresh start: rows of an earlier run in this directory would repeat
        progress, stopped_by = TrainingProgress(self.config), None
        with self.stop.training_loop():
            with self.activity.in_stage("handoff", step):
                self.hand_off_weights(version=step)  # the engine serves the policy's weights from the first rollout on
            if step == 0:
                self.first_eval, self.last_eval_step = self.validate(), 0
                self.writer.log(0, self.first_eval)
            if self.last_eval_step != step and step == self.config.trainer.total_steps:
                logger.info("the checkpoint is at trainer.total_steps=%d: nothing to train; validating it", step)
                self.last_eval, self.last_eval_step = self.validate(), step
            if self.last_eval_step == 0:
                self.last_eval = self.first_eval
            while step < self.config.trainer.total_steps:
                self._eval_before_step = self.last_eval
                metrics = self.train_step(step)
                if progress.steps == 0:  # compiled, autotuned, warmed up: the collectives' ordinary limit from now on
                    self._limit_collectives(parallel.collective_timeout_s)
                step += 1
                if self.last_eval is not self._eval_before_step:  # validated in this step
                    self.last_eval_step = step
                progress.note(metrics)
                if progress.steps == WARN_AFTER_STEPS and progress.nothing_trained():
                    logger.warning("%s so far", progress.nothing_trained())
                with self.activity.in_stage("metrics", step):  # every rank agrees whether a signal stops the run
                    signum = self.stop.agreed_stop()
                if signum is not None:
                    stopped_by = signal.Signals(signum).name
                    if self.saved_step != step:
                        self.save(step)
                    if self.rank == 0:
                        logger.warning("%s: stopped after step %d; its checkpoint is %s", stopped_by, step,
                                       ckpt.step_dir(self.ckpt_dir, step))
                    break
        if stopped_by is None and progress.nothing_trained():
            logger.warning("%s", progress.nothing_trained())
        self.writer.close()
        return {"first_eval": self.first_eval or {}, "last_eval": self.last_eval or {}, "steps": step,
                "stopped_by": stopped_by}

    def _limit_collectives(self, timeout_s: float) -> None:
        set_collective_timeout(collective_limit(timeout_s, watched=self.config.parallel.watchdog))

    def _record_start(self, step: int) -> str:
        """On rank 0: this start's row of config_history.jsonl (and of restarts.jsonl for a restart); the run id."""
        if self.restart is not None:
            self.restart.write(self.run_dir, step, self.resumed_from)
        return record_start(self.run_dir, self.config, run_id=self.run_id, step=step, resumed_from=self.resumed_from)

    def shutdown(self) -> None:
        with self.stop.protected("stopping the rollout engine"):  # no server or thread outlives the process
            if self.collector is not None:
                self.collector.close()  # async mode: the driver thread stops before its engine does
            if self.reward is not None:
                self.reward.close()
            if self.engine is not None:
                self.engine.shutdown()

    # ------------------------------------------------------------------------------------------------ state

    @staticmethod
    def _agreed_count(count: int) -> int:
        """``count`` summed over the ranks (each holds only its shards of the weights)."""
        group = waiting_group()
        if group is None:
            return count
        total = torch.tensor([count], dtype=torch.int64)
        dist.all_reduce(total, group=group)
        return int(total.item())

    def _trainer_state(self, step: int) -> dict:
        return {"step": step, "scheduler": self.actor.scheduler.state_dict(),
                "collector": self.collector.state_dict() if self.collector else None,
                "first_eval": self.first_eval, "last_eval": self.last_eval, "run_id": self.run_id,
                # train_step saves after its validation: a last_eval new since the step began is this step's
                "last_eval_step": step if self.last_eval is not self._eval_before_step else self.last_eval_step}

    def save(self, step: int) -> None:
        p = self.config.parallel
        # never half a checkpoint, nor a hung writer; a big model's shards may take long to reach the filesystem
        with self.stop.protected(f"finishing checkpoint {step}"), self.activity.in_stage("checkpoint", step):
            self._limit_collectives(p.slow_collective_timeout_s)
            try:
                with self.colocation.checkpoint_access():
                    ckpt.save_checkpoint(self.ckpt_dir, step, model_chunks=[self.actor.model],
                                         optimizer=self.actor.optimizer, trainer_state=self._trainer_state(step),
                                         side_files_from=self.model_dir, keep=self.config.trainer.keep_checkpoints,
                                         run_id=self.run_id, config=self.config)
            finally:  # a failed save ends the run, but its final collectives must not wait the slow limit
                self._limit_collectives(p.collective_timeout_s)
        self.saved_step = step

    def restore(self) -> int:
        world_size = dist.get_world_size()
        garbage: list[str] = []  # what was set aside, each with its problem
        while True:  # until a checkpoint loads whole: one of same-size garbage is set aside, the one before tried
            path = run_on_rank0(lambda: ckpt.checkpoint_to_resume(self.ckpt_dir, world_size),
                                what="choosing the checkpoint to resume from")
            if path is None and garbage:  # the policy holds the garbage now: no fresh start from it
                raise ckpt.CheckpointError(f"--resume: {garbage[0]}, and no complete checkpoint is left before it")
            if path is None:
                logger.info("no checkpoint under %s: starting from step 0", self.ckpt_dir)
                return 0
            with self.colocation.checkpoint_access():
                state = ckpt.load_checkpoint(path, model_chunks=[self.actor.model], optimizer=self.actor.optimizer)
            weights = self._agreed_count(len(non_finite_weights([self.actor.model])))
            optimizer = self._agreed_count(len(non_finite_optimizer_state(self.actor.optimizer, [self.actor.model])))
            if not weights and not optimizer:
                break
            problem = " and ".join(f"{count} {what} tensors" for count, what in
                                   ((weights, "weight"), (optimizer, "optimizer state")) if count)
            problem += " hold NaN or infinite values once loaded"
            garbage.append(f"{path} is damaged ({problem})")
            run_on_rank0(lambda: set_aside(path, [problem], instead=None), what="setting a damaged checkpoint aside",
                         broadcast_result=False)
        self.actor.scheduler.load_state_dict(state["scheduler"])
        if self.collector is not None:
            self.collector.load_state_dict(state["collector"])
        self.first_eval = state.get("first_eval")
        self.last_eval, self.last_eval_step = state.get("last_eval"), state.get("last_eval_step")
        self.run_id = state.get("run_id") or ckpt.run_id_of(path)
        self.resumed_from, self.saved_step = path, state["step"]
        self.writer.truncate_after(state["step"])
        logger.info("resumed from %s (step %d)", path, state["step"])
        return state["step"]
