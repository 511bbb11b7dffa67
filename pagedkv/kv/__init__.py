"""KV memory management: physical blocks, per-request block tables, prefix sharing, CoW, swap.

Pure Python; knows blocks and tokens, never the model (no torch import here).
"""

from pagedkv.kv.block_pool import Block, BlockHash, BlockPool, FreeBlockQueue, hash_block_tokens
from pagedkv.kv.manager import BlockCopy, KVCacheManager, KVStats

__all__ = [
    "Block",
    "BlockCopy",
    "BlockHash",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheManager",
    "KVStats",
    "hash_block_tokens",
]
