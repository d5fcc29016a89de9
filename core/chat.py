"""The tokenizer of a checkpoint directory, and the one rule for building a conversation from it: token in, token out.

A checkpoint directory carries its tokenizer in the standard files (tokenizer.json, tokenizer_config.json with the
chat template, or chat_template.jinja); `ChatTokenizer.load` reads them with `transformers.AutoTokenizer`, offline.

The conversation of an episode is a list of token ids that is only ever extended:

    first_prompt(system, user)  the chat template over [system, user] with the generation prompt, as the template
                                renders it (its BOS included), tokenized once
    <the engine's output ids>   kept exactly as generated: never decoded and re-encoded
    next_turn(user, closed)     a new user message and the generation prompt, as the template renders them after an
                                assistant turn: computed once per tokenizer as the template's text between the end of
                                an assistant message and the end of the generation prompt, then tokenized on its own.
                                When the generation stopped without the end-of-turn token (max_new_tokens), that
                                token is added first, so the conversation stays in the template's shape.

The texts are cut at special tokens (the end-of-turn token and the role markers), which BPE never merges across,
so tokenizing a piece on its own gives the same ids as tokenizing the whole conversation would.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from collections.abc import Iterable, Sequence
from typing import Union


class Trusted(str):
    """Text the project wrote itself (a UI-TARS prompt's action space), whose special-token strings are meant as those
    tokens, as the model's own inference code tokenizes them (`<|box_start|>` of UI-TARS-1.0's prompt is a special
    token of Qwen2-VL's tokenizer). Every other text of a message is content that can produce no special or added
    token. A Trusted joined with another text (+, format, join) is a plain str again: it fails safe."""

    __slots__ = ()


# A message's content: a text, or texts and image runs (int n: n image placeholders) in order; a Trusted text keeps
# its special tokens.
Content = Union[str, Sequence[Union[str, int]]]

# The files a tokenizer may consist of; they travel with every checkpoint the project writes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "added_tokens.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "generation_config.json", "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
# Where transformers keeps a tokenizer's named chat templates other than the default one ({"default": ...,
# "tool_use": ...}): one NAME.jinja each (transformers.utils.CHAT_TEMPLATE_DIR).
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# Image placeholder tokens, in order of preference, that the vision path binds screenshots to.
IMAGE_TOKENS = ("<|image|>", "<|image_pad|>")
_PROBE_SYSTEM, _PROBE_USER = "\x00tars-system\x00", "\x00tars-user\x00"
_PROBE_ASSISTANT, _PROBE_USER2 = "\x00tars-assistant\x00", "\x00tars-next\x00"
_ANCHOR = "\n"  # what a SentencePiece-style tokenizer encodes a mid-text piece after (ChatTokenizer._encode)


def _alone_after(hf, prefix: str) -> bool:
    """Whether a text encodes after `prefix` as it does alone (no space marker comes or goes at the boundary)."""
    head = list(hf.encode(prefix, add_special_tokens=False))
    return list(hf.encode(prefix + "a", add_special_tokens=False))[len(head):] == \
        list(hf.encode("a", add_special_tokens=False))


def _text_only(hf):
    """A copy of hf's backend tokenizer that extracts no added token from text (every one marked special, special
    ones left unmatched): what content with a non-special added token's text encodes with; None without a backend."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import Tokenizer

    spec = json.loads(backend.to_str())
    for t in spec.get("added_tokens") or ():
        t["special"] = True
    out = Tokenizer.from_str(json.dumps(spec))
    out.encode_special_tokens = True
    return out


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used: missing files, no chat template, a template the turn rule cannot
    follow, or a vocabulary that does not fit the model."""


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy every tokenizer file present in src into dst (which must exist), the named chat templates beside the
    default one too (CHAT_TEMPLATE_DIR/NAME.jinja); returns the names copied (relative paths)."""
    src, dst = pathlib.Path(src), pathlib.Path(dst)
    out = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            out.append(name)
    named = sorted(p for p in (src / CHAT_TEMPLATE_DIR).glob("*.jinja") if p.is_file())
    if named:
        (dst / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
    for p in named:
        shutil.copyfile(p, dst / CHAT_TEMPLATE_DIR / p.name)
        out.append(f"{CHAT_TEMPLATE_DIR}/{p.name}")
    return out


def has_tokenizer(path: str | os.PathLike) -> bool:
    p = pathlib.Path(path)
    return (p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file() or (p / "vocab.json").is_file()


class ChatTokenizer:
    """A Hugging Face tokenizer plus what an episode needs from it: the first prompt, the next-turn ids, the
    end-of-turn and stop ids, the image placeholder id."""

    def __init__(self, hf, path: str = "", generation_eos: Sequence[int] = (), template_kwargs: dict | None = None):
        self.hf = hf
        self.path = path
        # extra variables for the template (actor.chat_template_kwargs: e.g. Qwen3's enable_thinking), every render
        self.template_kwargs = dict(template_kwargs or {})
        if not getattr(hf, "chat_template", None):
            raise TokenizerError(f"{path or 'tokenizer'}: no chat template (tokenizer_config.json 'chat_template' or "
                                 "chat_template.jinja); the conversation is built from it")
        self.vocab_size = len(hf)
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
        # SentencePiece-style tokenizers (Llama-2, Mistral v0.1, TinyLlama: a "▁" prepended by the normalizer or a
        # Metaspace pre-tokenizer) put a space marker at the start of every text encoded alone, which the whole
        # conversation does not have mid-text. Such a tokenizer encodes each piece after an anchor ("\n") and drops
        # the anchor's ids, so the pieces add up to the whole conversation's ids.
        self._anchor = list(hf.encode(_ANCHOR, add_special_tokens=False))
        self._mid_text = not _alone_after(hf, _ANCHOR)
        self._specials = sorted((t for t in hf.all_special_tokens + list(hf.get_added_vocab()) if t), key=len,
                                reverse=True)
        # Added tokens that are not "special" (ChatML markers added to a base model with add_tokens, Qwen's <think>
        # and <tool_call>) are matched in text even with special-token parsing off: content holding one is encoded
        # by a copy of the tokenizer that matches no added token at all (_text_only).
        added = [t.content for t in getattr(hf, "added_tokens_decoder", {}).values() if not t.special and t.content]
        self._added_text = re.compile("|".join(map(re.escape, added))) if added else None  # one pass over content
        self._text_only = False  # built on first need (a copy of a 150k-token vocabulary costs a moment)
        self._eot_text, self._turn_text, self._answer_lead = self._probe()
        # After a special token a legacy normaliser starts a new segment (the marker comes back), Metaspace's
        # prepend_scheme "first" does not: which one this is, from the end-of-turn token.
        self._restarts = _alone_after(hf, self._eot_text)
        self._after_prompt = self._after(self._turn_text, "text")  # what an answer follows: the generation prompt
        self.system_role = self._takes_system()
        self._trims = self._trimmed()
        eot = self.hf.convert_tokens_to_ids(self._eot_text)
        if eot is None or eot == hf.unk_token_id:
            raise TokenizerError(f"{path}: the end-of-turn marker {self._eot_text!r} is not a token")
        self.eot_id = int(eot)
        self.eos_id = self.eot_id  # what an answer ends with
        stops = {self.eot_id, *(int(i) for i in generation_eos)}
        if hf.eos_token_id is not None:
            stops.add(int(hf.eos_token_id))
        self.stop_ids = sorted(stops)
        vocab = hf.get_vocab()
        self.image_id = next((vocab[t] for t in IMAGE_TOKENS if t in vocab), -1)
        self.image_token = next((t for t in IMAGE_TOKENS if t in vocab), "")
        # Qwen2-VL's frame around an image's pads (core.vlm); -1 where the tokenizer has none.
        self.vision_start_id = vocab.get("<|vision_start|>", -1) if self.image_token == "<|image_pad|>" else -1
        self.vision_end_id = vocab.get("<|vision_end|>", -1) if self.vision_start_id >= 0 else -1

    # ---- loading ---------------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | os.PathLike, template_kwargs: dict | None = None) -> "ChatTokenizer":
        hf, gen_eos = _load_hf(path)
        return cls(hf, str(pathlib.Path(path)), gen_eos, template_kwargs)

    def check_fits(self, model_vocab_size: int, where: str = "") -> None:
        """Every id the tokenizer can produce must have a row in the model's embedding (its largest id too, which a
        tokenizer with a hole in its ids has past len(tokenizer))."""
        _check_fits(self.hf, model_vocab_size, where or self.path)

    # ---- text <-> ids ----------------------------------------------------------------------------------------
    def encode(self, text: str, after: str = "text") -> list[int]:
        """Plain text -> ids, as it is encoded inside a conversation after `after` ("text", "special": a special
        token, "start": nothing). Special-token strings in it ("<|im_start|>" on a web page) stay plain text:
        content from an environment must not be able to open a new message."""
        return self._encode(text, True, after)

    def _encode(self, text: str, plain: bool, after: str = "text", added: bool = False) -> list[int]:
        """plain: special-token strings stay text (content); else the template's own text, whose special tokens are
        meant. Without a space-marker tokenizer (byte-level BPE) the piece is encoded alone, as it is whole. added: plain
        text whose non-special added tokens are meant (an answer: the policy generates them as tokens)."""
        enc = lambda t: self.hf.encode(t, add_special_tokens=False, split_special_tokens=plain)  # noqa: E731
        if plain and not added and self._added_text is not None and self._added_text.search(text):
            if self._text_only is False:
                self._text_only = _text_only(self.hf)  # None without a backend tokenizer: encoded as below
            if self._text_only is not None:
                enc = lambda t: self._text_only.encode(t, add_special_tokens=False).ids  # noqa: E731
        if not (self._mid_text and text and after != "start" and not (after == "special" and self._restarts)):
            return list(enc(text))
        ids = list(enc(_ANCHOR + text))
        if ids[:len(self._anchor)] != self._anchor:  # the anchor merged with the text: it stands alone then
            return list(enc(text))
        return ids[len(self._anchor):]

    def _fill(self, text: str, contents: dict[str, "Content"], after: str) -> list[int]:
        """A rendered template with probe strings -> ids: the template's text with its special tokens, each probe's
        content as plain text, image runs as placeholder ids. after: what comes before it ("start", "special")."""
        pat = "(" + "|".join(map(re.escape, contents)) + ")"
        parts = re.split(pat, text)
        ids: list[int] = []
        lead = ""
        for i, part in enumerate(parts):
            if i % 2 == 0:
                if i + 1 < len(parts):  # spaces before content go with it: the whole text merges them ("[INST] " + "Act"
                    lead = part[len(part.rstrip(" ")):]  # is "▁Act", not "▁" "Act")
                    part = part[:len(part) - len(lead)]
                ids += self._encode(part, False, after) if part else []
                after = self._after(part, after)
            else:
                ids += self.content_ids(_lead(lead, _trim(contents[part], *self._trims.get(part, (False, False)))),
                                        after)
                after = "text"
        return ids

    def _after(self, text: str, before: str) -> str:
        """What a piece that follows `text` comes after: "special" when it ends with a special token."""
        if not text:
            return before
        return "special" if any(text.endswith(t) for t in self._specials) else "text"

    def content_ids(self, content: "Content", after: str = "text") -> list[int]:
        """A message's content: a text, or a sequence of texts and image runs (an int n = n placeholders, framed
        by <|vision_start|> ... <|vision_end|> where the tokenizer is Qwen2-VL's). Texts are plain (encode), a Trusted
        one keeps its special tokens."""
        ids: list[int] = []
        for c in ([content] if isinstance(content, str) else content):
            if isinstance(c, Trusted):
                ids += self._encode(c, False, after) if c else []
                after = self._after(c, after)
            elif isinstance(c, str):
                ids += self.encode(c, after)
                after = "text"
            elif c > 0:
                if self.image_id < 0:
                    raise TokenizerError(f"{self.path}: the tokenizer has no image placeholder token "
                                         f"({', '.join(IMAGE_TOKENS)})")
                run = [self.image_id] * int(c)
                ids += [self.vision_start_id, *run, self.vision_end_id] if self.vision_end_id >= 0 else run
                after = "special"
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               **self.template_kwargs)
        except Exception as e:  # jinja's TemplateError (raise_exception), or whatever a template raises on a variable
            if not self.template_kwargs:
                raise
            raise TokenizerError(f"{self.path}: the chat template fails with chat_template_kwargs "
                                 f"{self.template_kwargs}: {type(e).__name__}: {e}") from None

    # ---- the conversation ------------------------------------------------------------------------------------
    def _probe(self) -> tuple[str, str, str]:
        """(end-of-turn token text, template text of [new user message + generation prompt] after an assistant turn
        with the user text as _PROBE_USER2, the spaces the template puts between the generation prompt and an
        assistant message's text: Mistral's " ")."""
        base = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_ASSISTANT}]
        b = self.render([*base, {"role": "user", "content": _PROBE_USER2}], True)
        i = b.find(_PROBE_ASSISTANT)
        # The conversation only grows: the engine's output follows the first prompt. So the text before the
        # assistant's words must be that prompt, or the template's rendering of a last assistant message (Qwen3's
        # template adds an empty <think></think> to an assistant message after the last user message and not to one
        # before it; the output, think block and all, stays as the policy wrote it).
        heads = (self.render(base[:1], True), self.render(base, False).rpartition(_PROBE_ASSISTANT)[0])
        if i < 0 or not any(h.startswith(b[:i]) for h in heads):
            raise TokenizerError(f"{self.path}: the chat template does not render a conversation as a growing text "
                                 "(the prompt before an assistant message changes when a user message follows it)")
        rest = b[i + len(_PROBE_ASSISTANT):]
        eot = next((t for t in self._specials if rest.startswith(t)), None)
        if eot is None:
            raise TokenizerError(f"{self.path}: the chat template ends an assistant message with {rest[:20]!r}, "
                                 "not with a special token; the turn rule needs an end-of-turn token")
        turn = rest[len(eot):]
        if _PROBE_USER2 not in turn:
            raise TokenizerError(f"{self.path}: the chat template drops a user message that follows an assistant one")
        lead = b[len(heads[0]):i] if b[:i].startswith(heads[0]) else ""
        return eot, turn, lead if not lead.strip(" ") else ""

    def _takes_system(self) -> bool:
        """Whether the template renders a system message (Mistral's and Gemma's raise "System role not supported";
        some drop it silently)."""
        try:
            text = self.render([{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}],
                               True)
        except Exception:  # jinja's TemplateError from raise_exception(), or anything a template may raise
            return False
        return _PROBE_SYSTEM in text

    def _trimmed(self) -> dict[str, tuple[bool, bool]]:
        """probe -> (leading, trailing) whitespace the template strips from that message's content (Llama 3's
        `message['content'] | trim`), as _fill strips it too; probes whose content is kept as it is are left out."""
        pad = lambda p: "\t" + p + "\t"  # noqa: E731  (a tab: no template writes one beside a message's text)
        msgs = [{"role": "user", "content": pad(_PROBE_USER)}, {"role": "assistant", "content": _PROBE_ASSISTANT},
                {"role": "user", "content": pad(_PROBE_USER2)}]
        texts = [self.render(msgs, True)]
        if self.system_role:
            texts.append(self.render([{"role": "system", "content": pad(_PROBE_SYSTEM)}, msgs[0]], True))
        out = {}
        for p in (_PROBE_SYSTEM, _PROBE_USER, _PROBE_USER2):
            text = next((t for t in texts if p in t), "")
            cut = (bool(text) and "\t" + p not in text, bool(text) and p + "\t" not in text)
            if any(cut):
                out[p] = cut
        return out

    def first_prompt(self, system: str, user: "Content") -> list[int]:
        """The template over [system (if any), user] with the generation prompt. A template without a system role
        gets the system text at the head of the user message, as those models' own templates fold it."""
        if system and not self.system_role:
            user = system + "\n\n" + user if isinstance(user, str) else [system + "\n\n", *user]
            system = ""
        msgs = ([{"role": "system", "content": _PROBE_SYSTEM}] if system else []) + [{"role": "user", "content": _PROBE_USER}]
        return self._fill(self.render(msgs, True), {_PROBE_SYSTEM: system, _PROBE_USER: user}, "start")

    def next_turn(self, user: "Content", closed: bool = True) -> list[int]:
        """Ids appended after the engine's output: [end-of-turn if the output did not end with it] + the user
        message + the generation prompt."""
        ids = self._fill(self._turn_text, {_PROBE_USER2: user}, "special")  # after the end-of-turn token
        return ([] if closed else [self.eot_id]) + ids

    def answer(self, text: str) -> list[int]:
        """What the policy should generate for an answer text: its ids and the end-of-turn token."""
        return [*self._encode(self._answer_lead + text, True, self._after_prompt, added=True), self.eot_id]


