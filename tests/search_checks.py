"""Shared check of the planner's exactness (not a test module): ``search`` against ``exhaustive_search``
(every plan of the same space predicted) under the same options."""
from __future__ import annotations

import pytest

from hethub_jax.planner.search import PlanningError, SearchOptions, exhaustive_search, search


def assert_search_equals_exhaustive(cfg, cluster, gbs: int, seq: int, opt: SearchOptions) -> None:
    """Both raise ``PlanningError``, or: the same best step time up to float rounding (interchangeable
    groups, searched in one order only, can sum the same terms in another order); the planner's k-th
    candidate not better than the exhaustive k-th (the exhaustive top k may hold mirror images of one
    plan, interchangeable groups swapped, which the planner lists once); no more ``predict`` calls."""
    try:
        ref = exhaustive_search(cfg, cluster, gbs, seq, options=opt)
    except PlanningError:
        with pytest.raises(PlanningError):
            search(cfg, cluster, gbs, seq, options=opt)
        return
    got = search(cfg, cluster, gbs, seq, options=opt)
    assert got.best.step_time_s == pytest.approx(ref.best.step_time_s, rel=1e-12)
    assert got.candidates[-1].step_time_s >= ref.candidates[-1].step_time_s * (1 - 1e-12)
    assert got.evaluated <= ref.evaluated
