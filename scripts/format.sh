#!/usr/bin/env bash
# clang-format over every C++ file of the repository (single_include/ is generated: skipped).
#   scripts/format.sh          reformat in place
#   scripts/format.sh --check  fail if any file is not formatted
# The style is pinned to clang-format 14 (Debian 12); another major version formats a few
# constructs differently, so --check with another version reports and skips instead of failing.
set -euo pipefail
cd "$(dirname "$0")/.."
want=14
have=$(clang-format --version | sed -E 's/.*version ([0-9]+).*/\1/')
files=$(git ls-files --cached --others --exclude-standard '*.hpp' '*.ipp' '*.cpp' '*.h' '*.cu' | grep -v '^single_include/' || true)
if [ "${1:-}" = "--check" ]; then
  if [ "$have" != "$want" ]; then
    echo "skipped: clang-format $have is not the pinned version $want"
    exit 0
  fi
  # shellcheck disable=SC2086
  clang-format --dry-run --Werror $files
  echo "$(echo "$files" | wc -l) files formatted"
else
  # shellcheck disable=SC2086
  clang-format -i $files
fi
