"""Planner (DESIGN.md sections 7-8): cluster specs, the performance predictor and the plan search.

Pure Python (no JAX at import). The public API for scripts (``docs/planner.md``):

* :func:`load_cluster`, :class:`ClusterSpec` (``planner.cluster``): cluster specs from YAML or dicts;
  ``ClusterSpec.with_group`` / ``add_group`` for changed clusters;
* :func:`plan` (model preset / config file / LlamaConfig, cluster, global batch) and :func:`search`
  (``planner.search``): the top-k plans by PREDICTED step time, :class:`SearchOptions`,
  :class:`PlanningError`; :func:`runnable_result` / :func:`split_candidate` (``planner.runnable``):
  candidates with a multi-node group holding several stages split into one island per stage, which
  today's runtime runs (``plan`` and the CLI do this by default);
* what-if helpers: :func:`what_if_add_nodes`, :func:`what_if_add_group`, :func:`lm_head_placement`.
"""
from hethub_jax.planner.api import (WhatIf, default_seq_len, load_model, lm_head_placement, plan,
                                    what_if_add_group, what_if_add_nodes)
from hethub_jax.planner.cluster import ClusterSpec, NodeGroup, cluster_from_dict, load_cluster
from hethub_jax.planner.runnable import RunnableCandidate, runnable_result, split_candidate
from hethub_jax.planner.search import (Candidate, PlanningError, SearchOptions, SearchResult, exhaustive_search,
                                       search)

__all__ = ["ClusterSpec", "NodeGroup", "load_cluster", "cluster_from_dict", "plan", "search", "exhaustive_search",
           "SearchOptions", "SearchResult", "Candidate", "PlanningError", "load_model", "default_seq_len",
           "what_if_add_nodes", "what_if_add_group", "lm_head_placement", "WhatIf", "RunnableCandidate",
           "runnable_result", "split_candidate"]
