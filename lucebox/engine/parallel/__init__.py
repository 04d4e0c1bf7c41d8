"""Tensor parallelism: one model over N processes (ranks), each holding a shard of every layer.

shard.py splits a loaded model's weights for one rank, group.py sets up torch.distributed and the
collectives, plan.py encodes a step for the other ranks, worker.py starts the ranks and runs them.
"""
