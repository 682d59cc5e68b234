"""The merging report on the real model family: `bitdelta merge report`.

MonoSoup: each fine-tune's MonoSoup against the fine-tune and the base, on
the variant's own held-out split (in-distribution) and on the other
variants' splits (out-of-distribution), as the paper measures.

K-Merge: eight LoRA adapters trained here on sub-splits of the family's
corpora (two per corpus, so the similar pairs are known), streamed through
pools of several configurations; per task the score is the served adapter's
held-out next-token accuracy ÷ the task's own adapter's.

Writes <out>/results.json, <out>/README.md and PNG plots. Artifacts go under
the data directory: adapters in <data>/adapters/<task>/ (PEFT layout),
MonoSoup checkpoints in <data>/merge/monosoup/<variant>/.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from bitdelta.merge.lora import LoraConfig

# task -> (corpus, subsets): two related tasks per corpus.
TASKS: dict[str, tuple[str, list[str]]] = {
    "code-asyncio": ("stdlib", ["asyncio"]),
    "code-email": ("stdlib", ["email"]),
    "play-comedy": ("shakespeare", ["comedy"]),
    "play-tragedy": ("shakespeare", ["tragedy"]),
    "bible-ot": ("kjv", ["ot"]),
    "bible-nt": ("kjv", ["nt"]),
    "math-mul": ("arithmetic", ["mul"]),
    "math-word": ("arithmetic", ["word"]),
}
# Arrival order: one task of each corpus, then their siblings.
STREAM = ["code-asyncio", "play-comedy", "bible-ot", "math-mul", "code-email", "play-tragedy", "bible-nt", "math-word"]
TRAIN_CHARS = 300_000  # a seeded sample of whole documents; 24 steps × 4 × 65 tokens need far less
HELDOUT_CHARS = 80_000
DEFAULT_LORA = LoraConfig()  # rank 8 on q_proj, v_proj; 24 steps of 4×64 tokens


def _log(msg: str) -> None:
    print(f"[merge] {msg}", flush=True)


def adapters_dir() -> Path:
    from bitdelta.family import data_dir

    return data_dir() / "adapters"


def _sample(docs, limit: int, seed: int) -> str:
    docs = list(docs)
    random.Random(seed).shuffle(docs)
    out, n = [], 0
    for d in docs:
        if n >= limit:
            break
        out.append(d.text)
        n += len(d.text)
    return "\n\n".join(out)[:limit]


def task_texts(task: str) -> tuple[str, str]:
    """(training text, held-out text) of a task: documents of its sub-split, sampled with a fixed seed."""
    from bitdelta.family import corpora

    corpus, subsets = TASKS[task]
    train = _sample(corpora.documents(corpus, "train", subsets), TRAIN_CHARS, seed=1)
    heldout = _sample(corpora.documents(corpus, "heldout", subsets), HELDOUT_CHARS, seed=2)
    return train, heldout


def train_adapters(
    cfg: LoraConfig = DEFAULT_LORA, tasks: list[str] | None = None, out: Path | None = None, force: bool = False
) -> dict[str, Path]:
    """Train the task set's adapters (skipping those already trained with the same recipe)."""
    from bitdelta import family
    from bitdelta.evaluate import tokenize
    from bitdelta.merge import lora
    from bitdelta.merge.adapter import save_adapter
    from bitdelta.model import load_model

    tasks = tasks or list(TASKS)
    unknown = set(tasks) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks {sorted(unknown)}; the task set is {list(TASKS)}")
    out = Path(out) if out else adapters_dir()
    base = family.paths().base
    if not (base / "config.json").is_file():
        raise FileNotFoundError(f"no base model at {base}: run `bitdelta family build` first")
    recipe = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.__dict__.items()}
    model, done = None, {}
    for task in tasks:
        d = out / task
        rec_file = d / "training.json"
        if not force and rec_file.is_file() and json.loads(rec_file.read_text()).get("recipe") == recipe:
            _log(f"{task}: up to date ({d})")
            done[task] = d
            continue
        model = model or load_model(base)
        train, heldout = task_texts(task)
        tokens = tokenize(base, train)
        adapter, record = lora.train(model, tokens, cfg, desc=f"lora {task}")
        record = {
            "recipe": recipe,
            "task": task,
            "corpus": TASKS[task][0],
            "subsets": TASKS[task][1],
            "train_tokens": tokens.numel(),
            **record,
        }
        save_adapter(
            adapter,
            d,
            base_model=str(base),
            extra_files={"heldout.txt": heldout, "training.json": json.dumps(record, indent=2)},
        )
        _log(f"{task}: loss {record['loss_first']:.3f} -> {record['loss_last_5']:.3f} in {record['seconds']} s")
        done[task] = d
    return done


