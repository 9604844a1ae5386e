"""Steps 1–4 of a DAPO step on rank 0: prompts → G responses each → rewards → the dynamic-sampling filter and buffer,
until the batch is full; then the batch reaches every rank.

* :mod:`.sync` — generate, score and filter in the step (``rollout.mode: sync``);
* :mod:`.asynchronous` — the same while the policy trains (``rollout.mode: async``), with its parts:
  :mod:`.async_driver` (the thread), :mod:`.async_pace` (how far ahead it generates), :mod:`.async_prompts`
  (where each prompt is, and the ledger that shows none is lost);
* :mod:`.group` — the scored group both collectors build (:func:`~.group.score_groups` is the one place responses
  are scored);
* :mod:`.batch` — the batch's way from rank 0 to every rank;
* :mod:`.rollout_metrics` — what a collector reports of its rollouts; :mod:`.reflection` — the reflection phrases
  counted in responses.
"""
