#!/usr/bin/env bash
# MPMD launch of configs/plans/tiny_2island.json, each island's rank started from its own Python
# environment (docs/launch.md):
#
#   mpiexec -n 1 $PY_FAST -m hethub_jax.train --plan P --island fast : -n 1 $PY_SLOW ... --island slow
#
# Usage: scripts/launch_mpmd.sh [extra hethub_jax.train arguments]
#   PY_FAST, PY_SLOW  Python of each island's environment (default: `python` on PATH, for both);
#                     both environments must have hethub-jax and mpi4py on the same MPI library
#   MPIEXEC           launcher (default: the mpiexec next to PY_FAST, else on PATH); MPICH (hydra)
#                     and Open MPI are recognised (Open MPI as root gets --allow-run-as-root)
#   STEPS             optimizer steps (default 3); PLAN: plan JSON (default tiny_2island.json)
# Writes metrics to $OUT_DIR/metrics.jsonl (default: a new temporary directory) and no checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_FAST=${PY_FAST:-$(command -v python)}
PY_SLOW=${PY_SLOW:-$PY_FAST}
if [[ -z "${MPIEXEC:-}" ]]; then
  MPIEXEC=$(dirname "$PY_FAST")/mpiexec
  [[ -x "$MPIEXEC" ]] || MPIEXEC=$(command -v mpiexec) || { echo "no mpiexec found" >&2; exit 2; }
fi
PLAN=${PLAN:-configs/plans/tiny_2island.json}
STEPS=${STEPS:-3}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}

flavour_args=()
version=$("$MPIEXEC" --version 2>&1 || true)
case "$version" in
  *HYDRA*) flavour="MPICH (hydra)" ;;
  *"Open MPI"*|*OpenRTE*|*PRRTE*|*prte*)
    flavour="Open MPI"
    [[ $(id -u) == 0 ]] && flavour_args+=(--allow-run-as-root)
    flavour_args+=(--oversubscribe) ;;
  *) flavour="unknown (MPICH/Open MPI syntax assumed)" ;;
esac
echo "launch_mpmd: $MPIEXEC ($flavour); fast island: $PY_FAST; slow island: $PY_SLOW" >&2

common=(-m hethub_jax.train --plan "$PLAN" --steps "$STEPS" --no-checkpoint --no-progress
        --metrics-file "$OUT_DIR/metrics.jsonl" "$@")
# islands take consecutive ranks in plan order: "fast" is rank 0, "slow" rank 1
exec "$MPIEXEC" "${flavour_args[@]}" \
  -n 1 "$PY_FAST" "${common[@]}" --island fast \
  : -n 1 "$PY_SLOW" "${common[@]}" --island slow
