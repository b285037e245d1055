import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mixedopt.bench import launches, small, steps, timing
from mixedopt.bench.format import format_iteration
from mixedopt.bench.setup import DEFAULT_OPTIMIZERS

NUMEL = 1 << 16
PARAMS = 3
ELEMENTS = NUMEL * PARAMS

# Each parameter also holds a 0-dim float32 step counter (Adam, AdamW, RMSprop): 4 B per
# parameter tensor, i.e. 4 / NUMEL = 6e-5 B per element on top of the figures below. A relative
# tolerance of 1e-3 covers that, while a gradient kept in the wrong dtype (2 B/param off) or a
# state tensor too many or too few (4 B/param) is off by more than 10% and fails.
REL = 1e-3

PERSISTENT = {
    # weights 4 B + float32 gradient 4 B + state
    ("adam", "torch-foreach"): 4 + 4 + 8,
    ("adamw", "torch-foreach"): 4 + 4 + 8,
    ("rmsprop", "torch-foreach"): 4 + 4 + 4,
    ("sgd", "torch-foreach"): 4 + 4 + 4,
    # weights 4 B + float16 gradient 2 B + float32 state
    ("adam", "mixedopt"): 4 + 2 + 8,
    ("adamw", "mixedopt"): 4 + 2 + 8,
    ("rmsprop", "mixedopt"): 4 + 2 + 4,
    ("sgd", "mixedopt"): 4 + 2 + 4,
}

SMALL = ["--numel", str(NUMEL), "--params", str(PARAMS), "--repeat", "2", "--warmup", "1"]
SMALL += ["--stream-mib", "4", "--threads", "1", "--device", "cpu", "--no-iteration", "--no-small"]
SMALL += ["--no-launches", "--no-medium"]


def _run(tmp_path, *extra):
    path = tmp_path / "bench.json"
    assert steps.main([*SMALL, *extra, "--json", str(path)]) == 0
    return json.loads(path.read_text())


# mixedopt-fused is left out: compiling its kernels takes seconds; the rows shown as unavailable
# are covered by torch's RMSprop, which has no fused implementation.
VARIANTS = ["torch-foreach", "torch-fused", "mixedopt"]


def test_every_row_with_times_and_persistent_bytes(tmp_path, capsys):
    document = _run(tmp_path, "--no-memory", "--variants", ",".join(VARIANTS))
    rows = document["rows"]
    pairs = [(row["optimizer"], row["variant"]) for row in rows]
    assert pairs == [(o, v) for o in DEFAULT_OPTIMIZERS for v in VARIANTS]

    for row in rows:
        if not row["available"]:
            assert row["reason"], row
            assert row["median_ms"] is None
            continue
        assert row["median_ms"] > 0 and row["first_step_ms"] > 0, row
        assert len(row["step_ms"]) == 2 and all(t > 0 for t in row["step_ms"])
        assert len(row["warmup_ms"]) == 1
        assert row["achieved_gbps"] > 0 and row["stream_fraction"] > 0
        assert row["peak_extra_bytes"] is None  # --no-memory
        assert row["first_step_compile_ms"] is None  # only for mixedopt-fused
        if row["variant"] == "torch-foreach":
            assert row["ratio_to_foreach"] == pytest.approx(1.0)
        else:
            assert row["ratio_to_foreach"] > 0

    by_pair = {(row["optimizer"], row["variant"]): row for row in rows}
    for pair, expected in PERSISTENT.items():
        assert by_pair[pair]["available"], pair
        assert by_pair[pair]["persistent_bytes_per_param"] == pytest.approx(expected, rel=REL), pair
    assert by_pair["adam", "mixedopt"]["grad_dtype"] == "float16"
    assert by_pair["adam", "torch-foreach"]["grad_dtype"] == "float32"
    # Minimum traffic: grad read + weight read/write (8 B) + 8 B per state tensor.
    assert by_pair["adam", "mixedopt"]["min_bytes_per_param"] == 2 + 8 + 16
    assert by_pair["sgd", "torch-foreach"]["min_bytes_per_param"] == 4 + 8 + 8
    # torch has no fused RMSprop: shown, with the reason.
    assert not by_pair["rmsprop", "torch-fused"]["available"]
    assert "fused" in by_pair["rmsprop", "torch-fused"]["reason"]

    machine = document["machine"]
    assert machine["torch_version"] and machine["cpu_count"] >= 1
    assert machine["stream_bandwidth_gbps"] > 0

    out = capsys.readouterr().out
    assert "stream bandwidth" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows)
    assert len({len(line) for line in table}) == 1  # aligned


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_peak_memory_in_child_processes(tmp_path):
    numel, params = 1 << 20, 4
    document = _run(
        tmp_path,
        "--numel",
        str(numel),
        "--params",
        str(params),
        "--optimizers",
        "adam",
        "--variants",
        "torch-foreach,mixedopt",
    )
    rows = {row["variant"]: row for row in document["rows"]}
    for row in rows.values():
        assert row["peak_error"] is None, row
        assert row["peak_method"], row
        assert row["peak_extra_bytes"] is not None or row["peak_extra_upper_bound"] is not None
    if not _can_reset_hwm():
        pytest.skip("VmHWM cannot be reset here: only upper bounds were measured")
    for row in rows.values():
        assert row["peak_method"] == "VmHWM after clear_refs reset", row
        assert row["peak_extra_bytes"] > 0, row
    # torch's foreach Adam computes sqrt(exp_avg_sq) for all parameters at once: a float32
    # temporary of every element, 4 B/param, that a working measurement must see.
    foreach = rows["torch-foreach"]
    assert foreach["peak_extra_bytes"] >= 0.75 * 4 * numel * params
    assert foreach["peak_extra_bytes_per_param"] >= 3


