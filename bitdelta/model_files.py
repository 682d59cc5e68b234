"""What a model's side files say about serving it, read without torch: its chat template (with the
special tokens' text the template may use), the sampling defaults of its generation config, the
tokens its generations end on, and its tokenizer. The gateway reads the base's (its flags) and the
worker its EOS; `compress` and `import-lora` check a fine-tune's tokenizer against the base's and
record its own template, defaults and EOS in its delta where they are not the base's
(`DeltaMeta.chat_template`, `.sampling_defaults`, `.eos_token_ids`), so the variant is served with
its own wherever its delta goes.

    t = read_chat_template(Path("data/base"))     # TemplateSource | None
    d = read_sampling(Path("data/base"))          # {"temperature": 0.7, ...} | None (no generation config)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitdelta.common.v1 import generation_pb2 as pb
from bitdelta.generation import GENERATION_CONFIG_KEYS, SamplingDefaults

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
JINJA_NAME = "chat_template.jinja"  # where transformers >= 4.43 saves the template
CONFIG_NAME = "tokenizer_config.json"  # where older ones (and the Hub's SmolLM2-Instruct) keep it
GENERATION_NAME = "generation_config.json"
MAX_TEMPLATE_CHARS = 256 << 10  # a template a delta may carry (the largest on the Hub are ~30 KB)


class ModelFileError(ValueError):
    """A side file that cannot be read or says something malformed (names the file)."""


@dataclass(frozen=True)
class TemplateSource:
    """A chat template's text, where it came from, and the special tokens' text it may use."""

    source: str
    origin: str = ""
    specials: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> text

    def to_pb(self) -> pb.ChatTemplate:
        return pb.ChatTemplate(source=self.source, specials=self.specials)

    @classmethod
    def from_pb(cls, m: pb.ChatTemplate, origin: str) -> TemplateSource:
        """The message's template under the rules of `from_json` (ModelFileError naming `origin`)."""
        return cls.from_json(json.dumps({"source": m.source, "specials": dict(m.specials)}), origin)

    def to_json(self) -> str:
        """The form a delta's metadata keeps (its origin is the fine-tune's path: not kept)."""
        return json.dumps({"source": self.source, "specials": self.specials}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, origin: str) -> TemplateSource:
        """ModelFileError unless `text` is what `to_json` writes, the source at most MAX_TEMPLATE_CHARS."""
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ModelFileError(f"{origin}: the chat template is not JSON ({e})") from None
        if (
            not isinstance(d, dict)
            or set(d) != {"source", "specials"}
            or not isinstance(d["source"], str)
            or not 0 < len(d["source"]) <= MAX_TEMPLATE_CHARS
            or not isinstance(d["specials"], dict)
            or any(k not in SPECIAL_TOKEN_KEYS or not isinstance(v, str) for k, v in d["specials"].items())
        ):
            raise ModelFileError(
                f"{origin}: the chat template must be {{source: 1 to {MAX_TEMPLATE_CHARS} characters, "
                f"specials: {{{', '.join(SPECIAL_TOKEN_KEYS)} -> text}}}}"
            )
        return cls(d["source"], origin, d["specials"])


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None
    if not isinstance(d, dict):
        raise ModelFileError(f"{path} is not a JSON object")
    return d


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _template_of_config(config: dict, path: Path) -> str | None:
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return t
    if isinstance(t, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ModelFileError(f"{path}: chat_template is neither a string nor a list with a 'default' template")


def read_chat_template(path: Path) -> TemplateSource | None:
    """The chat template of a tokenizer directory, a tokenizer_config.json (or any JSON with
    `chat_template`) or a template file, as transformers finds it (chat_template.jinja overrides the
    config's), with the config's special tokens; None where there is none. ModelFileError naming
    the file for one that cannot be read; FileNotFoundError for a path that is not there."""
    path = Path(path)
    if path.is_dir():
        config_path, jinja_path = path / CONFIG_NAME, path / JINJA_NAME
    elif path.suffix == ".json":
        config_path, jinja_path = path, path.parent / JINJA_NAME
    elif path.is_file():
        config_path, jinja_path = path.parent / CONFIG_NAME, path
    else:
        raise FileNotFoundError(f"{path} does not exist")
    config = _read_json(config_path) if config_path.is_file() else {}
    source, origin = _template_of_config(config, config_path), str(config_path)
    if jinja_path.is_file():
        source, origin = jinja_path.read_text(encoding="utf-8"), str(jinja_path)
    if not source:
        return None
    return TemplateSource(source, origin, {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))})


def read_sampling(path: Path) -> dict | None:
    """The keys of a generation_config.json (or of the one in directory `path`) that vLLM's server
    takes as sampling defaults, each where it is set (not null); None where there is no such file.
    ModelFileError naming the file for one that cannot be read or sets a value out of its rule."""
    f = Path(path) / GENERATION_NAME if Path(path).is_dir() else Path(path)
    if Path(path).is_dir() and not f.is_file():
        return None
    config = _read_json(f)
    out = {k: config[k] for k in GENERATION_CONFIG_KEYS if config.get(k) is not None}
    try:
        SamplingDefaults.from_config(out)
    except ValueError as e:
        raise ModelFileError(f"{f}: {e}") from None
    return out


