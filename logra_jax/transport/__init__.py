"""The trainer ↔ rollout-engine transport (docs/method.md §6), beside logra_jax.rl.

- `sync`: what travels: low-rank delta payloads (bf16 factors, seeds, weight fingerprint, checksum) and full
  snapshots, their framing, and `PolicySync`, the trainer's sending end (resync on any mismatch).
- `rollout_worker`: the receiving end: `RolloutWeights` (checks and merges payloads bit-exactly like the trainer),
  and the engine around it, colocated (`InProcessTransport`) or in a worker process over loopback
  (`WorkerProcessTransport`, `python -m logra_jax.transport.rollout_worker`); `rollout_engine` picks one.
"""
