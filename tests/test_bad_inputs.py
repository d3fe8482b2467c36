"""The bad-input inventory (issue 16 part 3): every case below makes ``python -m hethub_jax.train`` exit
with status 2 and one line ``python -m hethub_jax.train: error: ...`` naming the constraint, before it
writes any metrics or checkpoint file (and before anything is compiled: all but the cases that read
a checkpoint's arrays (corrupt, falling back) fail in set-up, before the pipeline runtime exists).

``docs/errors.md`` is generated from ``CASES`` (``python tests/test_bad_inputs.py`` rewrites it;
``test_errors_doc_is_current`` fails when it is stale). In-process cases call ``main(argv)``; the
``mpi`` cases launch ``mpiexec`` (marked ``mpi`` and ``slow``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"

BASE_YAML = """
model: {preset: tiny, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2,
        num_attention_heads: 2, num_key_value_heads: 1}
data: {seq_len: 16}
train: {steps: 2, global_batch_size: 4, microbatch_size: 2, eval_every: 100, eval_at_start: false,
        eval_batches: 1, log_every: 0}
"""


def _plan(islands=(("a", "cpu", 1),), stages=(("a", 0, 1, 1, 1),), **extra) -> str:
    d = {"islands": [{"name": n, "platform": p, "num_processes": 1, "devices_per_process": k}
                     for n, p, k in islands],
         "stages": [{"island": i, "first_layer": f, "last_layer": la, "dp": dp, "tp": tp}
                    for i, f, la, dp, tp in stages],
         "global_batch_size": 4, "microbatch_size": 2, "schedule": "1f1b", "recompute": "none"}
    d.update(extra)
    return json.dumps(d)


def _fake_checkpoint(model_overrides: dict | None = None, step: int = 2, global_batch_size: int = 4,
                     root: str = "ckpt") -> dict[str, str]:
    """Files of a checkpoint step (``root/step_{step}``) that looks complete: every unit directory
    (empty: unreadable), CRC files and meta.json (model fields as BASE_YAML, with overrides; the global
    batch it was written with)."""
    import yaml

    from hethub_jax.config import from_dict
    cfg = from_dict(yaml.safe_load(BASE_YAML))
    files = {}
    full = {**cfg.model.to_dict(), **(model_overrides or {})}
    data = cfg.data.model_dump()
    meta = {"format": 2, "step": step, "config": {"model": full, "data": data},
            "data": {"global_batch_size": global_batch_size}}
    for u in ["embed", "layers.0", "layers.1", "head"]:
        files[f"{root}/step_{step}/{u}/.keep"] = ""
        files[f"{root}/step_{step}/{u}.crc.json"] = "{}"
    files[f"{root}/step_{step}/meta.json"] = json.dumps(meta)
    return files


@dataclasses.dataclass
class Case:
    """One bad input. ``argv`` and ``files`` may use ``{tmp}`` (the case's directory)."""

    name: str
    category: str
    bad_input: str
    argv: list[str]
    expect: str                     # regex the error line must match (the named constraint)
    files: dict = dataclasses.field(default_factory=dict)
    lock_held: bool = False         # another run holds the output directory
    mpi: list | None = None         # mpiexec segments: [(n, extra argv[, working directory under {tmp}]), ...]


def _two_islands_plan() -> str:
    """Two one-device CPU islands `a` and `b`, one one-layer stage each (the multi-rank cases' plan)."""
    return _plan(islands=(("a", "cpu", 1), ("b", "cpu", 1)), stages=(("a", 0, 0, 1, 1), ("b", 1, 1, 1, 1)))


CASES = [
    # command line and config file
    Case("steps_zero", "CLI", "`--steps 0`", ["--steps", "0"], r"train\.steps must be an integer >= 1, got 0"),
    Case("unknown_section", "CLI", "`--set nosuch.x=1`", ["--set", "nosuch.x=1"], r"unknown section 'nosuch'"),
    Case("unknown_key", "CLI", "`--set train.nosuch=1`", ["--set", "train.nosuch=1"],
         r"unknown key 'nosuch' in section 'train'"),
    Case("batch_not_divisible", "CLI", "`--global-batch-size 6 --microbatch-size 4`",
         ["--global-batch-size", "6", "--microbatch-size", "4"],
         r"train\.global_batch_size must be divisible by train\.microbatch_size"),
    Case("negative_lr", "CLI", "`--lr -1`", ["--lr", "-1"], r"optim\.learning_rate must be > 0"),
    Case("seq_len_too_long", "CLI", "`--seq-len 100000` (> max_position_embeddings)", ["--seq-len", "100000"],
         r"seq_len.*max_position_embeddings"),
    Case("config_missing", "config file", "`--config` of a missing file", ["--config", "{tmp}/nope.yaml"],
         r"--config: file not found: .*nope\.yaml"),
    Case("config_bad_yaml", "config file", "malformed YAML", ["--config", "{tmp}/bad.yaml"], r"--config .*bad\.yaml: invalid YAML",
         files={"bad.yaml": "train: {steps: [1,\n"}),
    Case("resume_without_dir", "CLI", "`--resume --no-checkpoint`", ["--resume", "--no-checkpoint"],
         r"train\.resume needs train\.checkpoint_dir"),
    Case("nonfinite_policy", "CLI", "`--set train.on_nonfinite_loss=ignore`",
         ["--set", "train.on_nonfinite_loss=ignore"], r"train\.on_nonfinite_loss must be 'stop' or 'skip', got 'ignore'"),
    Case("message_timeout_zero", "CLI", "`--set train.message_timeout_s=0`",
         ["--set", "train.message_timeout_s=0"], r"train\.message_timeout_s must be a finite number > 0, got 0"),
    # model
    Case("unknown_preset", "model", "`--set model=nosuch`", ["--set", "model=nosuch"],
         r"model: unknown preset 'nosuch'"),
    Case("heads_not_dividing", "model", "hidden_size not a multiple of num_attention_heads",
         ["--set", "model={preset: tiny, hidden_size: 30, num_attention_heads: 4}"], r"num_attention_heads \(4\) must divide hidden_size \(30\)"),
    Case("vocab_too_small", "model", "model.vocab_size below the tokenizer's vocabulary",
         ["--set", "model={preset: tiny, vocab_size: 1000}"], r"model\.vocab_size \(1000\) must be >="),
    # data
    Case("corpus_missing", "data", "missing corpus", ["--set", "data.corpus_path={tmp}/no_corpus"],
         r"data: corpus_path: .*no_corpus does not exist"),
    Case("tokenizer_missing", "data", "missing tokenizer", ["--set", "data.tokenizer_path={tmp}/no.model"],
         r"data: tokenizer_path: .*no\.model does not exist"),
    # plans
    Case("plan_missing", "plan", "`--plan` of a missing file", ["--plan", "{tmp}/nope.json"],
         r"train\.plan: file not found"),
    Case("plan_bad_json", "plan", "plan file that is not JSON", ["--plan", "{tmp}/p.json"], r"train\.plan .*invalid plan JSON",
         files={"p.json": "{not json"}),
    Case("plan_unknown_key", "plan", "unknown plan key", ["--plan", "{tmp}/p.json"], r"unknown key 'nosuch' in plan",
         files={"p.json": _plan(nosuch=1)}),
    Case("plan_seq_len_shorter", "plan", "plan made for a shorter sequence than `data.seq_len` (its `seq_len`)",
         ["--plan", "{tmp}/p.json"], r"train\.plan .* was made for sequence length 8 .* data\.seq_len 16",
         files={"p.json": _plan(seq_len=8)}),
    Case("plan_layers_uncovered", "plan", "stages do not cover every layer", ["--plan", "{tmp}/p.json"],
         r"layer ranges must cover", files={"p.json": _plan(stages=(("a", 0, 0, 1, 1),))}),
    Case("plan_unknown_island", "plan", "stage on an island not in the plan", ["--plan", "{tmp}/p.json"],
         r"stage island must exist: .* names island 'zz'", files={"p.json": _plan(stages=(("zz", 0, 1, 1, 1),))}),
    Case("plan_tp_not_dividing", "plan", "TP degree not dividing the attention heads (TP 4, 2 heads)", ["--plan", "{tmp}/p.json"],
         r"TP degree must divide the number of attention heads", files={"p.json": _plan(islands=(("a", "cpu", 4),), stages=(("a", 0, 1, 1, 4),))}),
    Case("plan_too_many_devices", "devices", "plan needing more devices than the process has",
         ["--plan", "{tmp}/p.json"], r"needs devices_per_process=64 cpu devices, this process has \d+",
         files={"p.json": _plan(islands=(("a", "cpu", 64),), stages=(("a", 0, 1, 1, 1),))}),
    Case("cuda_without_gpu", "devices", "`cuda` island on a machine without a GPU", ["--plan", "{tmp}/p.json"],
         r"platform 'cuda', which this machine does not have",
         files={"p.json": _plan(islands=(("g", "cuda", 1),), stages=(("g", 0, 1, 1, 1),))}),
    Case("island_without_mpi", "launch", "`--island` without mpiexec (multi-rank plan)",
         ["--plan", "{tmp}/p.json", "--island", "a"], r"run it under mpiexec -n 2",
         files={"p.json": _two_islands_plan()}),
    # outputs and checkpoints
    Case("checkpoint_dir_unwritable", "outputs", "checkpoint directory under a regular file",
         ["--checkpoint-dir", "{tmp}/file/ckpt"], r"train\.checkpoint_dir: .*file/ckpt is not writable", files={"file": "x"}),
    Case("two_runs_one_dir", "outputs", "a second run in an output directory in use", [],
         r"train\.checkpoint_dir: .* is in use by another run \(pid \d+ on host", lock_held=True),
    Case("resume_nothing", "checkpoint", "`--resume` with no checkpoint", ["--resume"],
         r"no complete checkpoint in .* --resume-or-start"),
    Case("checkpoint_other_model", "checkpoint", "`--resume` from a checkpoint of another model shape",
         ["--resume"], r"model\.hidden_size is 48 there, 32 here",
         files=_fake_checkpoint({"hidden_size": 48})),
    Case("checkpoint_corrupt", "checkpoint", "`--resume` from a corrupt (unreadable) checkpoint",
         ["--resume"], r"every complete checkpoint in .* is corrupt: .*step_2/embed: cannot be read",
         files=_fake_checkpoint()),
    # several ranks (mpiexec)
    Case("mpiexec_n_mismatch", "launch", "`mpiexec -n 3` for a 2-rank plan", ["--plan", "{tmp}/p.json"],
         r"the plan needs 2 MPI ranks .* the job has 3",
         files={"p.json": _two_islands_plan()}, mpi=[(3, [])]),
    Case("ranks_differ", "launch", "ranks started with different configs (`--lr` on one rank)",
         ["--plan", "{tmp}/p.json"], r"ranks run different configs/plans: config\.optim\.learning_rate",
         files={"p.json": _two_islands_plan()},
         mpi=[(1, []), (1, ["--lr", "0.5"])]),
    # one rank of an MPMD job fails before MPI starts: it still starts MPI and reports at the start-up
    # gate, so every rank ends within seconds (not after $HETHUB_MPI_INIT_TIMEOUT_S)
    Case("steps_zero_one_rank", "launch", "`--steps 0` on one rank only (MPMD: `-n 1 ... : -n 1 ... --steps 0`)",
         ["--plan", "{tmp}/p.json"], r"rank 1 \(island b\): train\.steps must be an integer >= 1, got 0",
         files={"p.json": _two_islands_plan()},
         mpi=[(1, []), (1, ["--steps", "0"])]),
    Case("plan_differs_one_rank", "launch", "another plan (of 3 ranks) on one rank only of a 2-rank job",
         ["--plan", "{tmp}/p.json"], r"rank 1: the plan needs 3 MPI ranks .* the job has 2",
         files={"p.json": _two_islands_plan(),
                "p3.json": _plan(islands=(("a", "cpu", 1), ("b", "cpu", 1), ("c", "cpu", 1)),
                                 stages=(("a", 0, 0, 1, 1), ("b", 1, 1, 1, 1), ("c", 1, 1, 1, 1)))},
         mpi=[(1, []), (1, ["--plan", "{tmp}/p3.json"])]),
    Case("bad_flag_one_rank", "launch", "an unknown flag on one rank only (argparse's error)",
         ["--plan", "{tmp}/p.json"], r"unrecognized arguments: --stepz 1",
         files={"p.json": _two_islands_plan()},
         mpi=[(1, ["--stepz", "1"]), (1, [])]),
    # errors found after MPI started: every rank passes an agreement point (cluster.agree_errors), the
    # lowest rank that found an error prints it once, every rank ends with status 2 (no MPI abort)
    Case("plan_layers_uncovered_all_ranks", "launch", "a plan error every rank finds after MPI started "
         "(stages cover 3 layers, the model has 2)", ["--plan", "{tmp}/p.json"],
         r"rank 0 \(island a\): train\.plan .*layer ranges must cover .* \(the same on rank\(s\) 1\)",
         files={"p.json": _plan(islands=(("a", "cpu", 1), ("b", "cpu", 1)),
                                stages=(("a", 0, 0, 1, 1), ("b", 1, 2, 1, 1)))},
         mpi=[(2, [])]),
    # errors found while resuming under mpiexec: every rank sees the same outcome of each checkpoint step
    # tried (checkpoint.restore_latest agrees through the bridge), the error names the ranks that found
    # each fault, is printed once, and every rank ends with status 2
    Case("checkpoint_corrupt_all_ranks", "checkpoint", "`--resume` from a corrupt checkpoint, 2 ranks (each "
         "finds the tied embedding's unit unreadable while resuming)", ["--plan", "{tmp}/p.json", "--resume"],
         r"rank 0 \(island a\): train\.resume: every complete checkpoint in .* is corrupt: .*step_2/embed: "
         r"cannot be read .*\(the same on rank\(s\) 1\)",
         files={"p.json": _two_islands_plan(), **_fake_checkpoint()},
         mpi=[(2, [])]),
    Case("checkpoint_fallback_other_model", "checkpoint", "`--resume`, 2 ranks: the newest step corrupt, the "
         "step it falls back to of another model shape", ["--plan", "{tmp}/p.json", "--resume"],
         r"rank 0 \(island a\): train\.resume: checkpoint .*step_2 was written for another set-up: "
         r"model\.hidden_size is 48 there, 32 here .*\(the same on rank\(s\) 1\)",
         files={"p.json": _two_islands_plan(),
                **_fake_checkpoint(step=4), **_fake_checkpoint({"hidden_size": 48})},
         mpi=[(2, [])]),
    Case("checkpoint_other_plan_batch", "checkpoint", "`--resume`, 2 ranks, from a checkpoint written under a "
         "plan of another global batch", ["--plan", "{tmp}/p.json", "--resume"],
         r"rank 0 \(island a\): train\.resume: checkpoint .*step_2 was written for another set-up: "
         r"train\.global_batch_size is 8 there, 4 here .*\(the same on rank\(s\) 1\)",
         files={"p.json": _two_islands_plan(),
                **_fake_checkpoint(global_batch_size=8)},
         mpi=[(2, [])]),
    Case("checkpoint_steps_differ", "checkpoint", "`--resume`, 2 ranks seeing different checkpoint steps (a "
         "relative `--checkpoint-dir` from another working directory on each rank: no shared directory)",
         ["--plan", "{tmp}/p.json", "--resume", "--checkpoint-dir", "ckpt"],
         r"rank 0 \(island a\): train\.checkpoint_dir: the ranks see different complete checkpoint steps in "
         r"ckpt: rank 0: steps 4, 2; rank 1: step 2 \(the ranks need one checkpoint directory",
         files={"p.json": _two_islands_plan(),
                **_fake_checkpoint(root="r0/ckpt"), **_fake_checkpoint(step=4, root="r0/ckpt"),
                **_fake_checkpoint(root="r1/ckpt")},
         mpi=[(1, [], "r0"), (1, [], "r1")]),
    Case("island_mismatch_one_rank", "launch", "`--island` naming another rank's island on one rank only",
         ["--plan", "{tmp}/p.json"], r"rank 1 \(island a\): rank 1 runs island 'a' but the plan gives rank 1 to "
         r"island 'b'", files={"p.json": _plan(islands=(("a", "cpu", 1), ("b", "cpu", 1)),
                                               stages=(("a", 0, 0, 1, 1), ("b", 1, 1, 1, 1)))},
         mpi=[(1, []), (1, ["--island", "a"])]),
]

#: seconds from a failing rank's error line to the end of every rank of the job (issue 16: "within
#: seconds"), plus the time a healthy peer takes to start (it must reach MPI_Init before it can end:
#: measured in the same test run, ``_startup_s``); the start-up watchdog is set far beyond it
MPI_END_WITHIN_S = 20.0

PREFIX = "python -m hethub_jax.train: error: "


def _materialise(case: Case, tmp: Path) -> list[str]:
    for name, text in case.files.items():
        p = tmp / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text.replace("{tmp}", str(tmp)))
    (tmp / "base.yaml").write_text(BASE_YAML)
    base = ["--config", f"{tmp}/base.yaml", "--metrics-file", f"{tmp}/m.jsonl", "--no-progress"]
    if "--no-checkpoint" not in case.argv:
        base += ["--checkpoint-dir", f"{tmp}/ckpt"]
    return base + [a.replace("{tmp}", str(tmp)) for a in case.argv]


