"""The intra-op thread count: the rule on given readings, the order of the choices, and the
machine readings (/proc/stat, the cgroup quota, the CPU topology) on files written here."""

from __future__ import annotations

import logging
import os

import pytest

from mstar_core import threads
from mstar_core.threads import busy_between, choose, parse_count, pick, quota_cores, read_physical, read_quota


@pytest.mark.parametrize("cpus, busy, quota, physical, want", [
    (2, 1.0, None, None, 1),     # one of two cores held by another process
    (2, 0.0, None, None, 2),     # idle: every core
    (2, 0.4, None, None, 2),     # background noise takes no core
    (2, 0.6, None, None, 1),     # a core busy over half the time is taken
    (2, 2.0, None, None, 1),     # every core busy: still one thread
    (4, 7.5, None, None, 1),     # more busy than cores (a reading's rounding): at least one
    (2, None, None, None, 2),    # load unknown: the affinity count
    (8, 0.0, 2.5, None, 2),      # a quota of 2.5 cores: 2 threads, the third would be throttled
    (8, 0.0, 0.5, None, 1),      # a quota under one core: one thread
    (8, 0.0, None, 4, 4),        # 4 physical cores of 8 CPUs: 4
    (8, 6.0, 4.0, 4, 2),         # busy cores count against the CPUs, the caps apply after
    (16, 2.0, 4.0, 8, 4),        # the quota is the tighter cap
])
def test_pick_on_given_readings(cpus, busy, quota, physical, want):
    assert pick(cpus, busy, quota, physical) == want


def test_the_default_says_how_it_was_reached():
    t = choose(environ={}, reading=(2, 1.0, None, None))
    assert (t.count, t.source) == (1, "default")
    assert t.line() == "threads: 1 (2 cores, 1.0 busy with other processes; --threads N to choose)"
    t = choose(environ={}, reading=(8, 0.0, 2.0, 4))
    assert t.count == 2 and "8 cores, a CPU quota of 2, 4 physical, 0.0 busy" in t.why
    t = choose(environ={}, reading=(3, None, None, None))
    assert t.line() == "threads: 3 (3 cores, load of other processes not readable here; --threads N to choose)"


def test_the_flag_wins_over_the_environment_which_wins_over_the_default():
    busy_host = (2, 1.0, None, None)
    assert choose(3, {"OMP_NUM_THREADS": "1"}, busy_host).line() == "threads: 3 (--threads 3)"
    env = choose(None, {"OMP_NUM_THREADS": "2"}, busy_host)
    assert (env.count, env.source) == (2, "OMP_NUM_THREADS") and "OMP_NUM_THREADS=2" in env.why
    assert choose(None, {}, busy_host).source == "default"
    assert choose(None, {"OMP_NUM_THREADS": " "}, busy_host).source == "default"  # set but empty: not a choice


def test_openmp_nested_counts_take_their_first_level():
    assert choose(None, {"OMP_NUM_THREADS": "4,2"}, (2, 0.0, None, None)).count == 4


def test_a_bad_environment_value_is_ignored_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    t = choose(None, {"OMP_NUM_THREADS": "lots"}, (2, 1.0, None, None))
    assert (t.count, t.source) == (1, "default")
    assert "OMP_NUM_THREADS='lots' is not a thread count" in caplog.text


@pytest.mark.parametrize("text, want", [
    ("1", 1), (" 8 ", 8), ("1024", 1024), ("0", None), ("-1", None), ("1.5", None), ("two", None), ("", None),
    ("1025", None), ("2,1", None), ("²", None),
])
def test_parse_count(text, want):
    assert parse_count(text) == want


def test_busy_cores_from_two_proc_stat_readings():
    before = {0: (100, 1000), 1: (500, 1000)}
    after = {0: (200, 1100), 1: (525, 1100)}  # cpu0 busy the whole interval, cpu1 a quarter of it
    assert busy_between(before, after) == pytest.approx(1.25)
    assert busy_between(before, before) == 0.0  # no time passed: nothing to say, not a division by zero


def test_proc_stat_lines_of_the_affinity_set_only(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    #                 user nice system idle iowait irq softirq steal
    stat.write_text("cpu  10 0 10 80 0 0 0 0 0 0\n"
                    "cpu0 30 0 10 50 10 0 0 0 0 0\n"
                    "cpu1 5 0 5 90 0 0 0 0 0 0\n"
                    "cpu2 0 0 0 100 0 0 0 0 0 0\n"
                    "intr 1 2 3\n")
    monkeypatch.setattr(threads, "PROC_STAT", stat)
    assert threads._cpu_times([0, 2]) == {0: (40, 100), 2: (0, 100)}  # iowait counts as idle
    assert threads.read_busy([0, 1], sample_s=0) == 0.0  # the file did not change
    monkeypatch.setattr(threads, "PROC_STAT", tmp_path / "absent")
    assert threads.read_busy([0, 1], sample_s=0) is None


def test_without_proc_the_default_is_the_affinity_count(tmp_path, monkeypatch):
    monkeypatch.setattr(threads, "PROC_STAT", tmp_path / "absent")
    monkeypatch.setattr(threads, "CGROUP", tmp_path / "absent")
    monkeypatch.setattr(threads, "SYS_CPU", tmp_path / "absent")
    monkeypatch.setattr(threads, "affinity", lambda: [0, 1, 2])
    t = choose(environ={})
    assert t.count == 3 and "load of other processes not readable here" in t.why


@pytest.mark.parametrize("text, want", [
    ("max 100000", None), ("150000 100000", 1.5), ("200000 50000", 4.0), ("50000", 0.5), ("junk", None), ("", None),
])
def test_cgroup_v2_quota(text, want):
    assert quota_cores(text) == want


def test_read_quota_v2_and_v1_the_tightest(tmp_path):
    root = "0::/\n1:cpu,cpuacct:/\n"
    assert read_quota(tmp_path, root) is None  # no cgroup files: no quota
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert read_quota(tmp_path, root) is None  # v1 without a quota
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert read_quota(tmp_path, root) == 3.0
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert read_quota(tmp_path, root) == 1.0  # v2's 1 core is the tighter


def test_read_quota_follows_the_process_cgroup_and_those_above_it(tmp_path):
    own = "0::/system.slice/job.service\n"
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "system.slice" / "job.service").mkdir(parents=True)
    (tmp_path / "system.slice" / "cpu.max").write_text("400000 100000\n")
    (tmp_path / "system.slice" / "job.service" / "cpu.max").write_text("max 100000\n")
    assert read_quota(tmp_path, own) == 4.0  # the slice above binds
    (tmp_path / "system.slice" / "job.service" / "cpu.max").write_text("150000 100000\n")
    assert read_quota(tmp_path, own) == 1.5  # the service's own, tighter
    assert read_quota(tmp_path, "0::/\n") is None  # the root's alone: no quota there


def test_physical_cores_count_hyperthread_siblings_once(tmp_path):
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert read_physical([0, 1, 2, 3], tmp_path) == 2
    assert read_physical([0, 2], tmp_path) == 1
    assert read_physical([0, 4], tmp_path) is None  # a CPU whose topology is missing: not known


def test_this_machine_reads_sensibly():
    cpus, busy, quota, physical = threads.read_machine(sample_s=0.02)
    if hasattr(os, "sched_getaffinity"):
        assert cpus == len(os.sched_getaffinity(0))
    assert busy is None or 0.0 <= busy <= cpus + 0.5  # jiffies are coarse: a little slack
    assert quota is None or quota > 0
    assert physical is None or 1 <= physical <= cpus
