"""The GPU worker: holds one base model resident and serves many BitDelta
variants of it from delta slots in device memory, in mixed batches.

    config.py     one typed config (flags + env)
    server.py     gRPC servicer (protobuf <-> domain), error interceptor, health, lifecycle
    worker.py     the core: Generate / LoadDelta / EvictDelta / Status as Python methods
    manager.py    delta lifecycle, byte budget, eviction policy, coalesced loads (ids, no math)
    loader.py     validate a delta against the base; stream + verify it into a slot
    sources.py    where deltas come from: local files or the delta_store service
    slots.py      the device tensors: per-(layer, projection group) slot stacks
    scheduler.py  continuous batching: ids and budgets (KV blocks, tokens per step)
    engine.py     the engine thread: schedule -> step -> sample -> stream
    runner.py     the ragged mixed-variant forward over a paged KV pool
    sampling.py   greedy / temperature / top-p / seed; detokenisation and stop strings

See docs/worker.md.
"""