def _check_output(case: Case, rc: int, err: str, tmp: Path) -> None:
    """Status 2, one error line (under mpiexec too: an error found by several ranks is printed once),
    no MPI abort message, no output file."""
    lines = [line for line in err.splitlines() if line.startswith(PREFIX)]
    assert rc == 2, f"{case.name}: exit {rc}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1, f"{case.name}: want one error line:\n{err[-3000:]}"
    assert "MPI_Abort" not in err, f"{case.name}: the job was aborted, not ended quietly:\n{err[-3000:]}"
    for line in lines:
        assert re.search(case.expect, line), f"{case.name}: {line!r} does not match {case.expect!r}"
    assert not (tmp / "m.jsonl").exists(), f"{case.name}: a metrics file was written"
    assert not [p for p in (tmp / "ckpt").glob("step_*") if not (tmp / "ckpt_pre" / p.name).exists()], \
        f"{case.name}: a checkpoint step was written"


@pytest.mark.parametrize("case", [c for c in CASES if c.mpi is None], ids=lambda c: c.name)
def test_bad_input_in_process(case: Case, tmp_path: Path):
    from hethub_jax import checkpoint as ckpt
    from hethub_jax.train import main

    argv = _materialise(case, tmp_path)
    for p in (tmp_path / "ckpt").glob("step_*"):          # pre-existing steps are not "written"
        (tmp_path / "ckpt_pre" / p.name).mkdir(parents=True)
    lock = ckpt.DirLock(tmp_path / "ckpt" / ".lock") if case.lock_held else None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse errors
                rc = e.code
    finally:
        if lock is not None:
            lock.release()
    _check_output(case, rc, err.getvalue(), tmp_path)
    left = [p for p in tmp_path.rglob("*") if p.name.endswith(".lock")]
    assert not left, f"{case.name}: lock files left after the error: {left}"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.mpi is not None], ids=lambda c: c.name)
