"""A model's generation_config.json as vLLM's server takes it (`--generation-config auto`): the
sampling fields a request leaves unset come from it, per model (the base's, or a variant's own), and
chat's unset max_tokens from its max_new_tokens, cut to the context the prompt leaves. The keys read
are the ones transformers' GenerationConfig reports as set (`to_diff_dict`, the call vLLM makes);
the answers are checked against the router's Generate with the same values set explicitly.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import pytest_asyncio

from bitdelta.generation import GENERATION_CONFIG_KEYS, SamplingDefaults
from bitdelta.rpc.clients.router import RouterClient
from bitdelta.testing.cluster import Cluster, free_port
from services.gateway import protocol as api
from services.gateway.generation_config import GenerationConfigError, load
from tests.support.gateway import oai, routers_text

aio = pytest.mark.asyncio(loop_scope="module")

N = 12
T = 120
ROOT = Path(__file__).resolve().parents[2]
# as Qwen2.5-Instruct's and Llama-3.1-Instruct's files are written (token ids and do_sample change no request)
QWEN_LIKE = {
    "bos_token_id": 256,
    "do_sample": True,
    "eos_token_id": [256, 258],
    "repetition_penalty": 1.05,
    "temperature": 0.7,
    "top_k": 20,
    "top_p": 0.8,
}
LLAMA_LIKE = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "max_length": 4096}
# a variant's own: greedy with a penalty, and a max_new_tokens far beyond the tiny model's 256 positions
VARIANT = {"temperature": 0.0, "repetition_penalty": 1.3, "min_p": 0.05, "max_new_tokens": 100_000}
BASE_MAX_NEW = 5
WORKER_MAX_NEW = 9  # the worker's own default (--default-max-new-tokens)


def write(d: Path, config: dict | str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "generation_config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return d


@pytest.mark.parametrize(
    "config",
    [
        QWEN_LIKE,
        LLAMA_LIKE,
        VARIANT,
        {"top_k": 50, "temperature": 1.0, "max_new_tokens": 300},  # defaults' values set explicitly still count
        {"top_k": -1, "min_p": 0.1, "temperature": None},  # null: unset
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2},  # SmolLM2's: no sampling field
    ],
)
def test_the_defaults_are_the_fields_transformers_reports_set(tmp_path, config):
    """The outside reference: the six keys vLLM takes from transformers' `to_diff_dict()` of the file,
    each where it is set, the neutral value where not (top_k -1 is vLLM's "no limit", 0 here)."""
    from transformers import GenerationConfig

    d = write(tmp_path / "m", config)
    got = load(d)
    diff = GenerationConfig.from_pretrained(d).to_diff_dict()
    want = {k: diff[k] for k in GENERATION_CONFIG_KEYS if diff.get(k) is not None}
    if want.get("top_k") == -1:
        want["top_k"] = 0
    for k in GENERATION_CONFIG_KEYS:
        assert getattr(got, k) == want.get(k, getattr(api.NEUTRAL, k)), k
    assert load(d / "generation_config.json") == got  # the file itself, or its directory
    assert set(got.changed()) == {k for k in want if want[k] != getattr(api.NEUTRAL, k)}


@pytest.mark.parametrize(
    "content, words",
    [
        ({"temperature": 3.0}, "temperature: must be a number between 0 and 2, got 3.0"),
        ({"top_p": 0}, "top_p: must be a number greater than 0 and at most 1"),
        ({"repetition_penalty": "high"}, "repetition_penalty: must be a number"),
        ({"top_k": 2.5}, "top_k: must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens: must be an integer between 1"),
        ([1, 2], "is not a JSON object"),
        ("{temperature: 0.7", "cannot read"),
    ],
)
def test_a_bad_generation_config_is_refused_naming_the_file_and_field(tmp_path, content, words):
    d = write(tmp_path / "m", content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(GenerationConfigError) as e:
        load(d)
    assert words in str(e.value) and str(d / "generation_config.json") in str(e.value)


def test_the_gateway_exits_2_on_a_bad_or_missing_generation_config(tmp_path):
    """At start, before it serves a request: the flag, the file and what is wrong with it."""
    bad = write(tmp_path / "bad", {"temperature": -1})
    for flags, words in (
        (["--generation-config", str(bad)], ["--generation-config", str(bad), "temperature: must be"]),
        (["--generation-config", str(tmp_path / "none")], ["cannot read"]),
        (["--variant-generation-configs", f"v1={bad}"], [str(bad), "temperature: must be"]),
        (["--variant-generation-configs", "v1"], ["VARIANT=FILE|DIR"]),
    ):
        p = subprocess.run(
            [sys.executable, "-m", "services.gateway", "--router", f"127.0.0.1:{free_port()}", *flags],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 2, p.stderr
        assert all(w in p.stderr for w in words), p.stderr


def test_a_request_field_wins_over_the_models_default():
    """Unset and null take the default; a value the request sets, even the neutral one, is kept."""
    d = SamplingDefaults.from_config(QWEN_LIKE)
    body = {"model": "m", "prompt": "x"}
    s = api.parse_completion(body, 16, d).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    s = api.parse_completion({**body, "temperature": None, "top_k": -1, "top_p": 1.0}, 16, d).sampling
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (0.7, 1.0, 0, 1.05)
    assert s.max_new_tokens == 16 and s.default_max_new_tokens == 0  # completions: OpenAI's 16, as vLLM
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    v = SamplingDefaults.from_config(VARIANT)
    assert api.parse_chat(chat, v).sampling.default_max_new_tokens == 100_000
    assert api.parse_chat({**chat, "max_tokens": 7}, v).sampling.max_new_tokens == 7


@pytest.fixture(scope="module")
def cluster(family, tmp_path_factory):
    """Store, worker, router; a gateway reading the base's file from its --tokenizer directory
    (`auto`) with v1's own, and one with `--generation-config vllm` (neutral)."""
    work = tmp_path_factory.mktemp("generation_config")
    root = work / "deltas"
    shutil.copytree(family.deltas, root)
    base_dir = work / "base"
    shutil.copytree(family.base, base_dir)
    write(base_dir, {**QWEN_LIKE, "max_new_tokens": BASE_MAX_NEW})
    (base_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"})
    )
    v1 = write(work / "v1", VARIANT)
    with Cluster(work) as c:
        c.st = c.store(root)
        c.w = c.worker(family.base, c.st.address, extra=("--default-max-new-tokens", str(WORKER_MAX_NEW)))
        c.r = c.router([c.w.address], c.st.address)
        c.wait_serving(c.st, c.w, c.r)
        c.g = c.gateway(
            c.r.address,
            chat_template=base_dir,
            extra=("--tokenizer", str(base_dir), "--variant-generation-configs", f"v1={v1}"),
        )
        c.g_neutral = c.gateway(
            c.r.address,
            name="gateway-neutral",
            chat_template=base_dir,
            extra=("--tokenizer", str(base_dir), "--generation-config", "vllm"),
        )
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def clients(cluster):
    router = RouterClient(cluster.r.address, generate_timeout_s=T)
    auto, neutral = oai(cluster.g), oai(cluster.g_neutral)
    yield auto, neutral, router
    for c in (auto, neutral, router):
        await c.close()


QWEN = {k: QWEN_LIKE[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")}


@aio
@pytest.mark.parametrize("which", ["v0", "base"])  # a variant without its own file gets the base's
async def test_unset_fields_get_the_bases_generation_config(clients, which):
    auto, neutral, router = clients
    model = (await router.list_models())[0].model_id if which == "base" else which
    prompt = "abc xyz"
    want = await routers_text(router, model, prompt, max_new_tokens=N, seed=3, **QWEN)
    got = await auto.completions.create(model=model, prompt=prompt, max_tokens=N, seed=3)
    assert got.choices[0].text == want
    plain = await neutral.completions.create(model=model, prompt=prompt, max_tokens=N, seed=3)
    assert plain.choices[0].text == await routers_text(router, model, prompt, max_new_tokens=N, seed=3, temperature=1.0)
    assert plain.choices[0].text != want
    # the request's own temperature wins; the fields it leaves unset still come from the file
    greedy = await auto.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0)
    assert greedy.choices[0].text == await routers_text(
        router, model, prompt, max_new_tokens=N, **{**QWEN, "temperature": 0.0}
    )


@aio
async def test_a_variant_gets_its_own_generation_config(clients):
    auto, _, router = clients
    prompt = "hello there"
    got = await auto.completions.create(model="v1", prompt=prompt, max_tokens=N, seed=5)
    want = await routers_text(
        router, "v1", prompt, max_new_tokens=N, temperature=0.0, repetition_penalty=1.3, min_p=0.05
    )
    assert got.choices[0].text == want
    assert want != await routers_text(router, "v1", prompt, max_new_tokens=N, temperature=0.0)  # the penalty shows


@aio
async def test_chats_unset_max_tokens_is_the_models_max_new_tokens_cut_to_the_context(clients):
    """The base's max_new_tokens (5) ends a chat that sets no max_tokens; v1's 100 000 is cut to the
    256-position context the prompt leaves, not refused (a default, not an ask); OpenAI's 16 stays
    the completions' default."""
    auto, neutral, _ = clients
    messages = [{"role": "user", "content": "Tell me everything."}]
    eos_off = {"ignore_eos": True}
    r = await auto.chat.completions.create(model="v0", messages=messages, extra_body=eos_off)
    assert r.usage.completion_tokens == BASE_MAX_NEW and r.choices[0].finish_reason == "length"
    r = await auto.chat.completions.create(model="v1", messages=messages, extra_body=eos_off)
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256 and r.choices[0].finish_reason == "length"
    r = await neutral.chat.completions.create(model="v0", messages=messages, extra_body=eos_off)
    assert r.usage.completion_tokens == WORKER_MAX_NEW  # no generation config: the worker's own default
    r = await auto.completions.create(model="v1", prompt="x", extra_body=eos_off)
    assert r.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError, match="more than the context leaves"):  # asked for: refused
        await auto.chat.completions.create(model="v1", messages=messages, max_tokens=300)
