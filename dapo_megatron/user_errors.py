"""Errors in what the user gave us — as opposed to bugs — and the exit code each kind ends a command with.

A :class:`UserError` is raised where the culprit is known and its message names it (the file, the key, the row,
the server). ``dapo-megatron`` prints it on global rank 0 as one line, ``<kind> error: <message>``, with no
traceback, and exits with the kind's code; any other exception is a bug and keeps its traceback (exit code 1).
A message's first line is that line; a message that lists details (every tensor that does not fit, a server's log
tail) has them on further lines, printed indented below it.

=========== ===== ========================================================================================
kind        code  raised for (the classes)
=========== ===== ========================================================================================
config      2     an unknown key or a bad value (:class:`dapo_megatron.config.ConfigError`)
data        3     a data file missing, unreadable or with a malformed row (:class:`DataError`,
                  :class:`dapo_megatron.data.schema.RowValidationError`)
model       4     a model folder without weights, with a truncated/corrupted file, tensors that do not fit its
                  config, an unsupported architecture, a tokenizer without a chat template
                  (:class:`ModelFolderError`, :class:`dapo_megatron.hf_format.HFFormatError`)
checkpoint  5     a checkpoint path that is not a (complete, loadable) checkpoint
                  (:class:`dapo_megatron.checkpoint.CheckpointError`)
server      6     an SGLang server that is missing, dies for good, or answers something unusable
                  (:class:`ServerError`, :class:`dapo_megatron.rollout.sglang.client.SGLangServerError`)
launch      7     a process layout that does not fit the config (world size vs TP×PP, a taken rendezvous port)
                  (:class:`dapo_megatron.launch_env.LaunchError`)
reward      8     the reward fails: ``reward.url`` does not answer at start, or more than
                  ``reward.max_error_fraction`` of the responses scored fail (raise, time out, answer no
                  number); the message names the first failure (:class:`RewardError`)
=========== ===== ========================================================================================

``train`` stopped by a signal has codes of its own (75, 130, 143: dapo_megatron.run.stop_signals).

The same codes on every launch path: a plain process, each torchrun worker and each srun task exits with it
(an error found on rank 0 inside :func:`dapo_megatron.rank_zero.run_on_rank0` reaches every rank with its kind).
srun exits with the highest of its tasks' codes; torchrun stops the other workers when one fails, names that worker's
code as the root cause in its failure summary, and itself exits 1.
"""

from __future__ import annotations

BUG_EXIT_CODE = 1
EXIT_CODES = {"config": 2, "data": 3, "model": 4, "checkpoint": 5, "server": 6, "launch": 7, "reward": 8}


class UserError(Exception):
    """Bad input, named in the message. A subclass picks its kind, and so its exit code, in its class statement:
    ``class ConfigError(UserError, ValueError, kind="config")``."""

    kind = "input"
    exit_code = BUG_EXIT_CODE

    def __init_subclass__(cls, kind: str | None = None, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if kind is not None:
            if kind not in EXIT_CODES:
                raise ValueError(f"unknown user-error kind {kind!r}; known: {sorted(EXIT_CODES)}")
            cls.kind, cls.exit_code = kind, EXIT_CODES[kind]

    def line(self) -> str:
        """What the command line prints: ``<kind> error: <first line of the message>``, details indented below."""
        first, *details = str(self).splitlines() or [""]
        indented = [f"  {detail.strip()}" for detail in details if detail.strip()]
        return "\n".join([f"{self.kind} error: {first}", *indented])


class DataError(UserError, kind="data"):
    """A data file is missing or unreadable, or one of its rows is malformed."""


class ModelFolderError(UserError, kind="model"):
    """A model folder cannot be used: no weights, unreadable files, tensors that do not fit its config."""


class ServerError(UserError, kind="server"):
    """An inference server is missing, failed for good, or answered something that is not what was asked."""


class RewardError(UserError, kind="reward"):
    """The reward cannot score: its service does not answer, or it fails on too many responses to train on."""
