"""hethub-jax: train Llama-family models with JAX/XLA on heterogeneous accelerator clusters.

Parts (see docs/architecture.md):
  models/   Flax NNX Llama, HF transformers interop        (knows nothing of MPI)
  comm/     unified communicator: MPI host bridge, local    (knows nothing of Llama)
  parallel/ plans, pipeline stages, schedules, runtime
  planner/  device catalog, profiler, predictor, search     (runs without JAX devices)
"""

__version__ = "0.1.0"
