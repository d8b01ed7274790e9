"""Tensor and pipeline parallelism: one model over TP x PP devices of one host, one process
per rank.

- env.py: the environment every worker runs with (NVLink multicast off);
- layout.py: which stage and tensor-parallel rank each rank is, and each stage's layers;
- group.py: forming the group from (rank, world size, rendezvous), each stage's
  tensor-parallel subgroup, teardown;
- communicator.py: all_reduce / all_gather / all_to_all on device tensors;
- step_broadcast.py: rank 0 hands each step's serialised scheduler output to the others
  as one buffer on the group's gloo group;
- launch.py: spawning the rank processes, reporting a failed or hung rank, no orphans;
- tp_engine.py: the engine's side: rank 0's worker and runner, the other ranks' step loop;
- tp_leader.py: rank 0 driving and watching the other ranks (a lost rank kills the engine);
- tp_model.py: one rank's weight shard (its stage's layers) in a sharded DecoderModel;
- pipeline.py: a rank's stage, the activations it receives and sends, and the last
  stage's sampled tokens shared with every rank;
- tp_config.py: validation of --tensor-parallel-size.
The model's sharding is gpu/models/parallel_layers.py, the weights' gpu/weights/
shard_layout.py, and sampling across ranks gpu/sampling/batch_shard.py.
"""