def _can_reset_hwm():
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "argv",
    [["--optimizers", "adam,lion"], ["--variants", "torch-jit"], ["--numel", "0"]],
)
def test_bad_arguments_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        steps.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err
    if "lion" in argv[1]:
        assert "unknown optimizer 'lion'" in err


def test_training_iteration_benchmark_compares_three_optimizers():
    results = timing.iteration_benchmark(
        torch.device("cpu"), width=16, layers=4, batch=2, repeat=2, warmup=0
    )
    assert [r["variant"] for r in results] == list(timing.ITERATION_VARIANTS)
    assert results[0]["ratio"] == pytest.approx(1.0)
    assert all(r["median_ms"] > 0 and len(r["ms"]) == 2 for r in results)
    assert all(r["page_faults"] >= 0 for r in results)  # Linux counts them
    table = format_iteration(results)
    assert table.count("\n") == 1 + len(results)


def test_many_small_parameters_regime_reports_operations_and_times():
    text, figures = small.report(repeat=2)
    counts = figures["op_counts"]
    assert set(counts) == {pair for pair in small.PAIRS if "fused" not in pair}
    for by_library in counts.values():
        for found in by_library.values():
            assert found["128 params"]["backward"] > found["16 params"]["backward"] > 0
    assert set(figures["iteration_ms"]) == set(small.PAIRS)
    for found in figures["iteration_ms"].values():
        for library in ("torch", "mixedopt"):
            assert all(found[library][key] > 0 for key in ("iteration", "backward", "step"))
    for pair in small.PAIRS:
        assert pair in text


def test_the_small_regime_times_the_model_of_layers_and_width(monkeypatch):
    timed = []

    def iteration_times(pair, layers, width, repeat, device):
        timed.append((layers, width))
        one = {"iteration": 1.0, "backward": 1.0, "step": 1.0}
        return {"torch": one, "mixedopt": one}

    monkeypatch.setattr(small, "iteration_times", iteration_times)
    text, _ = small.report(repeat=2, layers=3, width=200)
    assert timed == [(3, 200)] * len(small.PAIRS)
    assert "Training iteration of 3 x Linear(200, 200)" in text


ROOT = Path(steps.__file__).resolve().parents[2]  # of this checkout


def run_python(argv, timeout):
    """``python *argv`` in a fresh interpreter that imports this checkout."""
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout
    )


def run_module(module, argv, timeout):
    """``python -m module *argv`` in a fresh interpreter that imports this checkout."""
    return run_python(["-m", module, *argv], timeout)


def _progress_lines(err):
    return [line for line in err.splitlines() if line.startswith("bench: ")]