def test_bad_input_under_mpi(case: Case, tmp_path: Path):
    import os

    from test_comm_contract import mpiexec, run_group

    argv = _materialise(case, tmp_path)
    for p in (tmp_path / "ckpt").glob("step_*"):          # pre-existing steps are not "written"
        (tmp_path / "ckpt_pre" / p.name).mkdir(parents=True)
    cmd = [mpiexec()]
    for i, (n, extra, *wdir) in enumerate(case.mpi):
        cmd += ([":"] if i else []) + ["-n", str(n)] + (["-wdir", str(tmp_path / wdir[0])] if wdir else []) + [
            sys.executable, "-m", "hethub_jax.train", *argv, *[a.replace("{tmp}", str(tmp_path)) for a in extra]]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", HETHUB_MPI_INIT_TIMEOUT_S="600")
    rc, err, after_error = _run_timed(cmd, 180, env)
    # every rank ends by itself with status 2 (start-up gate or agreement point; no MPI abort): so
    # does mpiexec
    _check_output(case, rc, err, tmp_path)
    limit = MPI_END_WITHIN_S + _startup_s(env)
    assert after_error < limit, (f"{case.name}: the job ended {after_error:.1f} s after the error (limit "
                                 f"{limit:.1f} s):\n{err[-3000:]}")


