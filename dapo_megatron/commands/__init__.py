"""The commands of ``dapo-megatron`` (:mod:`dapo_megatron.cli` parses the command line), one module each, imported
only when it runs: ``train`` and ``eval`` load torch, megatron-core and the trainer, which ``plot`` never needs.

Each has ``run(args, config)``: ``args`` as :func:`dapo_megatron.cli.build_parser` parsed them, ``config`` the run
config the CLI loaded before importing the module (None for ``plot``, which takes none)."""
