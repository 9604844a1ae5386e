"""Step 3 of the step, the reward: what scores a response (:mod:`.scorer`: the built-in DAPO math rule of
:mod:`dapo_megatron.algorithm.reward`, your function, or a reward service), your function's forms and answers
(:mod:`.function`), the worker processes it runs in (:mod:`.pool`, :mod:`.worker`; the built-in rule there:
:mod:`.builtin`), the HTTP client of a reward service (:mod:`.remote`), the soft format bonus (:mod:`.format`) and
the response texts a reward reads (:mod:`.response_text`). The collectors apply it through
:func:`dapo_megatron.trainer.rollout_group.score_groups`.

Import from the submodules: this package module imports nothing, so a reward worker process starts without torch.
"""
