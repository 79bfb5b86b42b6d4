"""The pure-Python heart of the engine: requests, the block pool, block tables and the scheduler.

Nothing in this sub-package imports torch. It decides what runs and where each token's KV lives; the model
runner (`pagedlab.worker`) turns those decisions into tensors.
"""
