"""The SGLang rollout engine (:class:`~.engine.SGLangEngine`): K servers launched (:mod:`.server`, :mod:`.gpus`) or
attached, least-loaded dispatch and failover (:mod:`.pool`), HTTP (:mod:`.client`, :mod:`.requests`), streamed
requests (:mod:`.stream`), reply parsing in worker processes (:mod:`.reply_workers`), and the ways new weights reach
the servers (:mod:`.transports`, :mod:`.tensor_payloads`, :mod:`.runtime_versions`); what colocated servers
released (:mod:`.colocated_memory`).

Import from the submodules: importing this package loads nothing, and nothing here imports SGLang itself (the servers
are other processes).
"""
