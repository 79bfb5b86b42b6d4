"""The tensor side of the engine: the paged KV cache, paged attention, the model runner and the sampler."""