@pytest.mark.parametrize("argv", [["--layers", "0"], ["--width", "-1"], ["--repeat", "0"]])
def test_bench_small_refuses_counts_below_one(argv):
    done = run_module("mixedopt.bench.small", argv, timeout=120)
    assert done.returncode == 2
    assert f"argument {argv[0]}: must be at least 1" in done.stderr


def test_without_tqdm_each_run_prints_a_progress_line_to_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # ``from tqdm import tqdm`` raises
    argv = ["--optimizers", "sgd,adam", "--variants", "torch-foreach,mixedopt"]
    _run(tmp_path, "--no-memory", *argv)
    lines = _progress_lines(capsys.readouterr().err)
    # stream bandwidth, 2 optimizers x (2 variants + their timed rounds), then the summary
    total = 1 + 2 * (2 + 1)
    assert lines[:-1] == [
        f"bench: run 1/{total}: stream bandwidth",
        f"bench: run 2/{total}: sgd, torch foreach: set-up, first and warm-up steps",
        f"bench: run 3/{total}: sgd, mixedopt default: set-up, first and warm-up steps",
        f"bench: run 4/{total}: sgd: 2 timed steps of each variant, in turn",
        f"bench: run 5/{total}: adam, torch foreach: set-up, first and warm-up steps",
        f"bench: run 6/{total}: adam, mixedopt default: set-up, first and warm-up steps",
        f"bench: run 7/{total}: adam: 2 timed steps of each variant, in turn",
    ]
    assert re.fullmatch(rf"bench: {total} runs done in \d+ s", lines[-1])


