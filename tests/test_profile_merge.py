"""``hethub_jax.planner.profile_merge``: the median of several profiles, number by number, on hand-made profiles
whose medians are read off by eye (no JAX)."""
import json

import pytest

from hethub_jax.planner.profile_merge import main, merge_profiles


def _profile(seconds, factor, c1, date, share, extra_fit=True):
    """A hand-made profile: two stage samples, a line fit, a co-run factor and relation, a fit that may be None."""
    return {
        "format": "hethub-profile-v1", "device_type": "cpu", "platform": "cpu", "model": {"hidden_size": 8},
        "seq_len": 16, "statistic": "min", "emulated_slowdown": 1.0, "date": date, "repeats": 3,
        "others_cpu_share": share,
        "samples": [{"kind": "stage", "phase": "F", "microbatch_size": 1, "is_first": True, "seconds": seconds[0]},
                    {"kind": "stage", "phase": "B", "microbatch_size": 4, "is_first": True, "seconds": seconds[1]}],
        "fits": {"update": {"c0": 1e-3, "c1": c1}, "corun": {"factor": factor, "neighbour_kind": "process",
                                                             "relation": [[0.5, factor - 0.1], [1.0, factor]]},
                 "launch": {"serial": True}, "bridge": None,
                 "in_flight": {"k": 2.0} if extra_fit else None},
    }


A = _profile([0.30, 0.90], 1.6, 2e-9, "d1", 0.0)
B = _profile([0.10, 0.70], 1.2, 4e-9, "d2", 0.2)
C = _profile([0.20, 0.80], 1.4, 3e-9, "d3", 0.1, extra_fit=False)


def test_every_number_is_the_median_of_the_three():
    m = merge_profiles([A, B, C])
    assert [s["seconds"] for s in m["samples"]] == [0.20, 0.80]
    assert m["fits"]["update"] == {"c0": 1e-3, "c1": 3e-9}  # c0 equal in all three: kept as is
    assert m["fits"]["corun"]["factor"] == 1.4
    assert m["fits"]["corun"]["relation"] == [[0.5, pytest.approx(1.3)], [1.0, 1.4]]
    assert m["others_cpu_share"] == 0.1


def test_identity_fields_and_text_are_kept():
    m = merge_profiles([A, B, C])
    assert m["samples"][1]["microbatch_size"] == 4 and m["samples"][0]["is_first"] is True
    assert m["fits"]["launch"] == {"serial": True} and m["fits"]["corun"]["neighbour_kind"] == "process"
    assert m["fits"]["bridge"] is None
    assert m["date"] == "d1" and m["merged"]["dates"] == ["d1", "d2", "d3"] and m["merged"]["count"] == 3


def test_a_fit_missing_in_one_profile_is_the_median_of_the_others_and_listed():
    m = merge_profiles([A, B, C])
    assert m["fits"]["in_flight"] == {"k": 2.0}
    assert m["merged"]["differing"] == ["fits.in_flight"]


def test_an_even_count_takes_the_mean_of_the_middle_two():
    m = merge_profiles([A, B])
    assert m["samples"][0]["seconds"] == pytest.approx(0.20)  # (0.30 + 0.10) / 2
    assert m["fits"]["corun"]["factor"] == pytest.approx(1.4)


def test_one_profile_merges_to_itself():
    m = merge_profiles([A])
    assert m["samples"] == A["samples"] and m["fits"] == A["fits"]


def test_profiles_of_different_things_are_refused():
    with pytest.raises(ValueError, match="seq_len"):
        merge_profiles([A, dict(B, seq_len=64)])
    with pytest.raises(ValueError, match="at least one"):
        merge_profiles([])


def test_the_command_line_writes_the_merged_profile(tmp_path):
    paths = []
    for i, p in enumerate((A, B, C)):
        paths.append(str(tmp_path / f"p{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(p, f)
    out = str(tmp_path / "m.json")
    main(["--out", out, *paths])
    with open(out) as f:
        assert json.load(f)["fits"]["corun"]["factor"] == 1.4


def test_samples_are_matched_by_what_they_measured_not_by_position():
    """B's samples reversed and C without its second: the F sample is the median of 0.30, 0.10, 0.20; the B
    sample of 0.90 and 0.70 (the mean of the two); C's missing sample is listed."""
    b = dict(B, samples=B["samples"][::-1])
    c = dict(C, samples=C["samples"][:1])
    m = merge_profiles([A, b, c])
    assert [(s["phase"], s["seconds"]) for s in m["samples"]] == [("F", 0.20), ("B", pytest.approx(0.80))]
    assert "samples[stage #0]" in m["merged"]["differing"]


def test_repeated_samples_of_one_key_pair_in_order():
    two = lambda x, y: dict(A, samples=[{"kind": "norm", "seconds": x}, {"kind": "norm", "seconds": y}])
    m = merge_profiles([two(1.0, 10.0), two(3.0, 30.0), two(2.0, 20.0)])
    assert [s["seconds"] for s in m["samples"]] == [2.0, 20.0]
