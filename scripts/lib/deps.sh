# shellcheck shell=bash
# Sourced by scripts/*.sh: make sure Debian packages and PyPI tools are present.
#   ensure_debs PKG...   installs what is missing (as root), or prints the one apt-get line to run
#   ensure_conan         Conan 2 in a private venv (build/venv), put first on PATH

ensure_debs() {
  local missing=()
  local p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" -eq 0 ]; then
    echo "==> installing Debian packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "error: missing Debian packages. Run:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
}

ensure_conan() {
  local venv="$1/venv"
  if command -v conan >/dev/null 2>&1 && conan --version 2>/dev/null | grep -q "version 2"; then
    return 0
  fi
  if [ ! -x "$venv/bin/conan" ]; then
    echo "==> installing Conan 2 from PyPI into $venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "conan>=2,<3"
  fi
  export PATH="$venv/bin:$PATH"
}
