"""A second tier under the prefix cache: full KV blocks kept outside the process, found again by their prefix
hash chain after a restart, by another worker or by another host. ``backend`` is what a store must do
(``directory`` keeps blocks as files, ``redis_blocks`` as Redis values); ``block_file`` frames each block with its
key and a checksum; ``namespace`` names everything that changes a block's values; ``cache_blocks`` copies blocks
out of and into the KV cache; ``prefix_store`` is the engine's side, reading ahead and writing behind on threads of
their own.
"""
