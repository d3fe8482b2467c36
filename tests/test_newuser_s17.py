"""New-user points of session 17 (s17-ux) about README's main command: a rerun of a finished run ends at
once (before profiling, planning and the warm-up; every rank agrees, under ``mpiexec -n 2`` too); the
"devices left idle" line is a short summary with the full list in the metrics' run record; the chunked last
microbatch's ratio is said in words; the profiler's progress gives the microbatch per DP rank too.

References are independent of the code under test: checkpoint steps and metrics of a real run made here,
the device count conftest forces, device layouts read from the plans the tests write, ratios the tests put
into the profiles.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "configs" / "clusters" / "tiny_2island_cpu.yaml"
STEPS = 2  # the finished run's train.steps (and its last checkpoint)
LAYERS = 3  # test_checkpoint_resume.CONFIG's model


def _main(argv):
    from hethub_jax.train import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def _args(d: Path, *extra: str) -> list[str]:
    return ["--config", str(d / "c.yaml"), "--metrics-file", str(d / "m.jsonl"), "--checkpoint-dir", str(d / "ckpt"),
            "--no-progress", *extra]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A real run of ``STEPS`` steps (built-in plan, one process, conftest's 4 CPU devices): its directory,
    with ``c.yaml``, ``m.jsonl`` and ``ckpt/step_STEPS``."""
    from test_checkpoint_resume import CONFIG
    d = tmp_path_factory.mktemp("finished")
    (d / "c.yaml").write_text(CONFIG)
    rc, out, err = _main(_args(d, "--steps", str(STEPS)))
    assert rc == 0, out + err
    return d


@pytest.fixture
def rerun(finished, tmp_path):
    """A copy of the finished run's directory, so that a test that (wrongly) trains leaves the others alone."""
    d = tmp_path / "run"
    shutil.copytree(finished, d)
    return d


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---- 1. a rerun of a finished run ends before anything slow ----------------------------------------

def test_finished_step_decides_from_the_newest_checkpoint(finished, tmp_path):
    from hethub_jax import checkpoint as ckpt
    from hethub_jax.config import load_config
    from hethub_jax.train import finished_step

    newest = ckpt.complete_steps(finished / "ckpt", LAYERS)[0]
    assert newest == STEPS
    gbs = json.loads((finished / "m.jsonl").read_text().splitlines()[0])["plan"]["global_batch_size"]

    def cfg(*sets, steps=STEPS, d=finished):
        return load_config(str(finished / "c.yaml"), [f"train.checkpoint_dir={d / 'ckpt'}", *sets],
                           {"train.steps": steps})
    assert finished_step(cfg(), gbs) == newest
    assert finished_step(cfg(steps=STEPS - 1), gbs) == newest      # beyond train.steps: nothing to do either
    assert finished_step(cfg("train.resume=true"), gbs) == newest
    assert finished_step(cfg(steps=STEPS + 1), gbs) is None         # more steps to train
    assert finished_step(cfg("train.resume=false"), gbs) is None    # --no-resume starts from step 0
    assert finished_step(cfg("train.checkpoint_dir=null"), gbs) is None
    assert finished_step(cfg(), gbs * 2) is None                    # another global batch: resume reports it
    assert finished_step(cfg("model.hidden_size=64", "model.intermediate_size=128"), gbs) is None
    assert finished_step(cfg(d=tmp_path / "none"), gbs) is None
    bad = tmp_path / "bad"
    shutil.copytree(finished, bad)
    (bad / "ckpt" / f"step_{newest}" / "meta.json").write_text("{cut")  # left to resume's fallback
    assert finished_step(cfg(d=bad), gbs) is None


