"""The in-process rollout engine (:class:`~.engine.EmbeddedEngine`, the CPU default): batched KV-cached sampling on an
HF copy of the policy. One chunk's decode (:mod:`.decode_chunk`) over a left-padded batch (:mod:`.decode_batch`)
with a lean decode step (:mod:`.lean_decode`); streamed requests (:mod:`.stream`); the gate between decode steps and
weight updates (:mod:`.weight_gate`); new weights loaded by name (:mod:`.named_tensors`); its host memory counted
before it is built (:mod:`.memory`).
"""
