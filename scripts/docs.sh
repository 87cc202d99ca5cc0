#!/usr/bin/env bash
# Builds the API reference from the headers' /// comments with Doxygen (Debian's doxygen) into
# build/docs/api/html/index.html. Any warning (an undocumented public name, a broken reference,
# a \param naming no parameter) fails the build and is printed.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v doxygen >/dev/null || { echo "scripts/docs.sh: needs doxygen (apt-get install doxygen)" >&2; exit 1; }
rm -rf build/docs/api
mkdir -p build/docs/api
if ! doxygen docs/Doxyfile || [ -s build/docs/api/warnings.log ]; then
  echo "scripts/docs.sh: Doxygen warnings (build/docs/api/warnings.log):" >&2
  cat build/docs/api/warnings.log >&2
  exit 1
fi
echo "API reference: build/docs/api/html/index.html"
