"""``benchmarks/predictor_accuracy.py --profile-stage-shapes``: the profile it asks for measures the whole model as
one stage by default (session 19: a one-stage replica's fused call PREDICTED from the fitted parts was ~18% above
the same call measured whole), and the profiler's own parser reads that argument list back as the whole model's
layer range. Run in a fresh process (the benchmark sets its XLA flags at import)."""
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

CODE = r"""
import argparse, json
import benchmarks.predictor_accuracy as pa
from hethub_jax import profile
from hethub_jax.models.config import get_preset
L = get_preset("tiny").num_hidden_layers
out = {}
for spec in ("whole", "none", "0-2,3-5"):
    args = argparse.Namespace(seq=16, profile_mbs="1", profile_tp="1", profile_dp="1,2", repeats=1, statistic="min",
                              islands="processes", profile_stage_shapes=spec)
    argv = pa.profile_argv(args, ["hetero_dp_slow2"], "/tmp/unused.json")
    ns = profile._parser().parse_args(argv)
    out[spec] = profile.parse_stage_shapes(ns.stage_shapes, L)
pins = {}
for pin, islands in ((True, "processes"), (True, "threads"), (False, "processes")):
    args = argparse.Namespace(seq=16, profile_mbs="1", profile_tp="1", profile_dp="1", repeats=1, statistic="min",
                              islands=islands, profile_stage_shapes="none", pin=pin)
    ns = profile._parser().parse_args(pa.profile_argv(args, ["pp2_gpipe_m4"], "/tmp/unused.json"))
    pins[f"{pin}-{islands}"] = [ns.pin, ns.corun_neighbour]
print(json.dumps({"L": L, "shapes": out, "pins": pins}))
"""


def test_profile_argv_measures_the_whole_model_as_a_stage_by_default():
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    L = res["L"]
    assert res["shapes"]["whole"] == [[0, L - 1]]
    assert res["shapes"]["none"] == []
    assert res["shapes"]["0-2,3-5"] == [[0, 2], [3, 5]]


def test_profile_argv_pins_the_profile_with_pinned_island_processes():
    """``--pin`` with islands as processes (rounds pinned one core each) profiles pinned too, with the co-run
    neighbour a process (what ``hethub_jax.profile --pin`` requires); islands as threads cannot be pinned per island,
    so their profile is not."""
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    pins = json.loads(p.stdout.strip().splitlines()[-1])["pins"]
    assert pins == {"True-processes": [True, "process"], "True-threads": [False, "thread"],
                    "False-processes": [False, "process"]}
