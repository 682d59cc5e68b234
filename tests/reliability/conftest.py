"""The reliability suite's shared parts (issue #12): the whole system as real processes, a tally
of what was done to it, and the summary printed at the end of the run.

    system      one store + two workers + one router (session-scoped), over a tiny family of six
                distinct variants; the workers' delta budgets hold two deltas each, so eviction churns
    expected    each variant's greedy tokens for each prompt, computed once alone, before any load
    TALLY       requests sent / answered correctly / rejected by status, faults injected,
                recoveries, peak RSS (VmHWM) of every process the suite started

Every process is started exactly as a user would (`python -m services.<name>`, see
bitdelta/testing/cluster.py). Mocks: none, except the deliberately fake worker of
test_rel_faults.py (a gRPC server that streams nonsense), which says so.
"""

from __future__ import annotations

import pytest

from bitdelta.testing.family import make_test_family
from tests.support.reliability import N_VARIANTS, PROMPTS, TALLY, router_tokens, serving, start_system


def pytest_terminal_summary(terminalreporter):
    t = TALLY
    if not t.sent and not t.faults and not t.peak_rss_kib:
        return
    w = terminalreporter
    w.section("reliability summary")
    w.line(
        f"requests sent {t.sent}; answered correctly (tokens checked) {t.correct}; answered (unchecked) "
        f"{t.answered}; rejected by status {sum(t.rejected.values())}: "
        + ", ".join(f"{k} {v}" for k, v in sorted(t.rejected.items()))
    )
    w.line("faults injected: " + (", ".join(f"{k} {v}" for k, v in sorted(t.faults.items())) or "none"))
    w.line("recoveries: " + (", ".join(f"{k} {v}" for k, v in sorted(t.recoveries.items())) or "none"))
    for label, kib in sorted(t.peak_rss_kib.items()):
        w.line(f"peak RSS (VmHWM) {label:<34} {kib / 1024:8.1f} MiB")
    for n in t.notes:
        w.line(n)


@pytest.fixture(scope="session")
def family(tmp_path_factory):
    """Six distinct variants v0..v5 (each its own fine-tune, so a mix-up changes tokens), a delta for
    another base and a corrupted one."""
    return make_test_family(tmp_path_factory.mktemp("rel_family"), n_variants=N_VARIANTS, merged=False)


@pytest.fixture(scope="session")
def system(family, tmp_path_factory):
    c = start_system(
        family,
        tmp_path_factory.mktemp("rel_system"),
        "system",
        shared_memory=True,
        router_extra=(
            "--max-in-flight-per-worker",
            "8",
            "--max-queue",
            "24",
            "--max-queue-per-variant",
            "12",
            "--max-prompt-bytes",
            "65536",
        ),
    )
    with serving(c):
        yield c


@pytest.fixture(scope="session")
def expected(system, family) -> dict[tuple[str, str], list[int]]:
    """(variant, prompt) -> greedy tokens, each computed once alone (one request in the system)."""
    out = {}
    for model in ["", *family.variants]:
        for prompt in PROMPTS:
            out[(model, prompt)] = router_tokens(system.r.address, model, prompt)
            TALLY.answered += 1  # the reference itself (alone: nothing to compare with)
    assert len({tuple(out[(m, PROMPTS[0])]) for m in ["", *family.variants]}) > 1, "variants must differ"
    return out