def own_serving(base: Path, finetuned: Path) -> tuple[TemplateSource | None, dict[str, float]]:
    """The fine-tune's (or adapter's) chat template and sampling defaults where they are not the
    base's, else None / {}: what its delta records, so that the gateway serves the variant with them
    wherever the delta goes. A generation config that sets none of the base's sampling defaults
    records their neutral values (served alone, it would get those); one file neither has: none.
    ModelFileError (a ValueError) naming a file that cannot be read."""
    t, tb = read_chat_template(finetuned), read_chat_template(base)
    s, sb = read_sampling(finetuned), read_sampling(base) or {}
    template = t if t is not None and (tb is None or (t.source, t.specials) != (tb.source, tb.specials)) else None
    if template is not None and len(template.source) > MAX_TEMPLATE_CHARS:
        raise ModelFileError(
            f"{t.origin}: the chat template has {len(t.source)} characters; at most {MAX_TEMPLATE_CHARS}"
        )
    if s is None or s == sb:
        return template, {}
    neutral = dataclasses.asdict(SamplingDefaults())
    return template, {**{k: neutral[k] for k in sb if k not in s and k != "max_new_tokens"}, **s}


def eos_token_ids(ckpt: Path) -> frozenset[int]:
    """The tokens a checkpoint's generations end on: its config's `eos_token_id` and its generation
    config's (each an id or a list of them), where transformers' generate stops."""
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(ckpt) / name
        if not path.is_file():
            continue
        e = json.loads(path.read_text()).get("eos_token_id")
        ids = e if isinstance(e, list) else [] if e is None else [e]
        if any(type(t) is not int or t < 0 for t in ids):
            raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, not {e!r}")
        out.update(ids)
    return frozenset(out)


# text whose tokens and text back a fine-tune's tokenizer must give as the base's does (with every
# added token's own text appended): words, digits, whitespace runs, code, accents, CJK, emoji
PROBE = (
    "Hello, world! The quick brown fox jumps over 13 lazy dogs.\n\n  def f(x):\n\treturn x**2  # ok\n"
    'naïve café, Straße; 東京は晴れ。🙂👍 <b>tags</b> {"json": [1, 2.5, null]}  trailing   '
)


def own_tokenizer(base: Path, finetuned: Path, vocab_size: int) -> bytes | None:
    """The fine-tune's (or an adapter's) tokenizer.json where it reads or writes text otherwise than
    the base's (e.g. a chat fine-tune that renamed reserved tokens to its own special tokens, or a
    distilled model trained with another tokenizer of the same vocabulary size), else None: what its
    delta carries, so the worker serves the variant with it. Compared by what they do, not how the
    file is written (another tokenizers version writes the same tokenizer otherwise): the vocabulary
    with its added tokens (text and whether special), then the tokens of PROBE and every added
    token's text, with and without the special tokens the tokenizer adds, and the text back. Without
    both files: None. ValueError for a file the `tokenizers` library cannot read, and for one with a
    token the fine-tune's model (of `vocab_size` rows, a grown vocabulary's own) has no row for."""
    from tokenizers import Tokenizer

    fb, ff = base / "tokenizer.json", finetuned / "tokenizer.json"
    if not (fb.is_file() and ff.is_file()) or fb.read_bytes() == ff.read_bytes():
        return None
    tb = Tokenizer.from_file(str(fb))
    try:
        tf = Tokenizer.from_file(str(ff))
    except Exception as e:  # tokenizers raises a bare Exception for a file it cannot read
        raise ValueError(f"{ff} is not a tokenizer the `tokenizers` library reads ({e})") from None
    if _tokenizer_difference(tb, tf) is None:
        return None
    top = max(tf.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise ValueError(
            f"{ff} has token {top}, but the model's vocabulary has {vocab_size} rows: a token without an "
            "embedding row (a fine-tune that adds tokens resizes its embedding and LM head with them)"
        )
    return ff.read_bytes()


def _tokenizer_difference(tb, tf) -> str | None:
    """The first way tokenizer `tf` reads or writes text otherwise than `tb`, or None."""
    for t in (tb, tf):  # how a caller cuts or pads its batches is not how the model reads text
        t.no_truncation()
        t.no_padding()
    vb, vf = tb.get_vocab(with_added_tokens=True), tf.get_vocab(with_added_tokens=True)
    if vb != vf:
        ib, i_f = {i: t for t, i in vb.items()}, {i: t for t, i in vf.items()}
        k = min(i for i in ib.keys() | i_f.keys() if ib.get(i) != i_f.get(i))
        return f"token {k} is {i_f.get(k)!r} there, {ib.get(k)!r} in the base"
    ab, af = tb.get_added_tokens_decoder(), tf.get_added_tokens_decoder()
    for k in sorted(ab.keys() | af.keys()):
        if (k in ab) != (k in af) or ab[k].special != af[k].special:
            return f"token {k} is special in {'the base' if k in ab and ab[k].special else 'the fine-tune'} only"
    text = PROBE + "".join(t.content for t in ab.values())
    for special in (True, False):
        ids = tb.encode(text, add_special_tokens=special).ids
        if ids != tf.encode(text, add_special_tokens=special).ids:
            return f"a text becomes other tokens{' with its special tokens added' if special else ''}"
        for skip in (True, False):
            if tb.decode(ids, skip_special_tokens=skip) != tf.decode(ids, skip_special_tokens=skip):
                return "tokens become other text"
    return None


def own_eos(base: Path, finetuned: Path, vocab_size: int) -> tuple[int, ...]:
    """The fine-tune's end-of-sequence tokens where they are not the base's (a chat fine-tune of a
    pretrained base often ends its turns on another token), else (): what the delta records."""
    ft, theirs = eos_token_ids(finetuned), eos_token_ids(base)
    if not ft or ft == theirs:
        return ()
    if max(ft) >= vocab_size:
        raise ValueError(f"{finetuned}: eos_token_id {max(ft)} is not below the vocabulary size {vocab_size}")
    return tuple(sorted(ft))
