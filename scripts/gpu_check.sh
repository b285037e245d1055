#!/usr/bin/env bash
# The GPU check: the test suite (CUDA tests included) and the benchmark on a CUDA device, in
# under 5 minutes. It uses the machine's own torch (>= 2.10) and runs the package from this
# checkout. The benchmark includes the many-small-parameters regime and the medium one (with a
# forward under mixedopt.autocast). Results go to $OUT (or ./gpu-results): device.txt,
# pytest.txt, bench.txt, bench_gpu.json, in_backward.txt, bench_in_backward_gpu.json, floor.txt
# (scripts/floor_small.py), cast_path.txt (scripts/cast_path_threshold.py), bytes.txt (counted
# bytes per parameter, the same on any machine), demo.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

python3 -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name())" \
    | tee "$out/device.txt"
# Tests first, the benchmark even if a test fails: both results are wanted.
timeout 200 python3 -m pytest -q -p no:cacheprovider "${@:-tests}" 2>&1 | tail -40 | tee "$out/pytest.txt"
tests=${PIPESTATUS[0]}
timeout 200 python3 -m mixedopt.bench --device cuda --repeat 20 --json "$out/bench_gpu.json" \
    2>&1 | tee "$out/bench.txt"
bench=${PIPESTATUS[0]}
timeout 60 python3 -m mixedopt.bench.in_backward --device cuda --repeat 20 \
    --json "$out/bench_in_backward_gpu.json" 2>&1 | tee "$out/in_backward.txt"
timeout 40 python3 scripts/floor_small.py --device cuda --repeat 100 2>&1 | tee "$out/floor.txt"
timeout 90 python3 scripts/cast_path_threshold.py --device cuda 2>&1 | tee "$out/cast_path.txt"
timeout 60 python3 -m mixedopt.bench.bytes 2>&1 | tee "$out/bytes.txt"
timeout 60 python3 -m mixedopt --device cuda 2>&1 | tee "$out/demo.txt"
echo "pytest exit $tests, bench exit $bench"
exit $(( tests != 0 || bench != 0 ))
