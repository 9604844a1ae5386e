"""Where a run's scalars and validation generations go besides ``metrics.jsonl`` (which
:class:`~dapo_megatron.metrics.writer.MetricsWriter` always writes and delegates the rest to these):

* ``val_generations.jsonl`` — always: at each validation, the first ``eval.log_generations`` problems' first
  response with its prompt, ground truth, score and correctness, one JSON object per line;
* ``trainer.loggers``: ``tensorboard`` (``run_dir/tensorboard``; generations as a text table), ``wandb``
  (``trainer.wandb``: project, entity, name, ``mode: offline`` writes ``run_dir/wandb`` for a later ``wandb sync``;
  unset, W&B's own ``WANDB_MODE`` / ``wandb offline`` decide; generations as a table; W&B refusing to start, e.g.
  online without an API key, is a config error), ``mlflow`` (``trainer.mlflow``: the tracking URI is the config's
  when set, else MLflow's own ``MLFLOW_TRACKING_URI`` when set, else a SQLite file ``run_dir/mlflow.db``; metric
  names with characters MLflow refuses are written with ``@`` → ``_at_`` and any other
  such character → ``_``; see :func:`mlflow_metric_name`).

W&B and MLflow are optional extras (``pip install -e '.[wandb]'`` / ``'.[mlflow]'`` in the clone, the latter the
``mlflow-skinny`` client: the full ``mlflow`` package pins an older pyarrow than this project's); a run that asks
for one that is not installed fails at start, naming the extra (:func:`check_logger_libraries`). A resumed run
(``--resume``) continues the same W&B / MLflow run (their ids are kept in ``run_dir/loggers.json``); steps logged
after the checkpoint by the interrupted run are logged again: W&B keeps the first value of a step, MLflow both.
W&B and MLflow receive the finite values; ``metrics.jsonl`` and TensorBoard also the non-finite ones.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import time
from pathlib import Path
from typing import Protocol

from dapo_megatron.config import ConfigError, DAPOConfig, config_to_dict

GENERATIONS_FILE = "val_generations.jsonl"
IDS_FILE = "loggers.json"
# logger → (the modules it imports, the extra that installs them); MLflow's default SQLite store needs sqlalchemy and
# alembic, which the mlflow-skinny client leaves out.
EXTRAS = {"wandb": (("wandb",), "wandb"), "mlflow": (("mlflow", "sqlalchemy", "alembic"), "mlflow")}
GENERATION_COLUMNS = ("data_source", "index", "prompt", "response", "ground_truth", "score", "acc")


class RunLogger(Protocol):
    def log_scalars(self, step: int, scalars: dict[str, float]) -> None: ...

    def log_generations(self, step: int, rows: list[dict]) -> None: ...

    def truncate_after(self, step: int) -> None: ...

    def close(self) -> None: ...


def enabled_loggers(config: DAPOConfig) -> list[str]:
    """``trainer.loggers``, without tensorboard when ``trainer.tensorboard`` is false; each name once."""
    t = config.trainer
    return [name for name in dict.fromkeys(t.loggers) if name != "tensorboard" or t.tensorboard]


def check_logger_libraries(config: DAPOConfig) -> None:
    """A :class:`ConfigError` naming the extra to install when a logger's library is missing."""
    for name in enabled_loggers(config):
        modules, extra = EXTRAS.get(name, ((), ""))
        missing = [module for module in modules if importlib.util.find_spec(module) is None]
        if missing:
            raise ConfigError(f"trainer.loggers: {name} needs {', '.join(missing)}, not installed: "
                              f"pip install -e '.[{extra}]' (in the dapo-megatron clone)")


def build_loggers(config: DAPOConfig, run_dir: str | Path, *, resume: bool) -> list[RunLogger]:
    """The run's loggers (on the rank that logs): the generations file and those of ``trainer.loggers``."""
    check_logger_libraries(config)
    run_dir = Path(run_dir)
    ids = _RunIds(run_dir / IDS_FILE, resume=resume)
    makers = {"tensorboard": lambda: TensorBoardLogger(run_dir),
              "wandb": lambda: WandbLogger(config, run_dir, ids),
              "mlflow": lambda: MlflowLogger(config, run_dir, ids)}
    names = enabled_loggers(config)
    made: dict[str, RunLogger] = {}
    try:
        # TensorBoard last: its writer makes an events file at once, one more for each start that W&B or MLflow
        # then failed
        for name in sorted(names, key=lambda name: name == "tensorboard"):
            made[name] = makers[name]()
    except BaseException:
        for logger in made.values():
            logger.close()
        raise
    return [GenerationsFile(run_dir / GENERATIONS_FILE), *(made[name] for name in names)]


def finite(scalars: dict[str, float | None]) -> dict[str, float]:
    return {k: v for k, v in scalars.items() if v is not None and math.isfinite(v)}


