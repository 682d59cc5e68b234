"""The test harness's own report: a cluster's service that died names itself in a failing test's
report (`exited_processes`, shown by tests/conftest.py), with its exit status and its log's end."""

from __future__ import annotations

from bitdelta.testing.cluster import Cluster, exited_processes


def test_a_service_that_exited_is_reported_until_its_cluster_stops(tmp_path):
    with Cluster(tmp_path) as c:
        bad = c.start("router-without-workers", "services.router", [])  # refused at start: exits 2
        bad.popen.wait(timeout=60)
        reports = [r for r in exited_processes() if r.startswith("router-without-workers ")]
        assert len(reports) == 1, reports
        assert f"python -m services.router at {bad.address}) exited with 2" in reports[0]
        assert "--workers (or BITDELTA_ROUTER_WORKERS) is required" in reports[0]  # the log's end
        assert str(bad.log) in reports[0]
    assert not [r for r in exited_processes() if r.startswith("router-without-workers ")]  # stopped: none


def test_a_running_service_is_not_reported(tmp_path):
    (tmp_path / "deltas").mkdir()
    with Cluster(tmp_path) as c:
        st = c.store(tmp_path / "deltas", name="serving-store")
        c.wait_serving(st)
        assert not [r for r in exited_processes() if r.startswith("serving-store ")]
