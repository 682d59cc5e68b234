"""Read exported traces and break time to first token down by variant and arrival state.

    bitdelta traces ttft --from spans.jsonl [--png ttft.png]     # OTLP/JSON (one export per line)
    bitdelta traces ttft --jaeger http://localhost:16686         # Jaeger's query API
    bitdelta traces collect --address 127.0.0.1:4317 --out spans.jsonl   # a tiny OTLP/gRPC sink

What it reads: each request's `router.Generate` span carries the TTFT breakdown the router sent
the client (`ttft.queue_ms`, `ttft.delta_load_ms`, `ttft.schedule_ms`, `ttft.prefill_ms`,
`ttft.total_ms`), `model_id` and `arrival_state`; without a router (a worker called directly) the
`worker.Generate` spans are used. `other_ms` is what the named parts leave of the total (the hop
router -> worker, tokenising). For each (model, arrival state) it prints p50 and p99 of every
part and draws the p50s as stacked bars.

The sink writes what it receives as OTLP/JSON, one `ExportTraceServiceRequest` per line (the
format of the OpenTelemetry Collector's file exporter), so `--from` reads either.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import urllib.parse
import urllib.request
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PARTS = ("queue_ms", "delta_load_ms", "schedule_ms", "prefill_ms", "other_ms")
ROOTS = ("router.Generate", "worker.Generate")
ARRIVAL_ORDER = {"base": 0, "resident": 1, "loading": 2, "cold": 3}


@dataclass
class Span:
    """One exported span as read back. The TTFT summary reads `name`, `attrs` and `trace_id`; the
    ids and times are there for callers that rebuild a trace's tree (the tests check traces so)."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    service: str = ""
    attrs: dict = field(default_factory=dict)


# -- reading -----------------------------------------------------------------------------------------
def _any_value(v: dict):
    for k in ("stringValue", "boolValue", "doubleValue"):
        if k in v:
            return v[k]
    if "intValue" in v:
        return int(v["intValue"])
    if "arrayValue" in v:
        return [_any_value(x) for x in v["arrayValue"].get("values", [])]
    return None


def spans_from_otlp(doc: dict) -> list[Span]:
    """Spans of one OTLP/JSON `ExportTraceServiceRequest` (or a `TracesData`)."""
    out = []
    for rs in doc.get("resourceSpans", []):
        res = {a["key"]: _any_value(a["value"]) for a in rs.get("resource", {}).get("attributes", [])}
        for ss in rs.get("scopeSpans", []):
            for s in ss.get("spans", []):
                out.append(
                    Span(
                        s.get("traceId", ""),
                        s.get("spanId", ""),
                        s.get("parentSpanId", ""),
                        s["name"],
                        int(s.get("startTimeUnixNano", 0)),
                        int(s.get("endTimeUnixNano", 0)),
                        res.get("service.name", ""),
                        {a["key"]: _any_value(a["value"]) for a in s.get("attributes", [])},
                    )
                )
    return out


def spans_from_jaeger(doc: dict) -> list[Span]:
    """Spans of a Jaeger query API answer (`/api/traces`: {"data": [trace, ...]})."""
    out = []
    for t in doc.get("data", []):
        procs = {k: p.get("serviceName", "") for k, p in t.get("processes", {}).items()}
        for s in t.get("spans", []):
            parent = next((r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"), "")
            start = int(s["startTime"]) * 1000
            out.append(
                Span(
                    s["traceID"],
                    s["spanID"],
                    parent,
                    s["operationName"],
                    start,
                    start + int(s.get("duration", 0)) * 1000,
                    procs.get(s.get("processID"), ""),
                    {x["key"]: x.get("value") for x in s.get("tags", [])},
                )
            )
    return out


def read_file(path: str | Path) -> list[Span]:
    """OTLP/JSON: one export per line (collector file exporter, `traces collect`) or one document;
    or a saved Jaeger API answer."""
    text = Path(path).read_text()
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:
        docs = [json.loads(line) for line in text.splitlines() if line.strip()]
    out = []
    for d in docs:
        out += spans_from_jaeger(d) if "data" in d else spans_from_otlp(d)
    return out


def read_jaeger(url: str, service: str = "bitdelta-router", limit: int = 2000, lookback: str = "1h") -> list[Span]:
    q = urllib.parse.urlencode({"service": service, "limit": limit, "lookback": lookback})
    with urllib.request.urlopen(f"{url.rstrip('/')}/api/traces?{q}", timeout=30) as r:
        return spans_from_jaeger(json.load(r))


# -- the breakdown ------------------------------------------------------------------------------------
def ttft_rows(spans: Iterable[Span]) -> list[dict]:
    """One row per request: model_id, arrival_state and the TTFT parts in ms. Router spans when
    there are any; otherwise the worker's."""
    spans = list(spans)
    for root in ROOTS:
        rows = []
        for s in spans:
            a = s.attrs
            if s.name != root or "ttft.total_ms" not in a:
                continue
            parts = {p: float(a.get(f"ttft.{p}", 0.0)) for p in PARTS if p != "other_ms"}
            total = float(a["ttft.total_ms"])
            parts["other_ms"] = max(0.0, total - sum(parts.values()))
            rows.append(
                {
                    "model_id": a.get("model_id") or "base",
                    "arrival_state": a.get("arrival_state", ""),
                    "total_ms": total,
                    "trace_id": s.trace_id,
                    **parts,
                }
            )
        if rows:
            return rows
    return []


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["model_id"], r["arrival_state"])].append(r)
    out = []
    for (model, arrival), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], ARRIVAL_ORDER.get(kv[0][1], 9))):
        row = {"model_id": model, "arrival_state": arrival, "n": len(rs)}
        for p in (*PARTS, "total_ms"):
            vals = [r[p] for r in rs]
            row[f"{p}_p50"], row[f"{p}_p99"] = percentile(vals, 50), percentile(vals, 99)
        out.append(row)
    return out