# ----------------------------------------------------------------------------- MonoSoup


def monosoup_part(n_windows: int, seq_len: int, math_problems: int = 40) -> dict:
    """Uses the project's evaluator (bitdelta.evaluate): the same held-out windows and
    perplexity as reports/quality, and its exact-match check for math."""
    from bitdelta import evaluate as ev
    from bitdelta import family
    from bitdelta.family.finetune import corpus_tokens
    from bitdelta.merge.monosoup import monosoup_checkpoint
    from bitdelta.model import load_model

    p = family.paths()
    missing = [v for v in p.variants if not (p.finetuned[v] / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"fine-tunes missing for {missing}: run `bitdelta family build` first")
    wins = {v: ev.windows(corpus_tokens(p.base, p.corpus[v], "heldout"), n_windows, seq_len) for v in p.variants}
    tok = ev.tokenizer(p.base)
    probs = family.corpora.problems("heldout")
    probs = probs[:: max(1, len(probs) // math_problems)][:math_problems]  # spread over kinds, as the quality report

    def evaluate(ckpt: Path, exact_match: bool) -> dict:
        model = load_model(ckpt)
        res = {split: ev.score(model, w, batch=4)[0].as_dict() for split, w in wins.items()}
        if exact_match and probs:
            res["math_exact_match"] = {k: v for k, v in ev.exact_match(model, tok, probs, 8).items() if k != "samples"}
        del model
        return res

    res: dict = {
        "windows": n_windows,
        "seq_len": seq_len,
        "rule": "entropy",
        "variants": list(p.variants),
        "math_problems": len(probs),
    }
    t0 = time.perf_counter()
    res["base"] = evaluate(p.base, exact_match="math" in p.variants)
    res["finetuned"], res["monosoup"], res["layers"] = {}, {}, {}
    for v in p.variants:
        out = p.root / "merge" / "monosoup" / v
        if (
            not (out / "monosoup.json").is_file()
            or (out / "monosoup.json").stat().st_mtime < (p.finetuned[v] / "config.json").stat().st_mtime
        ):
            _log(f"monosoup {v}")
            _, layers = monosoup_checkpoint(p.base, p.finetuned[v], out)
        else:
            layers = json.loads((out / "monosoup.json").read_text())["layers"]
        mats = [x for x in layers.values() if not x["skipped"]]
        ks = sorted(x["k"] for x in mats)
        res["layers"][v] = {
            "matrices": len(mats),
            "k_median": ks[len(ks) // 2],
            "k_min": ks[0],
            "k_max": ks[-1],
            "rank_median": sorted(x["rank"] for x in mats)[len(mats) // 2],
            "lambda_high_mean": sum(x["lambda_high"] for x in mats) / len(mats),
        }
        _log(f"evaluate {v}: fine-tune and MonoSoup on {len(wins)} splits")
        res["finetuned"][v] = evaluate(p.finetuned[v], exact_match=v == "math")
        res["monosoup"][v] = evaluate(out, exact_match=v == "math")
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


# ----------------------------------------------------------------------------- K-Merge


def kmerge_configs(one_adapter_bytes: int) -> list[tuple[str, dict]]:
    return [
        ("K=8 (every task its own)", {"k": 8}),
        ("K-Merge K=4", {"k": 4}),
        ("K-Merge++ K=4, t=0.03 (paper)", {"k": 4, "threshold": 0.03}),
        # 0.14 sits in the gap of this task set's similarity matrix (chosen after seeing it).
        ("K-Merge++ K=4, t=0.14", {"k": 4, "threshold": 0.14}),
        ("OPCM merge K=4", {"k": 4, "merge": "opcm"}),
        ("byte budget 3.5 adapters", {"k": None, "budget_bytes": int(3.5 * one_adapter_bytes)}),
        ("K-Merge K=2", {"k": 2}),
        ("K=2 + quality gate 0.97", {"k": 2, "gate": 0.97}),
        ("K-Merge K=1", {"k": 1}),
    ]


def kmerge_part(n_windows: int, seq_len: int, lora_cfg: LoraConfig = DEFAULT_LORA) -> dict:
    from bitdelta import family
    from bitdelta.merge.adapter import load_adapter, similarity
    from bitdelta.merge.evaluate import adapter_evaluator
    from bitdelta.merge.kmerge import AdapterPool, mean_score, stream

    dirs = train_adapters(lora_cfg)
    base = family.paths().base
    own = {t: load_adapter(dirs[t]) for t in STREAM}
    texts = {t: (dirs[t] / "heldout.txt").read_text(errors="replace") for t in STREAM}
    acc, full = adapter_evaluator(base, texts, n_windows, seq_len)

    t0 = time.perf_counter()
    res: dict = {
        "windows": n_windows,
        "seq_len": seq_len,
        "stream": STREAM,
        "tasks": {t: TASKS[t] for t in STREAM},
        "adapter_bytes": own[STREAM[0]].nbytes,
        "lora": json.loads((dirs[STREAM[0]] / "training.json").read_text()),
    }
    res["training"] = {
        t: {k: json.loads((dirs[t] / "training.json").read_text())[k] for k in ("loss_first", "loss_last_5", "seconds")}
        for t in STREAM
    }
    res["similarity"] = [[similarity(own[a], own[b]) for b in STREAM] for a in STREAM]
    res["own"] = {t: full(own[t], t).as_dict() for t in STREAM}
    res["base"] = {t: full(None, t).as_dict() for t in STREAM}
    res["configs"] = []
    for label, kw in kmerge_configs(res["adapter_bytes"]):
        _log(f"pool: {label}")
        pool = AdapterPool(**kw, evaluate=acc if kw.get("gate") else None)
        decisions = stream(pool, [(t, own[t]) for t in STREAM])
        per_task = {}
        for t in STREAM:
            served = full(pool.adapter_for(t), t)
            per_task[t] = {
                "slot": pool.task_slot[t],
                "acc": served.acc,
                "ppl": served.ppl,
                "score": served.acc / res["own"][t]["acc"],
                "ppl_ratio": res["own"][t]["ppl"] / served.ppl,
            }
        res["configs"].append(
            {
                "label": label,
                "options": {k: v for k, v in kw.items()},
                "slots": len(pool.slots),
                "bytes": pool.nbytes,
                "groups": [s.tasks for s in pool.slots],
                "decisions": [
                    {
                        "task": d.task,
                        "action": d.action,
                        "slot": d.slot,
                        "reason": d.reason,
                        "max_similarity": max(d.similarities) if d.similarities else None,
                        "gate": d.gate,
                    }
                    for d in decisions
                ],
                "per_task": per_task,
                "mean_score": mean_score(per_task),
                "mean_ppl_ratio": sum(v["ppl_ratio"] for v in per_task.values()) / len(per_task),
            }
        )
    res["base_mean_score"] = sum(res["base"][t]["acc"] / res["own"][t]["acc"] for t in STREAM) / len(STREAM)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


# ----------------------------------------------------------------------------- writing


def _plot_monosoup(ms: dict, path: Path) -> None:
    """Perplexity ÷ the fine-tune's, in and out of distribution: below 1 is better than the fine-tune."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs = ms["variants"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, kind in zip(axes, ("in-distribution", "out-of-distribution (mean of the other splits)")):
        rows = []
        for v in vs:
            splits = [v] if kind == "in-distribution" else [s for s in vs if s != v]
            mean = lambda d, sp=splits: sum(d[s]["ppl"] for s in sp) / len(sp)
            ft = mean(ms["finetuned"][v])
            rows.append((mean(ms["base"]) / ft, mean(ms["monosoup"][v]) / ft))
        x = torch.arange(len(vs)).float()
        for i, (name, color) in enumerate((("base", "#999999"), ("MonoSoup", "#ff7f0e"))):
            bars = ax.bar((x + (i - 0.5) * 0.38).tolist(), [r[i] for r in rows], 0.38, label=name, color=color)
            ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.axhline(1.0, color="#1f77b4", lw=1.5, label="fine-tune (= 1)")
        ax.set_xticks(x.tolist(), vs)
        ax.set_ylabel("perplexity ÷ fine-tune's (lower is better)")
        ax.set_title(f"MonoSoup, {kind}", fontsize=10)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kmerge(km: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = km["stream"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(17, 5.5), gridspec_kw={"width_ratios": [1, 1.9]})
    sim = torch.tensor(km["similarity"])
    off = sim - torch.diag(sim.diagonal())
    top = float(off.max())  # colour the off-diagonal range; the diagonal (1.0) saturates
    im = ax1.imshow(sim.numpy(), cmap="viridis", vmin=0.0, vmax=top)
    ax1.set_xticks(range(len(tasks)), tasks, rotation=60, ha="right")
    ax1.set_yticks(range(len(tasks)), tasks)
    for i in range(len(tasks)):
        for j in range(len(tasks)):
            ax1.text(
                j,
                i,
                f"{sim[i, j]:.2f}",
                ha="center",
                va="center",
                fontsize=7,
                color="black" if sim[i, j] > 0.6 * top else "white",
            )
    ax1.set_title("adapter similarity (mean cosine of BA over modules)\ncolour scale: off-diagonal range")
    fig.colorbar(im, ax=ax1, fraction=0.046)
    cfgs = km["configs"]
    width = 0.8 / len(cfgs)
    for i, c in enumerate(cfgs):
        ax2.bar(
            [j + (i - len(cfgs) / 2 + 0.5) * width for j in range(len(tasks))],
            [c["per_task"][t]["score"] for t in tasks],
            width,
            label=f"{c['label']} ({c['mean_score']:.3f})",
        )
    ax2.plot(
        range(len(tasks)),
        [km["base"][t]["acc"] / km["own"][t]["acc"] for t in tasks],
        "k_",
        markersize=18,
        mew=2,
        label=f"base model ({km['base_mean_score']:.3f})",
    )
    ax2.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
    lo = min(min(c["per_task"][t]["score"] for t in tasks for c in cfgs), km["base_mean_score"]) - 0.02
    ax2.set_ylim(max(0.0, lo), 1.02)
    ax2.set_ylabel("served adapter acc ÷ own adapter acc")
    ax2.set_title("K-Merge score per task (mean in legend)")
    ax2.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _monosoup_md(ms: dict, images: str = "") -> list[str]:
    vs = ms["variants"]
    out = [
        "## MonoSoup (arXiv:2602.09689) on the real family",
        "",
        f"Each fine-tune's MonoSoup (rank rule: entropy; no data, no knobs) against the fine-tune and the base. "
        f"Perplexity on {ms['windows']} held-out windows of {ms['seq_len']} tokens per split. In-distribution (ID) "
        f"is the variant's own split; out-of-distribution (OOD) is the mean over the other three variants' splits. "
        f"Gain kept = (base − MonoSoup) / (base − fine-tune) on the ID split.",
        "",
        "| variant | ID base | ID fine-tune | ID MonoSoup | gain kept | OOD base | OOD fine-tune | OOD MonoSoup | median k / rank | mean λ_high |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in vs:
        others = [s for s in vs if s != v]
        b, f, m = ms["base"][v]["ppl"], ms["finetuned"][v][v]["ppl"], ms["monosoup"][v][v]["ppl"]
        ood = [
            sum(d[s]["ppl"] for s in others) / len(others) for d in (ms["base"], ms["finetuned"][v], ms["monosoup"][v])
        ]
        kept = f"{(b - m) / (b - f):.0%}" if b > f else "n/a (fine-tune ≥ base)"
        lay = ms["layers"][v]
        out.append(
            f"| {v} | {b:.2f} | {f:.2f} | {m:.2f} | {kept} | {ood[0]:.2f} | {ood[1]:.2f} | {ood[2]:.2f} | "
            f"{lay['k_median']} / {lay['rank_median']} | {lay['lambda_high_mean']:.3f} |"
        )
    out += [""] + _monosoup_notes(ms)
    out += [
        "",
        "Every split, every model (perplexity; rows: model, columns: held-out split):",
        "",
        "| model | " + " | ".join(vs) + " |",
        "|---|" + "---|" * len(vs),
    ]
    out.append("| base | " + " | ".join(f"{ms['base'][s]['ppl']:.2f}" for s in vs) + " |")
    for v in vs:
        for kind, d in (("fine-tune", ms["finetuned"][v]), ("MonoSoup", ms["monosoup"][v])):
            out.append(f"| {v} {kind} | " + " | ".join(f"{d[s]['ppl']:.2f}" for s in vs) + " |")
    out += ["", f"![MonoSoup]({images}monosoup.png)", ""]
    return out


def _kmerge_md(km: dict, images: str = "") -> list[str]:
    tasks = km["stream"]
    lc = km["lora"]
    secs = sum(v["seconds"] for v in km["training"].values())
    out = [
        "## K-Merge (arXiv:2510.13537) with LoRA adapters trained here",
        "",
        f"Eight rank-{lc['rank']} LoRA adapters on {', '.join(lc['targets'])} of the base (α={lc['alpha']}, "
        f"{lc['steps']} AdamW steps of {lc['batch']}×{lc['seq_len']} tokens, lr {lc['lr']}, shared A seed; "
        f"{secs:.0f} s wall for all eight with one thread on the shared 2-core machine, about 2 CPU-s per step), "
        f"two per corpus on its sub-splits (`bitdelta merge adapters`; "
        f"PEFT layout in data/adapters/). Arrival order: {', '.join(tasks)}. Metric: next-token accuracy on "
        f"{km['windows']} held-out windows of {km['seq_len']} tokens of the task's sub-split; "
        f"score = served adapter ÷ the task's own adapter (the paper's score). The base model scores "
        f"{km['base_mean_score']:.3f} on the same scale.",
        "",
        "| task | corpus / sub-split | base acc | own acc | train loss first → last |",
        "|---|---|---|---|---|",
    ]
    for t in tasks:
        c, s = km["tasks"][t]
        tr = km["training"][t]
        out.append(
            f"| {t} | {c} / {', '.join(s)} | {km['base'][t]['acc']:.4f} | {km['own'][t]['acc']:.4f} | "
            f"{tr['loss_first']:.2f} → {tr['loss_last_5']:.2f} |"
        )
    out += [
        "",
        "| pool | slots | bytes | groups | mean score | mean ppl ratio | " + " | ".join(tasks) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(tasks),
    ]
    for c in km["configs"]:
        groups = "; ".join("+".join(g) for g in c["groups"])
        rejected = [d["task"] for d in c["decisions"] if d["action"] == "reject"]
        if rejected:
            groups += f"; base serves {', '.join(rejected)}"
        out.append(
            f"| {c['label']} | {c['slots']} | {c['bytes']:,} | {groups} | {c['mean_score']:.3f} | "
            f"{c['mean_ppl_ratio']:.3f} | " + " | ".join(f"{c['per_task'][t]['score']:.3f}" for t in tasks) + " |"
        )
    out += [""] + _kmerge_notes(km)
    out += [
        "",
        "Similarity of the adapters (mean over modules of the cosine of the dense BA):",
        "",
        "| | " + " | ".join(tasks) + " |",
        "|---|" + "---|" * len(tasks),
    ]
    for t, row in zip(tasks, km["similarity"]):
        out.append(f"| {t} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    out += ["", f"![K-Merge]({images}kmerge.png)", ""]
    return out


def _monosoup_notes(ms: dict) -> list[str]:
    vs = ms["variants"]
    id_better = [v for v in vs if ms["monosoup"][v][v]["ppl"] <= ms["finetuned"][v][v]["ppl"]]
    ood_better, worse_ft = [], []
    for v in vs:
        others = [s for s in vs if s != v]
        if sum(ms["monosoup"][v][s]["ppl"] for s in others) < sum(ms["finetuned"][v][s]["ppl"] for s in others):
            ood_better.append(v)
        if ms["finetuned"][v][v]["ppl"] >= ms["base"][v]["ppl"]:
            worse_ft.append(v)
    notes = [
        f"* In distribution MonoSoup matches or beats its fine-tune for {len(id_better)} of {len(vs)} variants "
        f"({', '.join(id_better)}); out of distribution it is better than the fine-tune for "
        f"{len(ood_better)} of {len(vs)} ({', '.join(ood_better)}), the paper's claim.",
        f"* Full fine-tunes have high-rank deltas: the entropy rule keeps a median k of "
        f"{min(ms['layers'][v]['k_median'] for v in vs)}–{max(ms['layers'][v]['k_median'] for v in vs)} of "
        f"rank {ms['layers'][vs[0]]['rank_median']}, and mean λ_high "
        f"{min(ms['layers'][v]['lambda_high_mean'] for v in vs):.2f}–"
        f"{max(ms['layers'][v]['lambda_high_mean'] for v in vs):.2f} shrinks the tail of the spectrum "
        f"rather than cutting it.",
    ]
    if "math" in vs and "math_exact_match" in ms["monosoup"].get("math", {}):
        em = {
            k: d["math_exact_match"]
            for k, d in (
                ("base", ms["base"]),
                ("fine-tune", ms["finetuned"]["math"]),
                ("MonoSoup", ms["monosoup"]["math"]),
            )
        }
        notes.append(
            "* math, exact-match answers on " + str(em["base"]["n"]) + " held-out problems (greedy; the "
            "quality report's check): " + ", ".join(f"{k} {v['correct']}/{v['n']}" for k, v in em.items()) + "."
        )
    if worse_ft:
        notes.append(
            f"* {', '.join(worse_ft)}: the fine-tune's held-out perplexity is not below the base's, so "
            f"'gain kept' is undefined (perplexity over whole problems is dominated by the unpredictable "
            f"operands; the exact-match answers are the better measure)."
        )
    return notes


def _kmerge_notes(km: dict) -> list[str]:
    """What the numbers say, computed from them (so a rerun cannot leave stale prose)."""
    tasks = km["stream"]
    corpus = {t: km["tasks"][t][0] for t in tasks}
    by = {c["label"]: c for c in km["configs"]}
    sim = km["similarity"]
    same = [sim[i][j] for i in range(len(tasks)) for j in range(i) if corpus[tasks[i]] == corpus[tasks[j]]]
    cross = sorted(sim[i][j] for i in range(len(tasks)) for j in range(i) if corpus[tasks[i]] != corpus[tasks[j]])
    notes = [
        f"* Similarity: same-corpus pairs {min(same):.3f}–{max(same):.3f}, cross-corpus pairs "
        f"{cross[0]:.3f}–{cross[-1]:.3f} (median {cross[len(cross) // 2]:.3f}). Each task's most similar "
        f"other adapter is its sibling for "
        f"{sum(corpus[tasks[max((j for j in range(len(tasks)) if j != i), key=lambda j: sim[i][j])]] == corpus[tasks[i]] for i in range(len(tasks)))}"
        f" of {len(tasks)} tasks."
    ]
    for c in km["configs"]:
        if (
            c["options"].get("k") == 4
            and not c["options"].get("threshold")
            and c["options"].get("merge", "mean") == "mean"
        ):
            pure = all(len({corpus[t] for t in g}) == 1 for g in c["groups"])
            notes.append(
                f"* {c['label']}: {'every slot holds one corpus' if pure else 'slots mix corpora'}; "
                f"mean score {c['mean_score']:.3f} at half the bytes of K=8 (the base alone: "
                f"{km['base_mean_score']:.3f})."
            )
    paper = next((c for c in km["configs"] if "paper" in c["label"]), None)
    if paper:
        t = paper["options"]["threshold"]
        notes.append(
            f"* The paper's K-Merge++ threshold {t} lies below {sum(x > t for x in cross)} of the "
            f"{len(cross)} cross-corpus similarities of these adapters, so it merged unrelated tasks "
            f"and used {paper['slots']} of 4 slots (mean "
            f"{paper['mean_score']:.3f}); the threshold depends on the adapters (rank, steps, shared init)."
        )
    gated = next((c for c in km["configs"] if c["options"].get("gate")), None)
    if gated:
        plain = next((c for c in km["configs"] if c["options"] == {"k": gated["options"]["k"]}), None)
        rej = [d["task"] for d in gated["decisions"] if d["action"] == "reject"]
        if plain:
            notes.append(
                f"* The quality gate ({gated['options']['gate']}) kept every merged task at ≥ "
                f"{gated['options']['gate']} of its own score but rejected {len(rej)} adapters "
                f"({', '.join(rej) or 'none'}), whose tasks fall back to the base: mean "
                f"{gated['mean_score']:.3f} vs {plain['mean_score']:.3f} without the gate. A gate protects "
                f"what is merged at the cost of what is refused."
            )
    opcm = next((c for c in km["configs"] if c["options"].get("merge") == "opcm"), None)
    mean4 = by.get("K-Merge K=4")
    if opcm and mean4:
        notes.append(
            f"* OPCM vs running mean at K=4: mean score {opcm['mean_score']:.3f} vs {mean4['mean_score']:.3f}."
        )
    return notes


def merging_sections(results: dict, images: str = "") -> list[str]:
    """The MonoSoup and K-Merge sections (Markdown lines); `images` prefixes the plots' paths
    (the quality report embeds them from its own directory as "merging/")."""
    lines: list[str] = []
    if "monosoup" in results:
        lines += _monosoup_md(results["monosoup"], images)
    if "kmerge" in results:
        lines += _kmerge_md(results["kmerge"], images)
    return lines


def write_readme(results: dict, out: Path) -> Path:
    lines = [
        "# Merging report",
        "",
        "Made by `bitdelta merge report` (re-runnable; results.json holds every number). Methods and their "
        "differences from the brief: docs/merging.md.",
        "",
    ]
    lines += merging_sections(results)
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


def run(
    out: Path = Path("reports/merging"),
    parts: list[str] = ("monosoup", "kmerge"),
    n_windows: int = 16,
    seq_len: int = 128,
) -> Path:
    """Run the given parts (the other part's numbers are kept from results.json);
    no parts: only redraw the plots and README from results.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rfile = out / "results.json"
    results = json.loads(rfile.read_text()) if rfile.is_file() else {}
    if not parts:
        if "kmerge" in results:
            _plot_kmerge(results["kmerge"], out / "kmerge.png")
        if "monosoup" in results:
            _plot_monosoup(results["monosoup"], out / "monosoup.png")
    if "kmerge" in parts:
        results["kmerge"] = kmerge_part(n_windows, seq_len)
        _plot_kmerge(results["kmerge"], out / "kmerge.png")
        rfile.write_text(json.dumps(results, indent=1))
    if "monosoup" in parts:
        results["monosoup"] = monosoup_part(n_windows, seq_len)
        _plot_monosoup(results["monosoup"], out / "monosoup.png")
        rfile.write_text(json.dumps(results, indent=1))
    path = write_readme(results, out)
    _log(f"wrote {path}")
    return path
