#!/usr/bin/env bash
# What a device call carries: the tracked tree + untracked files git does not ignore + `carry`
# paths, at most 64 MiB.  The tracked tree is ~32 MB and the SGLang kit 43 MB (+ a 4-5 MB JIT cache),
# so until the tree or the kit shrinks (issue 40), a call leaves out bench/results/, which nothing on
# the GPU host reads: this script takes it out of the index for the call and puts it back after.
#
#   bash bench/device/carry_view.sh on     # before run(...): bench/results untracked + ignored
#   bash bench/device/carry_view.sh off    # after the call: index and ignore list as before
#   bash bench/device/carry_view.sh size   # bytes a call would carry (tree + .kit), against 64 MiB
#
# While "on", a pre-commit hook refuses every commit (a commit then would delete bench/results).
# The files on disk are never touched.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCL=.git/info/exclude
HOOK=.git/hooks/pre-commit
MARK="# carry_view: bench/results left out of device calls"
LIMIT=$((64 * 1024 * 1024))

size() {
  local tree kit
  tree=$( (git ls-files -z | xargs -0 -r du -cb 2>/dev/null || true) | awk 'END {print $1 + 0}')
  kit=$( (du -cb .kit/* 2>/dev/null || true) | awk 'END {print $1 + 0}')
  echo "tracked tree $tree + .kit $kit = $((tree + kit)) bytes of $LIMIT ($(( (tree + kit) * 100 / LIMIT ))%)"
}

case "${1:-}" in
  on)
    if grep -qx "$MARK" "$EXCL" 2>/dev/null; then echo "already on"; size; exit 0; fi
    if ! git diff --cached --quiet; then echo "staged changes: commit or unstage them first" >&2; exit 2; fi
    git rm -r -q --cached bench/results
    printf '%s\n/bench/results/\n' "$MARK" >> "$EXCL"
    mkdir -p .git/hooks
    printf '#!/bin/sh\necho "carry_view is on (bench/results untracked for a device call): run bench/device/carry_view.sh off first" >&2\nexit 1\n' > "$HOOK"
    chmod +x "$HOOK"
    size ;;
  off)
    git reset -q -- bench/results
    if [ -f "$EXCL" ]; then
      grep -vx -e "$MARK" -e "/bench/results/" "$EXCL" > "$EXCL.tmp" || true
      mv "$EXCL.tmp" "$EXCL"
    fi
    if [ -f "$HOOK" ] && grep -q carry_view "$HOOK"; then rm -f "$HOOK"; fi
    git status --short bench/results | head -3
    size ;;
  size) size ;;
  *) echo "usage: $0 on|off|size" >&2; exit 2 ;;
esac
