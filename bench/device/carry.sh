#!/usr/bin/env bash
# What a device call carries, against its bounds (issue 40 item 1): the tracked tree, the untracked
# files git does not ignore (they travel too), and the `carry` paths (`.kit`: the SGLang kit
# site.tar.xz and the JIT cache cache.tar.xz).  The tool's limit is 64 MiB (67,108,864 bytes); the
# project keeps a call at or under 60,000,000 bytes (tests/test_repo_size.py).  Nothing is moved.
#
#   bash bench/device/carry.sh               # sizes now
#   bash bench/device/carry.sh cache FILE    # a call's returned cache.tar.xz -> .kit/cache.tar.xz,
#                                            # recompressed with xz -9e (the host packs it with a
#                                            # fast xz -3: ~4.2 -> ~2.9 MB), then the sizes; while the
#                                            # call would pass the bound, the largest flashinfer
#                                            # batch_prefill module is dropped from it
#   bash bench/device/carry.sh cache-budget  # bytes a JIT cache may take so that the call stays
#                                            # within the bound (run_stages.sh packs to it)
set -euo pipefail
cd "$(dirname "$0")/../.."   # the checkout this script is in, whatever the caller's directory
LIMIT=67108864
BOUND=60000000

tree_bytes() { (git ls-files -z | xargs -0 -r du -cb 2>/dev/null || true) | awk '$2 == "total" {s += $1} END {print s + 0}'; }
other_bytes() { (git ls-files -z --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null || true) \
                | awk '$2 == "total" {s += $1} END {print s + 0}'; }
kit_dir_bytes() { (du -cb .kit/* 2>/dev/null || true) | awk '$2 == "total" {s += $1} END {print s + 0}'; }
call_bytes() { echo $(( $(tree_bytes) + $(other_bytes) + $(kit_dir_bytes) )); }

sizes() {
  local tree other kit cache total
  tree=$(tree_bytes)
  other=$(other_bytes)
  kit=$(stat -c %s .kit/site.tar.xz 2>/dev/null || echo 0)
  cache=$(stat -c %s .kit/cache.tar.xz 2>/dev/null || echo 0)
  total=$(( tree + other + $(kit_dir_bytes) ))
  printf 'tracked tree   %11d\nuntracked      %11d (not ignored: carried too)\n.kit kit       %11d\n.kit cache     %11d\n' \
    "$tree" "$other" "$kit" "$cache"
  printf 'a call with .kit: %d bytes = %d.%02d MB of the %d.0 MB bound (64 MiB limit %d)\n' \
    "$total" $((total / 1000000)) $(( (total % 1000000) / 10000 )) $((BOUND / 1000000)) "$LIMIT"
  if [ "$total" -gt "$BOUND" ]; then echo "OVER the bound: see bench/device/README.md (The carry)" >&2; return 1; fi
}

case "${1:-size}" in
  size) sizes ;;
  cache-budget) echo $(( BOUND - $(call_bytes) + $(stat -c %s .kit/cache.tar.xz 2>/dev/null || echo 0) )) ;;
  cache)
    src=${2:?usage: carry.sh cache RETURNED_CACHE.tar.xz}
    mkdir -p .kit
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    xz -dc "$src" | tar -xf - -C "$tmp"
    pack() { (cd "$tmp" && find . -mindepth 1 \( -type f -o -type l \) -printf '%P\n' | LC_ALL=C sort \
              | tar -cf - -T - | xz -9e -T1) > .kit/cache.tar.xz.tmp && mv -f .kit/cache.tar.xz.tmp .kit/cache.tar.xz; }
    pack
    while [ "$(call_bytes)" -gt "$BOUND" ]; do
      big=$(cd "$tmp" && find . -path '*batch_prefill*' -name '*.so' -printf '%s %P\n' | sort -rn | head -1 | cut -d' ' -f2-)
      [ -n "$big" ] || break
      echo "dropped from the cache (the call would pass the bound): $big ($(stat -c %s "$tmp/$big") B)"
      rm -f "$tmp/$big"; pack
    done
    sizes ;;
  *) echo "usage: $0 [size | cache FILE | cache-budget]" >&2; exit 2 ;;
esac
