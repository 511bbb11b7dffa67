"""Text <-> token ids and the model's chat template.

`Tokenizer` wraps a `tokenizers.Tokenizer`, built either from a Hugging Face
folder (tokenizer.json, tokenizer_config.json) or from the vocabulary a GGUF
file carries in its metadata: GPT-2 style byte-level BPE ("gpt2") with the
pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`, or SentencePiece BPE
("llama"), rebuilt the way Hugging Face converts them.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError, nodes
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.config import ConfigError

_LONG_TEXT = 16_384  # characters from which encoding leaves the GIL to other threads

log = logging.getLogger(__name__)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Template:
    """Compiled on first use, so a model whose template is broken still loads for plain prompts."""
    try:
        return _template_env().from_string(source)
    except TemplateError as e:
        raise ConfigError(f"chat template does not compile: {e}") from None


@functools.lru_cache(maxsize=16)
def template_content_format(source: str) -> str:
    """ "openai" for a template that loops over a message's content parts
    (`{% for part in message['content'] %}`), else "string" (vLLM's "auto" detection)."""
    try:
        tree = _template_env().parse(source)
    except TemplateError:
        return "string"  # reported where it is rendered
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:  # content | selectattr(...)
            it = it.node
        if (isinstance(it, nodes.Getattr) and it.attr == "content") or (
            isinstance(it, nodes.Getitem)
            and isinstance(it.arg, nodes.Const)
            and it.arg.value == "content"
        ):
            return "openai"
    return "string"


def _template_env() -> ImmutableSandboxedEnvironment:
    """The sandboxed Jinja set-up HF uses for chat templates, with its helpers."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None
    eos_token_id: int | None  # the one templates call eos_token
    add_bos: bool
    extra_eos_ids: frozenset[int] = field(default_factory=frozenset)  # e.g. <|eot_id|>


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens and chat template."""

    def __init__(
        self, tokenizer: HFTokenizer, special: SpecialTokens, chat_template: str | None
    ) -> None:
        self._tok = tokenizer
        # (a tokenizer.json may hold its trainer's truncation and padding: a prompt is never cut
        # or padded quietly here; the engine refuses a long one or truncates as asked)
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.bos_token_id = special.bos_token_id
        self.eos_token_id = special.eos_token_id
        self.eos_token_ids: set[int] = set(special.extra_eos_ids)
        if special.eos_token_id is not None:
            self.eos_token_ids.add(special.eos_token_id)
        self.chat_template = chat_template
        if special.add_bos and self.bos_token_id is not None and not self._adds_bos():
            bos = self._tok.id_to_token(self.bos_token_id)
            self._tok.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, self.bos_token_id)],
            )

    def _adds_bos(self) -> bool:
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_token_id

    def lowercase(self) -> None:
        """Lowercase every text before the tokenizer's own normalizer (sentence-transformers'
        do_lower_case)."""
        own = self._tok.normalizer
        lower = normalizers.Lowercase()
        self._tok.normalizer = lower if own is None else normalizers.Sequence([lower, own])

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; with add_special_tokens, BOS first when the model wants it.

        A long text goes through `encode_batch_fast`, which releases the GIL (`encode` holds it), so
        that a megabyte prompt does not stall every other request's stream while it is cut up. The
        fast variant skips the offsets: 3x quicker, and its result is freed in a tenth of the time
        (freeing a million tokens' offsets and strings held the GIL for 0.25 s)."""
        try:
            if len(text) < _LONG_TEXT:
                return self._tok.encode(text, add_special_tokens=add_special_tokens).ids
            return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        except TypeError:  # a lone surrogate ("\ud800") in text that reached here untyped
            raise ConfigError("the text holds a lone surrogate: it is not valid Unicode") from None

    def encode_pair(self, first: str, second: str) -> list[int]:
        """A pair of texts as the tokenizer joins them (BERT's [CLS] first [SEP] second [SEP]),
        what a cross-encoder reads."""
        try:
            return self._tok.encode(first, second, add_special_tokens=True).ids
        except TypeError:
            raise ConfigError("the text holds a lone surrogate: it is not valid Unicode") from None

    def special_ends(self, added: bool = True) -> tuple[int, int]:
        """How many special tokens encode(..., add_special_tokens=added) puts before a text and
        after it (BERT's [CLS] and [SEP]: 1, 1; a Llama BOS: 1, 0; none unless `added`)."""
        return self._special_ends if added else (0, 0)

    @functools.cached_property
    def _special_ends(self) -> tuple[int, int]:
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        for lead in range(len(full) - len(plain) + 1):
            if full[lead : lead + len(plain)] == plain:
                return lead, len(full) - lead - len(plain)
        return 0, 0

    def pair_separator(self) -> int | None:
        """The token before a pair's second text where the tokenizer marks that text as type 1
        (BERT's [SEP]), else None."""
        pair = self._tok.encode("a", "b", add_special_tokens=True)
        if 1 not in pair.type_ids[1:]:
            return None
        return pair.ids[pair.type_ids.index(1) - 1]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary, added tokens too; None if there is none."""
        return self._tok.token_to_id(token)

    def to_json(self) -> str:
        """The tokenizer as Hugging Face's tokenizer.json (what llguidance reads)."""
        return self._tok.to_str()

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        template_vars: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render messages with the model's template, or `chat_template`; kwargs (tools, documents)
        and template_vars (a request's chat_template_kwargs, whose keys may be any string, "self"
        included) become template variables. With continue_final_message the text ends
        inside the last message, for the model to go on with it. Template errors: ConfigError."""
        template = chat_template or self.chat_template
        if not template:
            raise ConfigError("this model has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ConfigError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )

        def text(token_id: int | None) -> str:
            return (self._tok.id_to_token(token_id) or "") if token_id is not None else ""

        try:
            rendered = compile_template(template).render(
                {
                    **(template_vars or {}),
                    **kwargs,
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": text(self.bos_token_id),
                    "eos_token": text(self.eos_token_id),
                }
            )
        except TemplateError as e:  # the template's own raise_exception, or a broken template
            raise ConfigError(f"chat template: {e}") from None
        except Exception as e:  # what the template did went wrong (1/0, a sandbox limit, ...)
            raise ConfigError(f"chat template: {type(e).__name__}: {e}") from None
        if continue_final_message:  # stripped, as templates often strip what they show
            content = (messages[-1].get("content") if messages else None) or ""
            if isinstance(content, list):  # "openai" content: the text ends with the last part
                content = content[-1]["text"] if content else ""
            last: str = str(content).strip()
            at = rendered.rfind(last) if last else -1
            if at == -1:
                raise ConfigError(
                    "continue_final_message needs a last message whose content the template shows"
                )
            rendered = rendered[: at + len(last)]
        return rendered

    # ---- construction
    # -------------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(
        cls, folder: str | Path, config_eos: int | list[int] | None = None
    ) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json.

        Also chat_template.jinja and generation_config.json when present."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises bare Exceptions on bad JSON
            raise ConfigError(f"{path}: unreadable tokenizer ({e})") from None
        cfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")

        def token_id(entry: Any) -> int | None:
            content = entry.get("content") if isinstance(entry, dict) else entry
            return tok.token_to_id(content) if isinstance(content, str) else None

        eos = token_id(cfg.get("eos_token"))
        extra: set[int] = set()
        for ids in (config_eos, gen.get("eos_token_id")):
            extra.update([ids] if isinstance(ids, int) else ids or [])
        if eos is None and extra:
            eos = min(extra)
        special = SpecialTokens(
            bos_token_id=token_id(cfg.get("bos_token")),
            eos_token_id=eos,
            add_bos=bool(cfg.get("add_bos_token", False)),
            extra_eos_ids=frozenset(extra),
        )
        return cls(tok, special, _hf_chat_template(folder, cfg))

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """From the `tokenizer.*` keys of a GGUF file (values already decoded to Python)."""
        kind = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        if not tokens:
            raise ConfigError("GGUF file has no tokenizer vocabulary")
        types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            tok = _gguf_byte_bpe(
                tokens,
                meta.get("tokenizer.ggml.merges") or [],
                meta.get("tokenizer.ggml.pre", "default"),
            )
        elif kind == "llama":
            tok = _gguf_sentencepiece(
                tokens,
                meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens),
                meta.get("tokenizer.ggml.unknown_token_id"),
                meta.get("tokenizer.ggml.add_space_prefix", True),
            )
        else:
            raise ConfigError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)")
        # control (3) and user-defined (4) tokens are matched whole, before the model sees the text
        tok.add_special_tokens(
            [
                AddedToken(tokens[i], special=True, normalized=False)
                for i, t in enumerate(types)
                if t == 3
            ]
        )
        tok.add_tokens(
            [
                AddedToken(tokens[i], special=False, normalized=False)
                for i, t in enumerate(types)
                if t == 4
            ]
        )
        extra = {
            meta[k]
            for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if k in meta
        }
        special = SpecialTokens(
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
            extra_eos_ids=frozenset(extra),
        )
        return cls(tok, special, meta.get("tokenizer.chat_template"))


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable JSON ({e})") from None


def _hf_chat_template(folder: Path, cfg: dict) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default", next(iter(named.values()), None))
    return template


# llama.cpp's pre-tokenizer names -> the regex split before byte-level BPE
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_NAMES = ("llama3", "llama-bpe", "llama-v3")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # Qwen2/3: digits one by one
_SPLITS = {**dict.fromkeys(_LLAMA3_NAMES, _LLAMA3_SPLIT), "qwen2": _QWEN2_SPLIT}


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2's own split
    if pre == "smollm":  # digits one by one, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in ("default", "gpt2"):
        log.warning("GGUF pre-tokenizer %r is not known to pagedkv; using GPT-2's", pre)
    return gpt2


def _gguf_byte_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [(a, b) for a, b in (m.split(" ", 1) for m in merges)]
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_NAMES)
    )
    tok.pre_tokenizer = _byte_level_pre(pre)
    if pre == "qwen2":  # as Qwen's tokenizer.json
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE has scores, not merges.

    A piece is a merge of two pieces, ranked by its score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for piece, score in zip(tokens, scores):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _gguf_sentencepiece(
    tokens: list[str], scores: list[float], unk_id: int | None, add_space_prefix: bool
) -> HFTokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = tokens[unk_id] if unk_id is not None else None
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(tokens, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    steps = [normalizers.Prepend("▁")] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tail = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *tail]
    )
    return tok