_STARTUP: list[float] = []


def _startup_s(env: dict) -> float:
    """Seconds one process takes from its start to a configuration error (imports, config): how late
    a healthy peer may reach MPI_Init after another rank failed early (e.g. in argparse). Measured once
    per session, on the same machine under the same load as the MPI cases."""
    import subprocess
    import time

    if not _STARTUP:
        t0 = time.monotonic()
        env1 = {k: v for k, v in env.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "HYDRA_"))}
        subprocess.run([sys.executable, "-m", "hethub_jax.train", "--steps", "0"], env=env1, cwd=ROOT,
                       capture_output=True, timeout=120)
        _STARTUP.append(time.monotonic() - t0)
    return _STARTUP[0]


def _run_timed(cmd: list[str], timeout: float, env: dict) -> tuple[int, str, float]:
    """Run ``cmd`` (its own process group, killed at ``timeout``); returns its status, its stderr and
    the seconds from the first ``error:`` line on stderr to the end of the job."""
    import os
    import signal
    import subprocess
    import threading
    import time

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    lines: list[str] = []
    first: list[float] = []

    def read():
        for line in proc.stderr:
            if line.startswith(PREFIX) and not first:
                first.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(5)
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s (killed):\n{''.join(lines)[-3000:]}")
    end = time.monotonic()
    reader.join(10)
    return proc.returncode, "".join(lines), end - (first[0] if first else end)


