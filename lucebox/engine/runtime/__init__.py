"""Running the model: sequences and the paged KV cache, scheduler, model runner, CUDA graphs, sampler,
the engine loop and its asyncio bridge.
"""