def test_rerun_ends_before_the_runtime_is_built(rerun, monkeypatch):
    """The same command again (``--plan`` or built-in plan): one line naming the step and ``--steps M``,
    exit 0, no file changed, and no runtime built (so no warm-up and no compilation)."""
    from hethub_jax.parallel import runtime

    before = _files(rerun)

    def refuse(*a, **k):
        raise AssertionError("the runtime was built for a finished run")
    monkeypatch.setattr(runtime, "PipelineRuntime", refuse)
    rc, out, err = _main(_args(rerun, "--steps", str(STEPS)))
    assert rc == 0, out + err
    line = [x for x in out.splitlines() if "nothing to do" in x]
    assert len(line) == 1 and f"step {STEPS} in {rerun / 'ckpt'}" in line[0] and "--steps M" in line[0], out
    assert "--no-resume" in line[0] and "README" in line[0] and f"M > {STEPS}" in line[0], line
    assert _files(rerun) == before


def test_planless_rerun_ends_before_profiling_and_planning(rerun, monkeypatch):
    """``--cluster`` (one process): the rerun ends before the profile is measured or reused and before the
    planner runs: no ``plan.json`` and no ``profiles/`` are written."""
    from hethub_jax import train_predict

    def refuse(*a, **k):
        raise AssertionError("planned a finished run")
    monkeypatch.setattr(train_predict, "plan_from_cluster", refuse)
    before = _files(rerun)
    rc, out, err = _main(_args(rerun, "--cluster", str(CLUSTER), "--steps", str(STEPS)))
    assert rc == 0, out + err
    assert sum("nothing to do" in x for x in out.splitlines()) == 1 and f"step {STEPS} in" in out, out
    assert _files(rerun) == before and not (rerun / "plan.json").exists() and not (rerun / "profiles").exists()


def test_ranks_that_see_different_checkpoints_all_go_on(finished, monkeypatch):
    """Under MPI every rank reports its decision (``cluster.gather_texts``, scripted here as the two ranks'
    texts): the run ends only when every rank found the step; when they differ every rank goes on to the
    usual resume checks (which name the ranks' different steps), so no rank leaves while another waits."""
    from hethub_jax import cluster
    from hethub_jax.config import load_config
    from hethub_jax.train import _agreed_finished_step

    cfg = load_config(str(finished / "c.yaml"), [f"train.checkpoint_dir={finished / 'ckpt'}"], {"train.steps": STEPS})
    gbs = cfg.train.global_batch_size
    seen = []
    monkeypatch.setattr(cluster, "gather_texts", lambda text, timeout, what="": seen.append(text) or {0: text, 1: text})
    assert _agreed_finished_step(cfg, gbs, 2, 5.0) == STEPS and seen == [str(STEPS)]
    monkeypatch.setattr(cluster, "gather_texts", lambda text, timeout, what="": {0: text, 1: "none"})
    assert _agreed_finished_step(cfg, gbs, 2, 5.0) is None


def test_checkpoint_that_only_looks_complete_is_left_to_resume(finished, tmp_path):
    """A step whose unit directories and CRC files exist but hold nothing (as a crash or a copy can leave
    them; test_bad_inputs' ``checkpoint_corrupt`` cases) is not "finished": resuming reads it and reports it."""
    from hethub_jax import checkpoint as ckpt
    from hethub_jax.config import load_config
    from hethub_jax.train import finished_step

    d = tmp_path / "c"
    shutil.copytree(finished, d)
    cfg = load_config(str(d / "c.yaml"), [f"train.checkpoint_dir={d / 'ckpt'}"], {"train.steps": STEPS})
    gbs = cfg.train.global_batch_size
    assert ckpt.looks_saved(d / "ckpt", STEPS, LAYERS) and finished_step(cfg, gbs) == STEPS
    (d / "ckpt" / f"step_{STEPS}" / "head.crc.json").write_text("{}")
    assert not ckpt.looks_saved(d / "ckpt", STEPS, LAYERS) and finished_step(cfg, gbs) is None
    shutil.copytree(finished / "ckpt", d / "ckpt", dirs_exist_ok=True)
    shutil.rmtree(d / "ckpt" / f"step_{STEPS}" / "embed")
    (d / "ckpt" / f"step_{STEPS}" / "embed").mkdir()
    (d / "ckpt" / f"step_{STEPS}" / "embed" / ".keep").write_text("")
    assert ckpt.complete_steps(d / "ckpt", LAYERS)[0] == STEPS and finished_step(cfg, gbs) is None


