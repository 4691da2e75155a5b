"""What runs in the next step: requests' state (``sequence``), the waiting and running queues with the token
budget, chunked prefill and preemption (``scheduler``), and the paged KV cache's blocks with prefix caching
(``block_manager``, ``kv_cache_manager``). Plain Python without torch.
"""
