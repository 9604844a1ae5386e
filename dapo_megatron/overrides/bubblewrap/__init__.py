"""Workarounds of bubblewrap's behaviour (the table: ``dapo_megatron/overrides/README.md``).

* :mod:`.sandbox_init` — the code sandbox's own init in place of bubblewrap's, which is left an orphan.
"""