@pytest.mark.mpi
def test_planless_rerun_under_mpiexec_ends_on_every_rank(rerun):
    """README's main command again, under ``mpiexec -n 2`` (the tiny config of the finished run): both ranks
    agree and exit 0, rank 0 prints the line once; nothing is profiled, planned or written."""
    from test_comm_contract import run_mpi
    before = _files(rerun)
    t0 = time.monotonic()
    p = run_mpi(["-m", "hethub_jax.train", *_args(rerun, "--cluster", str(CLUSTER), "--steps", str(STEPS))], 2, 180,
                env={"JAX_PLATFORMS": "cpu"})
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sum("nothing to do" in x for x in p.stdout.splitlines()) == 1, p.stdout
    # (each rank's "local rank R: pinned to core C ... the profile is measured on these cores" line comes first)
    text = "\n".join(x for x in (p.stdout + p.stderr).lower().splitlines() if not x.startswith("local rank"))
    assert "profil" not in text and "plan written" not in text and "warm-up" not in text, text[-3000:]
    assert _files(rerun) == before and not (rerun / "plan.json").exists()
    print(f"mpiexec -n 2 rerun: {wall:.1f} s")


# ---- 2. devices left idle: a short line, the full list in the run record ---------------------------

def _plan(fast_devices: int = 1, slow_devices: int = 1):
    from hethub_jax.parallel.plan import Plan
    return Plan.from_dict({"islands": [{"name": "fast", "platform": "cpu", "devices_per_process": fast_devices},
                                       {"name": "slow", "platform": "cpu", "devices_per_process": slow_devices}],
                           "replicas": [{"stages": [{"island": "fast", "first_layer": 0, "last_layer": 1}]},
                                        {"stages": [{"island": "slow", "first_layer": 0, "last_layer": 1}]}],
                           "global_batch_size": 4, "microbatch_size": 2})


def test_idle_devices_records_and_the_short_planner_line():
    from hethub_jax.train import idle_devices, unused_devices_note
    plan = _plan()  # each island's one stage runs dp 1 x tp 1: its process's device 0
    recs = idle_devices(plan, {0: 2, 1: 3})
    assert recs == [{"rank": 0, "island": "fast", "platform": "cpu", "devices": 2, "used": [0], "idle": [1]},
                    {"rank": 1, "island": "slow", "platform": "cpu", "devices": 3, "used": [0], "idle": [1, 2]}]
    note = unused_devices_note(plan, {0: 2, 1: 3}, planned=str(CLUSTER))
    assert note.startswith("devices left idle: 1 of 2 on island fast, 2 of 3 on island slow: "), note
    assert "PREDICTED" in note and len("  note: " + note) <= 120, note
    one = unused_devices_note(plan, {0: 2, 1: 1}, planned=str(CLUSTER))
    assert "1 of 2 on island fast" in one and "slow" not in one and len("  note: " + one) <= 120, one
    assert idle_devices(plan, {0: 1, 1: 1}) == [] and unused_devices_note(plan, {0: 1, 1: 1}, planned="c") is None
    # the hand-written-plan WARNING keeps its advice and the indices
    assert "unused local device(s): 1-2" in unused_devices_note(plan, {0: 1, 1: 3})


def test_the_run_record_lists_the_idle_devices(finished):
    """The finished run (built-in one-device plan) ran in a process of conftest's forced CPU devices: the
    run record's ``idle_devices`` lists every other device."""
    forced = int(os.environ["XLA_FLAGS"].split("xla_force_host_platform_device_count=")[1].split()[0])
    run = json.loads((finished / "m.jsonl").read_text().splitlines()[0])
    assert run["kind"] == "run" and run["host"]["local_devices"] == forced
    assert run["idle_devices"] == [{"platform": "cpu", "devices": forced, "used": [0],
                                    "idle": list(range(1, forced))}]


# ---- 3. the chunked last microbatch in words -------------------------------------------------------

