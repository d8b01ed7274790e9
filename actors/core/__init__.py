"""The engine core: token ids in, token ids out. The step loop, the scheduler with its KV
cache manager, request state, grammar state, speculation scheduling, the GPU actor that
runs the chosen runner, startup. The only part of `actors` that imports `gpu/`; it never
imports the front end."""
