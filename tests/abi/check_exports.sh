#!/usr/bin/env bash
# Every function the header declares (ZS_API) is exported by the library
# under a version node of cmake/zeroshard.map, and every name the map lists
# is one the header declares: a new function missing from the map would be
# hidden by its `local: *`, and a stale name would be a silent no-op.
#   check_exports.sh HEADER MAP LIBRARY
set -euo pipefail
header=$1 map=$2 lib=$3
declared=$(grep -o 'ZS_API [^(]*\bzs_[a-z0-9_]*(' "$header" | grep -o 'zs_[a-z0-9_]*(' | tr -d '(' | sort -u)
listed=$(sed 's,/\*.*\*/,,; /^ *\*/d; /^\/\*/d' "$map" | grep -o '^ *zs_[a-z0-9_]*;' | tr -d ' ;' | sort -u)
exported=$(nm -D --defined-only "$lib" | awk '$3 ~ /^zs_/ {print $3}' | sort -u)
status=0
for f in $(comm -23 <(echo "$declared") <(echo "$listed")); do
  echo "$f is declared in $(basename "$header") but not listed in $(basename "$map"): add it to the last node"
  status=1
done
for f in $(comm -13 <(echo "$declared") <(echo "$listed")); do
  echo "$f is listed in $(basename "$map") but not declared (ZS_API) in $(basename "$header")"
  status=1
done
for f in $(comm -23 <(echo "$declared") <(echo "$exported" | sed 's/@.*//' | sort -u)); do
  echo "$f is declared but $(basename "$lib") does not export it"
  status=1
done
unversioned=$(echo "$exported" | grep -v '@@ZEROSHARD_' || true)
if [ -n "$unversioned" ]; then
  echo "exported without a ZEROSHARD_ version node: $unversioned"
  status=1
fi
nodes=$(echo "$exported" | sed -n 's/.*@@//p' | sort | uniq -c | tr '\n' ' ')
[ $status -eq 0 ] && echo "$(echo "$declared" | wc -l) functions, all exported; per node: $nodes"
exit $status