def format_table(summary: list[dict]) -> str:
    head = f"{'model':<12} {'arrival':<9} {'n':>4}  " + "  ".join(
        f"{p.removesuffix('_ms'):>17}" for p in (*PARTS, "total_ms")
    )
    lines = [head, f"{'':<12} {'':<9} {'':>4}  " + "  ".join(f"{'p50 / p99 ms':>17}" for _ in (*PARTS, "total"))]
    for r in summary:
        cells = "  ".join(f"{r[p + '_p50']:>8.1f}/{r[p + '_p99']:<8.1f}" for p in (*PARTS, "total_ms"))
        lines.append(f"{r['model_id'][:12]:<12} {r['arrival_state']:<9} {r['n']:>4}  {cells}")
    return "\n".join(lines)


def plot(summary: list[dict], path: str | Path, title: str = "time to first token, p50 by part") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model_id']}\n{r['arrival_state']} (n={r['n']})" for r in summary]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(summary) + 2), 4.5))
    bottom = [0.0] * len(summary)
    for p in PARTS:
        vals = [r[f"{p}_p50"] for r in summary]
        ax.bar(labels, vals, bottom=bottom, label=p.removesuffix("_ms"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.scatter(labels, [r["total_ms_p99"] for r in summary], marker="_", s=400, color="black", label="total p99")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- a tiny OTLP/gRPC sink -------------------------------------------------------------------------------
class OtlpFileSink:
    """An OTLP/gRPC trace receiver that appends each export to `path` as one OTLP/JSON line."""

    def __init__(self, path: str | Path, address: str = "127.0.0.1:0"):
        from concurrent import futures

        import grpc
        from google.protobuf.json_format import MessageToDict
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tgrpc

        self.path, self._lock, self.exports = Path(path), threading.Lock(), 0
        sink = self

        class Servicer(tgrpc.TraceServiceServicer):
            def Export(self, request, context):
                line = json.dumps(_hex_ids(MessageToDict(request)), separators=(",", ":"))
                with sink._lock, open(sink.path, "a") as f:
                    f.write(line + "\n")
                    sink.exports += 1
                return tpb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tgrpc.add_TraceServiceServicer_to_server(Servicer(), self.server)
        self.port = self.server.add_insecure_port(address)
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def _hex_ids(doc):
    """OTLP/JSON writes trace and span ids as hex (protobuf's JSON mapping would give base64)."""
    import base64

    if isinstance(doc, dict):
        return {
            k: (base64.b64decode(v).hex() if k in ("traceId", "spanId", "parentSpanId") and v else _hex_ids(v))
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_hex_ids(x) for x in doc]
    return doc


# -- CLI -------------------------------------------------------------------------------------------------
def cmd_ttft(args: argparse.Namespace) -> None:
    spans = read_file(args.from_file) if args.from_file else read_jaeger(args.jaeger, args.service, args.limit)
    rows = ttft_rows(spans)
    if not rows:
        raise ValueError(f"no router.Generate or worker.Generate spans with a TTFT breakdown among {len(spans)} spans")
    summary = summarise(rows)
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    if args.png:
        plot(summary, args.png)
        print(f"wrote {args.png}")


def cmd_collect(args: argparse.Namespace) -> None:
    import time

    sink = OtlpFileSink(args.out, args.address)
    print(f"OTLP/gRPC sink on port {sink.port}, appending to {args.out}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        sink.stop()


def register(sub) -> None:
    t = sub.add_parser("traces", help="read exported traces: the TTFT breakdown per variant and arrival state")
    ts = t.add_subparsers(dest="traces_command", required=True, metavar="WHAT")
    c = ts.add_parser("ttft", help="p50/p99 of each TTFT part per variant and arrival state, and a stacked-bar PNG")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="from_file", type=Path, help="OTLP/JSON file (one export per line) or Jaeger JSON")
    src.add_argument("--jaeger", help="Jaeger query URL, e.g. http://localhost:16686")
    c.add_argument("--service", default="bitdelta-router", help="Jaeger: the service whose traces to read")
    c.add_argument("--limit", type=int, default=2000, help="Jaeger: most traces to read")
    c.add_argument("--png", type=Path, help="write the stacked bars (p50 per part) here")
    c.add_argument("--json", type=Path, help="write the summary as JSON here")
    c.set_defaults(func=cmd_ttft)
    c = ts.add_parser("collect", help="a tiny OTLP/gRPC receiver that appends spans to a file as OTLP/JSON")
    c.add_argument("--address", default="127.0.0.1:4317")
    c.add_argument("--out", type=Path, required=True)
    c.set_defaults(func=cmd_collect)
