"""The K/V data: the paged cache tensors (storage, fp8/int8 quantization) and the offload tiers
that move blocks to host memory and disk (offload, disk_tier, block_file).

The tensor and file side of `pagedkv.kv`: it imports the bookkeeping's records (`kv.plan`,
`kv.hashing`) and implements its protocols (`kv.plan.OffloadTiers`, `kv.block_pool.HostPool`);
`pagedkv.kv` never imports it.
"""