def _lead(spaces: str, content: "Content") -> "Content":
    """content with `spaces` (a template's, before it) at its head; a Trusted text stays Trusted."""
    if not spaces:
        return content
    if isinstance(content, str):
        return (Trusted if isinstance(content, Trusted) else str)(spaces + content)
    first = content[0] if len(content) else 0
    if isinstance(first, str):
        return [_lead(spaces, first), *content[1:]]
    return [spaces, *content]


def _trim(content: "Content", left: bool, right: bool) -> "Content":
    """content with its leading (left) / trailing (right) whitespace stripped, as a template's `| trim` strips a
    message's text; a Trusted text stays Trusted."""
    if not (left or right):
        return content
    parts = [content] if isinstance(content, str) else list(content)
    for end in ((0,) if left else ()) + ((-1,) if right else ()):
        while parts and isinstance(parts[end], str):
            t = parts[end].lstrip() if end == 0 else parts[end].rstrip()
            if t:
                parts[end] = Trusted(t) if isinstance(parts[end], Trusted) else t
                break
            parts.pop(end)
    return (parts[0] if parts else "") if isinstance(content, str) else parts


def _load_hf(path: str | os.PathLike):
    """(transformers' tokenizer of directory path, the eos ids of its generation_config.json, or of its config.json
    without one, as transformers generates); TokenizerError."""
    p = pathlib.Path(path)
    if not p.is_dir():
        raise TokenizerError(f"tokenizer: {p} is not a directory (give the checkpoint or tokenizer directory)")
    if not has_tokenizer(p):
        raise TokenizerError(f"tokenizer: {p} has no tokenizer.json (or tokenizer.model / vocab.json)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many kinds here; the message is what matters
        raise TokenizerError(f"tokenizer: cannot load {p}: {type(e).__name__}: {e}") from None
    gen_eos: list[int] = []
    gc = p / "generation_config.json"
    if gc.is_file():
        try:
            e = json.loads(gc.read_text()).get("eos_token_id")
            gen_eos = [e] if isinstance(e, int) else list(e or [])
        except (ValueError, AttributeError, TypeError):
            gen_eos = [None]
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in gen_eos):  # (not an assert: -O drops it)
            raise TokenizerError(f"tokenizer: {gc}: not a generation config whose eos_token_id is a token id "
                                 "or a list of them")
    else:  # transformers' generation config is then the model config's (GenerationConfig.from_model_config)
        gen_eos = _config_eos(p / "config.json")
    return hf, gen_eos