class _RunIds:
    """The W&B / MLflow run ids of this run directory, so that ``--resume`` continues the same runs."""

    def __init__(self, path: Path, *, resume: bool):
        self.path = path
        self.ids: dict[str, str] = json.loads(path.read_text()) if resume and path.is_file() else {}

    def get(self, key: str) -> str | None:
        return self.ids.get(key)

    def set(self, key: str, value: str) -> None:
        self.ids[key] = value
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(self.ids, indent=2) + "\n")
        tmp.replace(self.path)


class GenerationsFile:
    """``val_generations.jsonl``: one line per logged generation, with its step."""

    def __init__(self, path: Path):
        self.path = path

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def log_generations(self, step: int, rows: list[dict]) -> None:
        with self.path.open("a") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")

    def truncate_after(self, step: int) -> None:
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def close(self) -> None:
        pass


class TensorBoardLogger:
    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for

        self._writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_generations(self, step: int, rows: list[dict]) -> None:
        self._writer.add_text("val/generations", generations_markdown(rows), step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        pass  # TensorBoard shows the resumed run's points over the interrupted run's

    def close(self) -> None:
        self._writer.close()


def generations_markdown(rows: list[dict]) -> str:
    """The generations as a markdown table (what TensorBoard's text tab renders)."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(GENERATION_COLUMNS) + " |", "|" + "---|" * len(GENERATION_COLUMNS)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in GENERATION_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)


class WandbLogger:
    def __init__(self, config: DAPOConfig, run_dir: Path, ids: _RunIds):
        import wandb  # an optional extra

        w = config.trainer.wandb
        self._wandb = wandb
        mode = {} if w.mode is None else {"mode": w.mode}  # unset: WANDB_MODE / `wandb offline` decide, as W&B does
        try:
            self._run = wandb.init(project=w.project, entity=w.entity, name=w.name or run_dir.resolve().name,
                                   dir=str(run_dir), config=config_to_dict(config), id=ids.get("wandb_run_id"),
                                   resume="allow", **mode)
        except wandb.errors.UsageError as error:  # no API key (in online mode), a bad entity or project name
            raise ConfigError(f"trainer.loggers: wandb did not start: {error} (or log offline: WANDB_MODE=offline, "
                              f"or trainer.wandb.mode=offline)") from None
        ids.set("wandb_run_id", self._run.id)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(finite(scalars), step=step)

    def log_generations(self, step: int, rows: list[dict]) -> None:
        table = self._wandb.Table(columns=list(GENERATION_COLUMNS),
                                  data=[[row.get(c) for c in GENERATION_COLUMNS] for row in rows])
        self._run.log({"val/generations": table}, step=step)

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        self._run.finish()


_MLFLOW_REFUSED = re.compile(r"[^/\w.\- :]")


def mlflow_metric_name(key: str) -> str:
    """``key`` as MLflow accepts it: ``@`` → ``_at_`` (``val/all/acc/mean@1`` → ``val/all/acc/mean_at_1``), any
    other character outside letters, digits, ``_ - . : / `` and space → ``_``."""
    return _MLFLOW_REFUSED.sub("_", key.replace("@", "_at_"))


def mlflow_tracking_uri(configured: str | None, run_dir: Path) -> tuple[str | None, str | None]:
    """``(tracking URI, artifact location of a new experiment)``: the config's URI; else, when MLflow's own
    ``MLFLOW_TRACKING_URI`` is set, None for both (MLflow's client resolves it, as every MLflow client does, and the
    server places the artifacts); else the run directory's SQLite store with its artifacts next to it."""
    from mlflow.environment_variables import MLFLOW_TRACKING_URI  # an optional extra

    if configured is None and MLFLOW_TRACKING_URI.is_set():
        return None, None
    artifacts = (run_dir / "mlflow_artifacts").resolve().as_uri()
    return configured or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}", artifacts


class MlflowLogger:
    def __init__(self, config: DAPOConfig, run_dir: Path, ids: _RunIds):
        from mlflow.entities import Metric  # an optional extra
        from mlflow.tracking import MlflowClient

        m = config.trainer.mlflow
        self._metric = Metric
        uri, artifacts = mlflow_tracking_uri(m.tracking_uri, run_dir)
        self._client = MlflowClient(tracking_uri=uri)
        run_id = ids.get("mlflow_run_id")
        if run_id is None:
            experiment = self._client.get_experiment_by_name(m.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else self._client.create_experiment(
                m.experiment, artifact_location=artifacts))
            run_id = self._client.create_run(experiment_id, run_name=m.run_name or run_dir.resolve().name,
                                             tags={"run_dir": str(run_dir.resolve())}).info.run_id
            ids.set("mlflow_run_id", run_id)
        self.run_id = run_id

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        stamp = int(time.time() * 1000)
        metrics = [self._metric(mlflow_metric_name(k), v, stamp, step) for k, v in finite(scalars).items()]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self._client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_generations(self, step: int, rows: list[dict]) -> None:
        pass  # val_generations.jsonl and TensorBoard / W&B hold them

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