def test_chunked_ratio_in_words_measured_and_not():
    sys.path.insert(0, str(ROOT))
    from tests.test_predict_buckets import Cfg, _costs, _hdp
    from hethub_jax.train_predict import chunked_ratio_text, grad_allreduce_line, predict_run

    plan = _hdp((6, 2))  # both replicas of several microbatches: both chunk their last one
    measured = grad_allreduce_line(predict_run(Cfg, plan, 8, costs=_costs(ratio=1.115, platform="cpu"),
                                               grad_bucket_mb=25.0).prediction)
    assert "chunked last microbatch of r0 (fast): MEASURED x1.115 of the fused call" in measured, measured
    assert "of r1 (slow): MEASURED x1.115 of the fused call" in measured and "from " not in measured, measured
    unmeasured = grad_allreduce_line(predict_run(Cfg, plan, 8, costs=_costs(platform="cpu"),
                                                 grad_bucket_mb=25.0).prediction)
    assert "of r0 (fast): not measured, taken as the fused call's time (x1.0)" in unmeasured, unmeasured
    assert "(1.0)" not in unmeasured.replace("(x1.0)", ""), unmeasured
    assert chunked_ratio_text({"ratio": {}, "ratio_source": {}}) == "no replica chunks its last microbatch"


# ---- 4. the profiler's progress: microbatch in total and per DP rank -------------------------------

def test_progress_setting_words():
    from hethub_jax.profile import progress_setting
    assert progress_setting(2, 1, "first", 2) == "mesh 2x1 (dp x tp), first stage, microbatch 4 = 2 per DP rank x 2"
    assert progress_setting(1, 2, "mid2", 4) == "mesh 1x2 (dp x tp), middle stage of 2 layers, microbatch 4"


def test_profile_compute_reports_each_setting(monkeypatch):
    """``profile_compute``'s progress postfix for every stage setting it measures (the measurements
    replaced by constants: only the words are checked), DP 2 meshes saying the per-rank microbatch."""
    import jax

    from hethub_jax import profile
    from hethub_jax.models.config import LlamaConfig
    said = []

    class Bar:
        n, total = 0, 1

        def set_postfix_str(self, s, refresh=False):
            said.append(s)

        def update(self):
            self.n += 1

        def close(self):
            pass
    monkeypatch.setattr(profile, "_progress_bar", lambda total, progress: Bar())
    monkeypatch.setattr(profile, "measure_stage", lambda st, cfg, mbs, seq_len, repeats: {"F": 1.0})
    monkeypatch.setattr(profile, "measure_update", lambda st, repeats: 1.0)
    monkeypatch.setattr(profile, "measure_norm", lambda st, repeats: 1.0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    samples, _ = profile.profile_compute(cfg, 8, [1], [1], 1, jax.devices()[:2], True, dps=(1, 2), dp_mbs_list=[2])
    dp2 = [s for s in said if s.startswith("mesh 2x1")]
    assert len(dp2) == 4 and all(s.endswith("microbatch 4 = 2 per DP rank x 2") for s in dp2), said
    assert {s["microbatch_size"] for s in samples if s["dp"] == 2} == {4}  # the total the line gives first
    assert all("per DP rank" not in s for s in said if s.startswith("mesh 1x1")), said


def test_unknown_device_names_the_file_and_group(tmp_path):
    """A cluster spec with an unknown catalog device fails at load, naming the file and the group (as a key typo
    does), not later at planning with the name alone (a new user's report, session 17)."""
    from hethub_jax.planner.catalog import CATALOG
    from hethub_jax.planner.cluster import load_cluster
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ngroups:\n  - name: fast\n    device: cpux\n    nodes: 1\n")
    with pytest.raises(ValueError) as e:
        load_cluster(str(bad))
    msg = str(e.value)
    assert str(bad) in msg and "'fast'" in msg and "'cpux'" in msg
    assert all(k in msg for k in CATALOG)
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ngroups:\n  - name: fast\n    device: h100sxm\n    nodes: 1\n")
    assert load_cluster(str(good)).groups[0].device == "h100sxm"  # the catalog's loose matching still holds
