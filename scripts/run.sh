#!/usr/bin/env bash
# One entry point that does all the set-up, then runs what you asked for.
#   scripts/run.sh demo   set up, then run the main job: `dkv demo` (etcd + 3 nodes + 3 engines, dKV on vs off)
#   scripts/run.sh test   set up, then run the test suite
# Set-up is idempotent and quick once done: Debian packages (etcd), a virtual
# environment in .venv, and this project installed into it with its pinned deps
# (for the tests also Modular MAX, the `max` extra).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv

# setup EXTRAS: etcd, .venv, and this project with the given pip extras (e.g. "test,max").
setup() {
  local extras=$1
  local headers=""  # Python's own headers, for the native pieces (dkv/_checked_copy.c, dkv/_store_index.c)
  "$PY" -c "import os, sysconfig; raise SystemExit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
    || headers="python3-dev"
  if ! command -v etcd >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1 \
      || ! command -v redis-server >/dev/null 2>&1 || ! command -v gcc >/dev/null 2>&1 \
      || ! command -v valgrind >/dev/null 2>&1 || [ ! -f /usr/include/xxhash.h ] || [ -n "$headers" ]; then
    echo "==> installing etcd (Debian package etcd-server), openssl (test certificates), redis-server (bench baseline)," \
      "gcc and libxxhash-dev (the native checked copy and lookup run), valgrind (instruction counts)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server iproute2 openssl redis-server \
      gcc libxxhash-dev valgrind $headers >/dev/null
  fi
  local stamp="$VENV/.dkv-installed"
  local pins
  pins=$(sha256sum pyproject.toml | cut -c1-16)
  if [ ! -x "$VENV/bin/python" ]; then
    echo "==> creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  case "$(cat "$stamp" 2>/dev/null)" in
    "$pins "*"$extras"*) return ;;   # these pins, with (at least) these extras, are installed
  esac
  echo "==> installing dKV and its pinned dependencies (extras: $extras) into $VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | { grep -v '^WARNING: Location' || true; }
  "$VENV/bin/python" -m pip install -q -e ".[$extras]" 2>&1 | { grep -v '^WARNING: Location' || true; }
  "$VENV/bin/python" -c "import dkv, ucxx, torch, msgpack, etcd3aio" >/dev/null
  if [[ ",$extras," == *",max,"* ]]; then
    "$VENV/bin/python" -c "import max.pipelines.kv_cache" >/dev/null
  fi
  if [[ ",$extras," == *",bench,"* ]]; then
    "$VENV/bin/python" -c "import redis, hiredis" >/dev/null
  fi
  echo "$pins $extras" > "$stamp"
}

cmd=${1:-}
shift || true
case "$cmd" in
  demo)
    setup test
    exec "$VENV/bin/dkv" demo "$@"
    ;;
  test)
    setup test,max,bench   # with Modular MAX (its own KV cache manager driven over dKV) and redis-py (scripts/bench.py)
    # two workers (pytest-xdist), a test file per worker at a time: most tests wait on real processes,
    # so two keep a 2-core machine busy; DKV_TEST_WORKERS=0 runs them in this process, one by one
    exec "$VENV/bin/python" -m pytest -q -n "${DKV_TEST_WORKERS:-2}" --dist loadfile "$@"
    ;;
  setup)
    setup test,max,bench
    ;;
  *)
    echo "usage: scripts/run.sh demo|test|setup [args...]" >&2
    exit 2
    ;;
esac
