"""Tensor parallelism over torch.distributed: one process per rank, each holding its heads' K/V.

The scheduler and the block manager run once, in rank 0 (the engine's own
process); every step rank 0 sends the step's block moves and forward inputs (token
ids, positions, slot mapping, block tables) to the other ranks, and all ranks run
the forward on their shard of every layer. A block id means the same slots on
every rank, so the plan is all a rank needs.
"""