def test_without_tqdm_the_iteration_and_small_parameter_phases_print_progress(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    # Quick stand-ins: the fused variant compiles for seconds, the small regime runs minutes.
    monkeypatch.delitem(timing.ITERATION_VARIANTS, "mixedopt AdamW fused")
    monkeypatch.setattr(small, "report", lambda repeat, device: ("small table", {}))
    argv = [*SMALL, "--optimizers", "sgd", "--variants", "mixedopt", "--no-memory"]
    argv = [a for a in argv if a not in ("--no-iteration", "--no-small")]
    assert steps.main([*argv, "--mlp-width", "8", "--mlp-batch", "2"]) == 0
    captured = capsys.readouterr()
    lines = _progress_lines(captured.err)
    total = 1 + 2 + 3 + 1  # stream; sgd's variant and rounds; 2 iteration variants + rounds; small
    assert [line.split(": ", 2)[1] for line in lines[:-1]] == [
        f"run {i}/{total}" for i in range(1, total + 1)
    ]
    assert "training iteration, mixedopt AdamW: warm-up" in lines[4]
    assert "training iteration: 2 timed iterations" in lines[5]
    assert "many small parameters" in lines[6]
    assert lines[-1].startswith(f"bench: {total} runs done")
    assert "small table" in captured.out


def test_the_launches_of_the_accelerator_path_are_printed_and_written(
    tmp_path, monkeypatch, capsys
):
    # One model and one optimizer: the counts themselves are tested in test_launches.py.
    monkeypatch.setattr(launches, "MODELS", {"Linear(64, 64)": (64, True)})
    sgd = launches.OPTIMIZERS["SGD momentum"]
    monkeypatch.setattr(launches, "OPTIMIZERS", {"SGD": sgd})
    argv = [a for a in SMALL if a != "--no-launches"]
    path = tmp_path / "bench.json"
    argv += ["--optimizers", "sgd", "--variants", "mixedopt", "--no-memory", "--json", str(path)]
    assert steps.main(argv) == 0
    (row,) = json.loads(path.read_text())["launches"]
    assert (row["model"], row["optimizer"]) == ("Linear(64, 64)", "SGD")
    assert row["mixedopt"]["step"] > row["torch"]["step"] > 0
    out = capsys.readouterr().out
    assert "Kernel launches of the accelerator path" in out
    assert re.search(r"Linear\(64, 64\)\s+SGD\s+\+0\s+\+0\s", out)


def test_compile_column_is_empty_where_nothing_compiles(tmp_path):
    # Adam's parameters of at most 32Ki elements take torch's own fused update: no compilation.
    document = _run(
        tmp_path,
        "--no-memory",
        "--numel",
        "1024",
        "--optimizers",
        "adam",
        "--variants",
        "mixedopt-fused",
    )
    (row,) = document["rows"]
    assert row["available"], row
    assert row["compile_step"] is None
    assert row["first_step_compile_ms"] is None


def test_compile_column_shows_the_step_that_compiled(tmp_path):
    # In a fresh process, so that no earlier test has compiled the kernel already.
    path = tmp_path / "bench.json"
    argv = [*SMALL, "--numel", str(40_000), "--params", "1", "--no-memory"]
    argv += ["--optimizers", "sgd", "--variants", "mixedopt-fused", "--json", str(path)]
    done = run_module("mixedopt.bench", argv, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(path.read_text())["rows"]
    # SGD with momentum: the first step creates the momentum buffer, the second compiles.
    assert row["compile_step"] == 2
    assert row["first_step_compile_ms"] == row["warmup_ms"][0]
    assert "; compile " in done.stdout


def test_step_in_backward_benchmark_prints_a_speed_row_per_model(capsys):
    from mixedopt.bench import in_backward as bench_in_backward

    assert bench_in_backward.main(["--no-memory", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    for name in bench_in_backward.SPEED_MODELS:
        ratio = r" [\d.]+ = [\d.]+x \|"
        assert re.search(rf"\| {re.escape(name)} \| [\d.]+ \|{ratio}{ratio}$", out, re.M), out


def test_step_in_backward_benchmark_times_the_mlp_depth_asked_for(capsys):
    from mixedopt.bench import in_backward as bench_in_backward

    argv = ["--no-memory", "--repeat", "1", "--autocast-dtype", "bfloat16", "--mlp-layers", "2"]
    assert bench_in_backward.main(argv) == 0
    out = capsys.readouterr().out
    assert "| 2-layer 1024-wide MLP, batch 64 |" in out
    assert "4-layer" not in out


def test_in_turn_starts_each_round_with_the_next_variant():
    rounds = [small.in_turn(["a", "b", "c"], i) for i in range(4)]
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert small.in_turn([], 3) == []


def test_step_in_backward_benchmark_times_forwards_in_the_autocast_dtype_asked_for(
    capsys, monkeypatch
):
    from mixedopt.bench import in_backward as bench_in_backward

    monkeypatch.setattr(bench_in_backward, "SPEED_MODELS", {"2 x Linear(8, 8)": (2, 8, 4)})
    outputs = []
    iteration = bench_in_backward.iteration

    def recording(model, opt, x, in_backward, forward, dtype):
        with bench_in_backward.FORWARDS[forward](x.device.type, dtype):
            outputs.append((forward, model(x).dtype))
        iteration(model, opt, x, in_backward, forward, dtype)

    monkeypatch.setattr(bench_in_backward, "iteration", recording)
    argv = ["--no-memory", "--repeat", "2", "--autocast-dtype", "bfloat16"]
    assert bench_in_backward.main(argv) == 0
    assert "autocast(bfloat16)" in capsys.readouterr().out
    assert {dtype for _, dtype in outputs} == {torch.bfloat16}
    assert {forward for forward, _ in outputs} == {"torch.autocast", "mixedopt.autocast"}


def test_cast_path_script_hands_over_every_cast_only_in_its_variant():
    script = str(ROOT / "scripts" / "cast_path_threshold.py")
    small = ["--blocks", "1", "--width", "64", "--tokens", "16", "--repeat", "2"]
    result = run_python([script, *small], 300)
    assert result.returncode == 0, result.stderr
    # Weights of 4,096 and 16,384 elements: a CPU keeps them in buckets (32Ki elements at most).
    handed_over = dict(re.findall(r"^\| ([^|]+) \|.* \| (\d+) of 6 \|$", result.stdout, re.M))
    assert handed_over == {"torch": "0", "mixedopt": "0", "mixedopt, every cast": "6"}


def test_scaling_script_times_both_ways_of_scaling_the_three_large_weights():
    script = str(ROOT / "scripts" / "scaling_in_place.py")
    result = run_python([script, "--repeat", "2"], 300)
    assert result.returncode == 0, result.stderr
    # The MLP's three weights above 32Ki elements are stored alone, each scaled once.
    assert "3 gradients scaled per backward" in result.stdout
    for name in ("in place", "reference"):
        assert re.search(rf"^\| {name} \| [\d.]+ \| [\d.]+ \|$", result.stdout, re.M)


def test_medium_floor_script_times_each_variant_and_its_minimal_store_is_mixedopts_update():
    result = run_python([str(ROOT / "scripts" / "floor_medium.py"), "--repeat", "2"], 300)
    assert result.returncode == 0, result.stderr
    for name in ["torch", "torch + hooks", "minimal store", "mixedopt"]:
        row = rf"^\| {re.escape(name)} \| [\d.]+ \([\d.]+x\) \| [\d.]+ \([\d.]+x\) \| [\d.]+ \("
        assert re.search(row, result.stdout, re.M), name
    # Its times are those of mixedopt's work: the same float16 gradients, the same update.
    assert "The minimal store's weights are mixedopt's, bit for bit: yes" in result.stdout


def test_floor_script_times_each_variant_doing_torchs_update():
    result = run_python([str(ROOT / "scripts" / "floor_small.py"), "--repeat", "2"], 300)
    assert result.returncode == 0, result.stderr
    names = ["torch", "torch + hooks", "minimal store", "minimal store + scales", "mixedopt"]
    for name in names:
        assert re.search(rf"^\| {re.escape(name)} \| [\d.]+ \([\d.]+x\) \|", result.stdout, re.M)
    # Every variant made torch's update: 64 x Linear(64, 64) under autocast(float16) has
    # gradients float16 holds exactly, so the weights at the end are torch's.
    moved = dict(re.findall(r"^- (.+): (\S+)$", result.stdout, re.M))
    assert list(moved) == names[1:]
    assert all(float(value) == 0.0 for value in moved.values()), moved


def test_thread_benchmark_prints_a_throughput_row_per_thread_count():
    argv = ["--threads", "1,2", "--iterations", "3", "--rounds", "1", "--layers", "2"]
    done = run_module("mixedopt.bench.threads", [*argv, "--width", "16"], timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torch.set_num_threads(1)" in done.stdout
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+)x \|$", done.stdout, re.M)
    assert [int(row[0]) for row in rows] == [1, 2], done.stdout
    for _, theirs, ours, ratio in rows:
        assert float(theirs) > 0 and float(ours) > 0
        assert float(ratio) == pytest.approx(float(theirs) / float(ours), rel=0.05)
    assert "warning:" not in done.stdout and "error:" not in done.stdout


@pytest.mark.parametrize("argv", [["--threads", "1,0"], ["--threads", "1,x"], ["--rounds", "0"]])
def test_thread_benchmark_refuses_bad_counts(argv, capsys):
    from mixedopt.bench import threads as bench_threads

    with pytest.raises(SystemExit) as exit_info:
        bench_threads.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {argv[0]}:" in capsys.readouterr().err


def test_thread_benchmark_shows_errors_and_weights_that_are_not_finite(monkeypatch, capsys):
    from mixedopt.bench import threads as bench_threads

    class Failing(torch.optim.SGD):
        def step(self, closure=None):
            raise RuntimeError("boom\nsecond line")

    pair, _ = bench_threads.OPTIMIZERS["sgd"]
    torch_sgd, _ = small.PAIRS[pair]
    monkeypatch.setitem(small.PAIRS, pair, (torch_sgd, lambda p: Failing(p, lr=1e-3)))
    monkeypatch.setattr(bench_threads.Trainer, "finite", lambda self: False)
    argv = ["--optimizer", "sgd", "--threads", "2", "--iterations", "2", "--rounds", "2"]
    assert bench_threads.main([*argv, "--warmup", "1", "--layers", "1", "--width", "8"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^\| 2 \| [\d.]+ \| error: RuntimeError: boom \| – \|$", out, re.M), out
    assert "error: 2 thread(s), mixedopt: RuntimeError: boom" in out
    assert "weights not finite in the mixedopt model(s) of thread(s) 0, 1 (0-based)" in out


@pytest.mark.parametrize("variant", ["torch-foreach", "mixedopt"])
def test_every_optimizer_name_builds_and_steps(variant):
    from mixedopt.bench.setup import OPTIMIZERS, build, teardown

    for name in OPTIMIZERS:
        params, opt = build(name, variant, 2000, 2, torch.device("cpu"))
        opt.step()
        teardown(params, opt)
