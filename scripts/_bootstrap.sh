# Sourced by the scripts: a venv in .venv with this checkout installed (editable), with the
# extras in $VFIO_CXL_EXTRAS (scripts/test: "test"; the demos need none, so the main job's
# first run installs no pytest and no Ray).
# On a fresh Debian machine, python3-venv may be missing: install it (root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
extras="${VFIO_CXL_EXTRAS:-}"
recipe="$(sha256sum "$ROOT/pyproject.toml" | cut -c1-16)"
stamp="$VENV/.installed-$recipe${extras:+-$extras}"
if [ ! -e "$stamp" ]; then
    if ! python3 -m venv --help >/dev/null 2>&1 || ! python3 -c 'import ensurepip' 2>/dev/null; then
        [ "$(id -u)" = 0 ] || { echo "python3-venv is missing: run as root or: sudo apt-get install python3-venv" >&2; exit 1; }
        env -u APT_CONFIG apt-get update -q && env -u APT_CONFIG apt-get install -y -q python3-venv
    fi
    echo "setting up $VENV" >&2
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -e "$ROOT${extras:+[$extras]}"
    find "$VENV" -maxdepth 1 -name '.installed-*' ! -name ".installed-$recipe*" -delete   # another pyproject's
    touch "$stamp" "$VENV/.installed-$recipe"   # with extras, the bare package is there too
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
