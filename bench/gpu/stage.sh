#!/usr/bin/env bash
# Stage Python wheels for the GPU machine, which has no package registry.
#
# A device call carries at most 64 MiB (the work tree included), but files the machine keeps
# outside the work tree (/root/...) last while it stays warm (30 s after each call). So the
# wheels are downloaded here, cut into parts that fit beside the work tree, and sent one
# part per call in quick succession; `install.sh` then reassembles and installs them there
# into /root/site (beside the image's own packages, never over them).
#
#   bash bench/gpu/stage.sh [LIST ...]     # default: bench/gpu/vllm-wheels.txt
#   bash bench/gpu/stage.sh bench/gpu/vllm-wheels.txt bench/gpu/pipeline-wheels.txt
#
# With pipeline-wheels.txt the Kafka broker's jars (.cache/kafka/lib, from `make kafka-jars`)
# travel too, and land in /root/extra/kafka-lib there (point DGSTREAM_KAFKA_LIB at it).
# Everything goes under .gpu/ (ignored by git). It prints the device calls to make.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(git rev-parse --show-toplevel)
cd "$root"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
lists=("$@")
[ ${#lists[@]} -gt 0 ] || lists=("$here/vllm-wheels.txt")
mkdir -p .gpu/wheels .gpu/parts
# The GPU machine runs CPython 3.12 on x86-64 (glibc 2.39): every manylinux tag up to it.
plats=()
for n in $(seq 5 40); do plats+=(--platform "manylinux_2_${n}_x86_64"); done
plats+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64 --platform linux_x86_64)
cat "${lists[@]}" | grep -v '^#' | grep . | sort -u > .gpu/pins.txt
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plats[@]}" -d .gpu/wheels -r .gpu/pins.txt
rm -f .gpu/parts/*
rm -rf .gpu/extra && mkdir -p .gpu/extra
if grep -q '^kafka_python' .gpu/pins.txt; then
  [ -d .cache/kafka/lib ] || { echo "no Kafka jars in .cache/kafka/lib: run make kafka-jars" >&2; exit 1; }
  cp -r .cache/kafka/lib .gpu/extra/kafka-lib
fi
# Only the wheels the lists name (.gpu/wheels may hold others from earlier runs).
names=$(sed -E 's/==.*//; s/[-_.]+/_/g' .gpu/pins.txt | tr 'A-Z' 'a-z')
keep=()
for w in .gpu/wheels/*.whl; do
  n=$(basename "$w" | cut -d- -f1 | sed -E 's/[-_.]+/_/g' | tr 'A-Z' 'a-z')
  if grep -qx "$n" <<<"$names"; then keep+=("$(basename "$w")"); fi
done
tar cf .gpu/wheels.tar -C .gpu/wheels "${keep[@]}" -C .. extra
# Each part gets what the work tree leaves of a call's 64 MiB, less 6 MiB of slack (the
# tree grows while others work in it).
tree_kib=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | du -c -k --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
part_kib=$(( 64 * 1024 - tree_kib - 6144 ))
[ "$part_kib" -gt 8192 ] || { echo "the work tree (${tree_kib} KiB) leaves too little room for parts" >&2; exit 1; }
split -b "${part_kib}k" -d -a 2 .gpu/wheels.tar .gpu/parts/part
rm -f .gpu/wheels.tar
cp "$here/install.sh" .gpu/install.sh
n=$(ls .gpu/parts | wc -l)
cat <<MSG
Staged $(du -sh .gpu/parts | cut -f1) in $n parts under .gpu/parts (work tree ${tree_kib} KiB).
On the device, one call per part, back to back, each with carry [".gpu/parts/partNN"] and:
    mkdir -p /root/stage && mv .gpu/parts/part* /root/stage/
then, with carry [".gpu/install.sh"]:
    bash .gpu/install.sh && export PYTHONPATH=/root/site:\$PWD && <command>
MSG
