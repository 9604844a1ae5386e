"""What megatron-core 0.16.1 logs that a run's log should not show, set after the process's logging is configured
(``dapo_megatron.cli``). Only the ``logging`` module is imported here: the CLI calls this before anything heavy."""

from __future__ import annotations

import logging

# Logs a writer process's failure as an error line, then raises it: the raised error already says it (a full disk
# becomes one `checkpoint error:` line, dapo_megatron.checkpoint.save_load).
CHECKPOINT_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"


def quiet_megatron_loggers() -> None:
    """megatron-core logs every parameter name and its FSDP probing at INFO: keep its warnings only; and nothing of
    the checkpoint writer's failure line but what is raised."""
    logging.getLogger("megatron").setLevel(logging.WARNING)
    logging.getLogger(CHECKPOINT_WRITER_LOGGER).setLevel(logging.CRITICAL)
