"""Workarounds of upstream behaviour, one folder per upstream package: :mod:`.megatron_core` (megatron-core 0.16.1),
:mod:`.sglang` (SGLang 0.5.23), :mod:`.bubblewrap` (the system's bwrap, 0.8.0 on Debian 12).

Each fix is a named function (or constant) of its module, applied from one place, and has a "can it go?" test that
runs the upstream code without it and asserts the defect is still there: when a new pin fixes the defect, that test
fails and names the fix to delete. ``README.md`` in this folder is the table — what each fix does, the version it is
for, where it is applied, the test that says when it can go (``tests/unit/test_overrides_table.py`` keeps it true).

Nothing is imported here: the CLI imports :mod:`.megatron_core.log_levels` before anything heavy.
"""
