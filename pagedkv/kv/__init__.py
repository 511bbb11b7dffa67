"""KV memory bookkeeping: physical blocks, per-request block tables, prefix sharing, CoW, swap.

Pure Python; knows blocks and tokens, never the model and never a tensor (no torch import
here: the K/V tensors and the offload tiers that move them live in `pagedkv.kvstore`).
"""

from pagedkv.kv.block_pool import Block, BlockPool, FreeBlockQueue
from pagedkv.kv.hashing import BlockHash, BlockHashes, hash_block_tokens
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.plan import BlockCopy
from pagedkv.kv.prefix import PrefixMatch
from pagedkv.kv.report import KVStats

__all__ = [
    "Block",
    "BlockCopy",
    "BlockHash",
    "BlockHashes",
    "BlockPool",
    "FreeBlockQueue",
    "KVCacheManager",
    "KVStats",
    "PrefixMatch",
    "hash_block_tokens",
]
