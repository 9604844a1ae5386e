"""Step 3 of the step, the reward: the DAPO math rule (:mod:`.rule`: +1/−1 on the last ``Answer:``),
overlong reward shaping (:mod:`.overlong`: soft punishment, filtering mask), what scores a response (:mod:`.scorer`:
that rule, your function, or a reward service), your function's forms and answers
(:mod:`.function`), the worker processes it runs in (:mod:`.pool`, :mod:`.worker`; the built-in rule there:
:mod:`.builtin`), the HTTP client of a reward service (:mod:`.remote`), the soft format bonus (:mod:`.format`) and
the response texts a reward reads (:mod:`.response_text`). The collectors apply it through
:func:`dapo_megatron.collectors.group.score_groups`.

Import from the submodules: this package module imports nothing, so a reward worker process starts without torch.
"""
