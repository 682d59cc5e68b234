"""The reports on top of the quality, memory and merging evaluations: `bitdelta quality` builds
what is missing, evaluates every member (`bitdelta.family.quality`) and writes quality.md/.json
with its plots, the merging report's sections when `bitdelta merge report` has run, and
memory.md (`bitdelta.family.memory`). Nothing below imports this module, so the family and the
merging code never import each other.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

from bitdelta.family import MEMBERS, paths
from bitdelta.family.quality import (
    QualityConfig,
    built_precisions,
    evaluate_variant,
    machine,
    pareto_plot,
    plot,
    quality_markdown,
)


def merging_markdown(report_dir: Path) -> str:
    """The merging report's MonoSoup and K-Merge tables and plots, when `bitdelta merge report`
    has written them under report_dir/merging/ (it evaluates the same family)."""
    results = Path(report_dir) / "merging" / "results.json"
    if not results.is_file():
        return ""
    from bitdelta.merge.report import merging_sections

    lines = [
        "",
        "## Merging: MonoSoup and K-Merge",
        "",
        "From `bitdelta merge report` (full report: [merging/README.md](merging/README.md)).",
        "",
    ]
    return "\n".join(lines + merging_sections(json.loads(results.read_text()), images="merging/")) + "\n"


def run_reports(
    report_dir: Path,
    variants: list[str] | None = None,
    cfg: QualityConfig | None = None,
    root: str | os.PathLike | None = None,
    skip_build: bool = False,
    command: str | None = None,
    threads: int | None = None,
) -> dict:
    """Build what is missing, evaluate every variant, write quality.md/.json, the plot and memory.md.
    threads: torch's CPU threads (`build.set_threads`)."""
    cfg = cfg if cfg is not None else QualityConfig()
    import sys

    from bitdelta.family.build import build, read_stamp, set_threads, status
    from bitdelta.family.memory import memory_markdown

    set_threads(threads)
    p = paths(root)
    variants = variants or list(MEMBERS)
    if skip_build:
        from bitdelta.family import SERVING_MODE

        # the serving delta (data/deltas/) only when the modes include it
        need = ["base"] + [f"finetuned/{v}" for v in variants]
        need += [f"deltas/{v}." for v in variants] if SERVING_MODE in cfg.modes else []
        bad = {k: v for k, v in status(root).items() if v != "ok" and any(k.startswith(x) for x in need)}
        if bad:
            raise FileNotFoundError(f"the family is not built ({bad}); run `bitdelta family build`")
    else:
        build(variants, root=root)
    if command is None:
        # the command line as typed, whether through the `bitdelta` script or `python -m bitdelta.cli`
        command = "bitdelta " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["quality"] else "bitdelta quality"
    t = time.time()
    results = []
    for v in variants:
        print(f"[quality] {v}", flush=True)
        results.append(evaluate_variant(p, v, cfg, log=lambda s: print(s, flush=True)))
    build_info = {v: read_stamp(p, f"finetuned/{v}")["result"] for v in variants}
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    precisions = built_precisions(p, variants)
    previous = ""  # the machine and precision of the report replaced here, when not this run's
    try:
        old = json.loads((report_dir / "quality.json").read_text())
        if (old.get("machine"), old.get("trained_in")) != (machine(), precisions):
            previous = f"{old.get('machine')} (family trained in: {old.get('trained_in')}; made {old.get('made')})"
    except (OSError, json.JSONDecodeError):
        pass
    (report_dir / "quality.json").write_text(
        json.dumps(
            {
                "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": machine(),
                "command": command,
                "trained_in": precisions,
                "config": asdict(cfg),
                "results": results,
                "build": build_info,
            },
            indent=2,
            default=str,
        )
    )
    (report_dir / "quality.md").write_text(
        quality_markdown(results, cfg, command, build_info, precisions, previous) + merging_markdown(report_dir)
    )
    plot(results, report_dir / "gain_kept.png")
    pareto_plot(results, report_dir / "pareto.png")
    (report_dir / "memory.md").write_text(memory_markdown(p, variants, command))
    print(
        f"[quality] wrote {report_dir}/quality.md, quality.json, gain_kept.png, pareto.png, memory.md ({time.time() - t:.0f} s)",
        flush=True,
    )
    return {"results": results}
