"""lm-evaluation-harness's own OpenAI client against the whole system, as its users run it.

    bash scripts/lm_eval_check.sh            # installs lm_eval[api] into .venv/lm-eval, then runs this

Starts the delta store, a worker, the router and the gateway (with --tokenizer) as processes on the
real family (data/base, data/deltas: `bitdelta family build`), then drives `local-completions`
exactly as `lm_eval --model local-completions --model_args base_url=...,tokenized_requests=True`
does: batches of token-id prompts, `echo` with `logprobs: 1` for log-likelihoods, `generate_until`
with stop strings; then its command line, `lm_eval --model local-completions`, on a local
multiple-choice task made of the same pairs. The base's log-likelihoods are checked against transformers on the same
checkpoint: with an fp32 worker they must agree to 1e-3 (and on which continuations are greedy);
the default worker (bf16 on a CPU with AVX512-BF16) is reported beside them. Exit status 1 on a
mismatch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitdelta.testing.cluster import Cluster  # noqa: E402

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("2 + 2 =", " 4"),
    ("Once upon a", " time"),
    ("def add(a, b):\n    return", " a + b"),
]
GENERATE = ["Q: What is 2+2?\nA:", "The sea is"]


def reference(base: Path) -> list[tuple[float, bool]]:
    """(log p(continuation | context), greedy) from transformers in fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    out = []
    for ctx, cont in PAIRS:
        whole, n_ctx = tok(ctx + cont).input_ids, len(tok(ctx).input_ids)
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        rows = range(n_ctx, len(whole))
        out.append((sum(lp[j - 1, whole[j]].item() for j in rows), all(lp[j - 1].argmax() == whole[j] for j in rows)))
    return out


TASK = """task: bitdelta_check
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def cli(address: str, models: list[str], tmp: Path) -> dict[str, str]:
    """The README's command line, `lm_eval --model local-completions`, on a local multiple-choice task
    built from PAIRS (offline: a JSON file): each model's result table."""
    data = tmp / "check.jsonl"
    questions = {}
    for ctx, cont in PAIRS:
        questions.setdefault(ctx, []).append(cont)
    with data.open("w") as f:
        for ctx, conts in questions.items():
            f.write(json.dumps({"question": ctx, "choices": conts + [" table"], "answer": 0}) + "\n")
    (tmp / "tasks").mkdir(exist_ok=True)
    (tmp / "tasks" / "check.yaml").write_text(TASK.format(data=data))
    out = {}
    for model in models:
        args = f"model={model},base_url=http://{address}/v1/completions,tokenizer={ROOT / 'data/base'}"
        cmd = [str(Path(sys.executable).parent / "lm_eval"), "--model", "local-completions", "--model_args", args]
        cmd += ["--tasks", "bitdelta_check", "--include_path", str(tmp / "tasks")]
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"lm_eval for {model} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        out[model] = "\n".join(line for line in r.stdout.splitlines() if line.startswith("|"))
    return out


def run(dtype: str | None, variant: str) -> dict:
    """lm_eval's log-likelihoods and generations for the base and `variant` from a worker of `dtype`."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    with tempfile.TemporaryDirectory() as tmp, Cluster(Path(tmp)) as c:
        store = c.store(root=ROOT / "data/deltas")
        extra = ("--dtype", dtype) if dtype else ()
        w = c.worker(ROOT / "data/base", store.address, delta_budget="64MiB", kv_cache="32MiB", extra=extra)
        router = c.router([w.address], store.address)
        c.wait_serving(store, w, router)
        gw = c.gateway(router.address, extra=("--tokenizer", str(ROOT / "data/base")))
        with urllib.request.urlopen(f"http://{gw.address}/v1/models", timeout=30) as r:
            base = json.load(r)["data"][0]["id"]
        out = {}
        for model in (base, variant):
            lm = LocalCompletionsAPI(
                base_url=f"http://{gw.address}/v1/completions",
                model=model,
                tokenizer_backend="huggingface",
                tokenizer=str(ROOT / "data/base"),
                tokenized_requests=True,
                batch_size=3,  # several token-id prompts in one request
                max_retries=1,
            )
            ll = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(PAIRS)])
            gen = lm.generate_until(
                [
                    Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 12}), i)
                    for i, p in enumerate(GENERATE)
                ]
            )
            out["base" if model == base else model] = {"loglikelihood": ll, "generate_until": gen}
        out["cli"] = cli(gw.address, [base, variant], Path(tmp))
        return out


def main() -> int:
    variant = sys.argv[1] if len(sys.argv) > 1 else "math"
    ref = reference(ROOT / "data/base")
    fp32, auto = run("float32", variant), run(None, variant)
    ok = True
    print(f"{'context + continuation':44s} {'transformers fp32':>20s} {'worker fp32':>20s} {'worker default':>20s}")
    for (ctx, cont), r, a, b in zip(PAIRS, ref, fp32["base"]["loglikelihood"], auto["base"]["loglikelihood"]):
        good = abs(a[0] - r[0]) < 1e-3 and a[1] == r[1]
        ok &= good
        cells = [f"{v:9.4f} {'greedy' if g else '      '}" for v, g in (r, a, b)]
        print(f"{(ctx + cont)!r:44.44s} " + " ".join(f"{c:>20s}" for c in cells) + ("" if good else "  MISMATCH"))
    worst = max(abs(a[0] - r[0]) for r, a in zip(ref, auto["base"]["loglikelihood"]))
    print(f"default worker (auto dtype) against transformers fp32: largest difference {worst:.4f} nats")
    for name, res in (("fp32", fp32), ("default", auto)):
        for model, table in res.pop("cli").items():
            print(f"{name} worker, lm_eval --model local-completions --model_args model={model},...:\n{table}")
        for model, r in res.items():
            print(f"{name:7s} {model:5s} generate_until: {r['generate_until']}")
            print(f"{name:7s} {model:5s} loglikelihood: {[(round(v, 4), g) for v, g in r['loglikelihood']]}")
    same = fp32["base"]["loglikelihood"] != fp32[variant]["loglikelihood"]
    print(f"the variant's log-likelihoods differ from the base's: {same}")
    print("lm_eval local-completions:", "OK" if ok and same else "MISMATCH")
    return 0 if ok and same else 1


if __name__ == "__main__":
    sys.exit(main())