def _config_eos(path: pathlib.Path) -> list[int]:
    """The eos ids of a config.json (its text_config's for a VL model), [] where there is none or no such file; the
    file's own faults are load_config's to report."""
    try:
        d = json.loads(path.read_text())
        tc = d.get("text_config")
        e = tc.get("eos_token_id") if isinstance(tc, dict) else None
        e = d.get("eos_token_id") if e is None else e
    except (OSError, ValueError, AttributeError):
        return []
    ids = [e] if isinstance(e, int) else list(e) if isinstance(e, list) else []
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def _check_fits(hf, model_vocab_size: int, where: str) -> None:
    """TokenizerError unless every id of hf (len(hf) of them, and its largest id) has a row in the embedding."""
    n = len(hf)
    bound = max(n, max(hf.get_vocab().values(), default=-1) + 1)  # past len when its ids have a hole
    if n > int(model_vocab_size):
        raise TokenizerError(f"{where}: the tokenizer has {n} tokens but the model's embedding has "
                             f"{model_vocab_size} rows; they are not a pair")
    if bound > int(model_vocab_size):
        raise TokenizerError(f"{where}: the tokenizer has token id {bound - 1} but the model's embedding has "
                             f"{model_vocab_size} rows; they are not a pair")


def open_tokenizer(path: str | os.PathLike, model_dir: str | os.PathLike | None = None,
                   template_kwargs: dict | None = None, chat: bool = True) -> ChatTokenizer | None:
    """The tokenizer in `path`; with a model directory, also checked against its config's vocabulary size.
    template_kwargs: actor.chat_template_kwargs, given to every render of the chat template. chat=False (a server or
    a learner: token ids in and out): only the vocabulary is checked, no chat template needed; returns None."""
    tok = ChatTokenizer.load(path, template_kwargs) if chat else None
    hf = tok.hf if tok is not None else _load_hf(path)[0]
    if model_dir is not None:
        cfg = pathlib.Path(model_dir) / "config.json"
        if not cfg.is_file():
            raise TokenizerError(f"{model_dir}: no config.json (not a Hugging Face checkpoint directory)")
        d = json.loads(cfg.read_text())
        vocab = d.get("vocab_size", (d.get("text_config") or {}).get("vocab_size"))
        if vocab is not None:
            _check_fits(hf, int(vocab), str(model_dir))
            bad = [i for i in (tok.stop_ids if tok is not None else ()) if not 0 <= i < int(vocab)]
            if bad:  # the engine refuses such a stop id: every request of every episode would fail
                raise TokenizerError(f"{path}: stop token ids {bad} (the eos_token_id of generation_config.json, "
                                     "or of config.json without one) are "
                                     f"outside the model's vocabulary [0, {vocab}); they are not this model's tokens")
    return tok