# ---------------------------------------------------------------------------------------------------
# docs/errors.md

def render_doc() -> str:
    head = ("# Bad inputs and the errors they give\n\n"
            "Generated from `tests/test_bad_inputs.py` (`python tests/test_bad_inputs.py`); do not edit.\n"
            "Each input makes `python -m hethub_jax.train` exit with status 2 and print one line\n"
            "`python -m hethub_jax.train: error: <message>` before it writes a metrics or checkpoint file\n"
            "(and, except for the corrupt checkpoint, before the pipeline runtime is built). The message\n"
            "column is the pattern the test checks. Under `mpiexec`, every rank of the job ends within\n"
            f"{MPI_END_WITHIN_S:g} s of the error line once every rank has started (tested, plus one rank's measured\n"
            "start-up time), with status 2 and no MPI abort, and the error is printed once: a rank failing\n"
            "before MPI started (its command line or config) prefixes `rank R (island X): `, still starts MPI\n"
            "and reports the failure at the start-up gate; an error found after MPI started (plan, data,\n"
            "devices, handshake, outputs, runtime) is reported at the next agreement point, which every rank\n"
            "passes: the lowest rank that found it prints it (`rank R (island X): ...`, plus `(the same on\n"
            "rank(s) ...)`), every rank ends with status 2 (docs/training.md, Faults).\n\n"
            f"{len(CASES)} cases.\n\n"
            "| # | area | bad input | the message matches |\n|---|---|---|---|\n")
    rows = [f"| {i} | {c.category} | {c.bad_input}{' (mpiexec)' if c.mpi else ''} | "
            f"`{c.expect.replace('|', chr(92) + '|')}` |" for i, c in enumerate(CASES, 1)]
    return head + "\n".join(rows) + "\n"


def test_errors_doc_is_current():
    assert len(CASES) >= 25
    assert DOC.read_text() == render_doc(), "docs/errors.md is stale: run python tests/test_bad_inputs.py"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    DOC.write_text(render_doc())
    print(f"wrote {DOC}")
