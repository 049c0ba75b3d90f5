"""The head planner: this request rendered as the server will, and its exact head tokens.

``/apply-template`` renders the whole body exactly as chat completions will (every field
the server feeds to the template goes with it: ``chat_template_kwargs``,
``reasoning_effort``, ...). Tokenizing the whole rendered prompt and keeping the longest
token prefix that ends at the head's marker gives a strict token prefix of the real
request; tokenizing the cut text alone could merge differently at the cut.

Plans are keyed by the *rendered* head, never by the request text: a template that prints
today's date before the marker (Llama 3.x, gpt-oss) renders another head after midnight,
which must be another fingerprint, never a stale restore; and the probe tokens (the few
tokens after the head that prove a restore) always come from this request.

Cost. Tokenizing a whole 7.5k-token prompt with pieces takes ~25 ms on the test machine,
more than a new session may spend here. So the first time a head is seen, the planner
tokenizes the whole prompt and checks that the tokens after the head equal the tokens of
the text after the head tokenized alone; when they do (a BPE tokenizer with a pre-token
boundary at the cut, which the marker gives), later requests with that head tokenize
only their tail (~1 ms). A head that fails the check is always tokenized whole. The
known heads are kept in a small LRU.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace

import xxhash

from oc_prefix_cache import __version__
from oc_prefix_cache.chat.head import Head, locate_head, tokens_before
from oc_prefix_cache.deadline import Deadline
from oc_prefix_cache.errors import OcpcError
from oc_prefix_cache.llama.client import SlotClient
from oc_prefix_cache.llama.fingerprint import FingerprintInputs, ServerIdentity, fingerprint

PROBE_TOKENS = 4  # tokens of the real prompt after the head, for the reuse probe
MAX_HEADS = 64


@dataclass(frozen=True)
class HeadPlan:
    """A head resolved against one server, for one request."""

    fingerprint: str
    tokens: tuple[int, ...]  # the head's exact tokens
    request_tokens: tuple[int, ...]  # the whole request as the server will tokenize it
    prompt: str  # the whole request as the server renders it
    tools_in_head: bool  # False when the template renders tools after the marker
    harness: str
    split: bool  # the tail was tokenized on its own (the head's split was checked once before)
    project: tuple[int, ...] = ()  # head + the rest of the system prompt (a project head), when cut
    project_text: str = ""  # the rendered text the project head adds to the head
    base: tuple[int, ...] = ()  # a shorter project head between the two (the head's project_base), when cut
    base_text: str = ""  # the rendered text it adds to the head


@dataclass(frozen=True)
class KnownPrefix:
    """A prefix longer than the head whose rendered text and tokens are known (a park): a
    request whose rendering starts with that text tokenizes only what follows it."""

    chars: int
    text_xxh64: str
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class _KnownHead:
    tokens: tuple[int, ...]
    chars: int  # characters of the rendered prompt the tokens cover
    splittable: bool  # tail tokenized alone == tail of the whole tokenization
    text_digest: str = ""  # of the rendered prompt's first ``chars`` characters


class HeadPlanner:
    """Thread-safe; one per process. Known heads keyed by fingerprint (which covers the
    rendered head text and the server's identity), LRU-bounded."""

    def __init__(self, *, max_heads: int = MAX_HEADS) -> None:
        self._guard = threading.Lock()
        self._heads: OrderedDict[str, _KnownHead] = OrderedDict()
        self._bases: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # a shorter project head's tokens past its head
        self._max = max_heads

    def plan(
        self,
        client: SlotClient,
        body: dict[str, object],
        head: Head,
        *,
        server: ServerIdentity,
        harness: str,
        deadline: Deadline | None = None,
        system_text: str | None = None,
        longer: KnownPrefix | None = None,
    ) -> HeadPlan:
        """``system_text``: the first system message's text, to cut a project head too (or, when
        the head has a ``project_tail``, the project head ends after that text instead).
        ``longer``: a known longer prefix of this request (its park): when the rendering starts
        with its text, only the text after it is tokenized (a long conversation resumed)."""
        prompt = client.apply_template(body, deadline=deadline)
        offset = locate_head(prompt, head)
        if offset is None:
            raise OcpcError("the chat template changed the system text; cannot find the head in the prompt")
        fp = fingerprint(
            FingerprintInputs(
                server=server, harness=harness, ocpc_version=__version__, head=head, rendered_head=prompt[:offset]
            )
        )
        known = self._known(fp)
        split = known is not None and known.splittable
        if known is not None and split:
            chars, start = known.chars, known.tokens
            if longer is not None and _starts_with(prompt, longer) and longer.tokens[: len(start)] == start:
                chars, start = longer.chars, longer.tokens
            tail = client.tokenize(prompt[chars:], add_special=False, deadline=deadline)
            tokens = start + tuple(tail)
        else:
            known, tokens = self._learn(client, prompt, offset, deadline=deadline)
            self._remember(fp, known)
        tools_at = prompt.find(f'"name": "{first_tool_name(body)}"')
        project: tuple[int, ...] = ()
        project_text = ""
        base: tuple[int, ...] = ()
        base_text = ""
        if system_text:
            project, project_text = self._project(
                client,
                prompt,
                tokens,
                known,
                head.project_tail or system_text,
                spaces=bool(head.project_tail),
                deadline=deadline,
            )
        if project and head.project_base:
            base, base_text = self._base(client, prompt, project, known, head.project_base, deadline=deadline)
        return HeadPlan(
            fingerprint=fp,
            tokens=known.tokens,
            request_tokens=tokens,
            prompt=prompt,
            tools_in_head=0 <= tools_at < offset,
            harness=harness,
            split=split,
            project=project,
            project_text=project_text,
            base=base,
            base_text=base_text,
        )

    @staticmethod
    def _project(
        client: SlotClient,
        prompt: str,
        tokens: tuple[int, ...],
        known: _KnownHead,
        end_text: str,
        *,
        spaces: bool,
        deadline: Deadline | None,
    ) -> tuple[tuple[int, ...], str]:
        """The project head: the head, then the prompt up to the end of ``end_text`` as rendered
        (the system text: followed by the template's end-of-message token, a clean token
        boundary; a harness's ``project_tail`` inside the first user message: ``spaces`` takes the
        whitespace after it too, where the tokenizer keeps it with the text before, e.g.
        ``>\n``). Checked to be a strict prefix of ``tokens`` (this request's, or a longer project
        head's for its base); () when it cannot be cut."""
        tail = end_text.rstrip()[-200:]
        at = prompt.find(tail, known.chars) if tail else -1
        if at < 0:
            return (), ""
        end = at + len(tail)
        ends = [end]
        while spaces and end < len(prompt) and prompt[end] in " \t\n":
            end += 1
        if end != ends[0]:
            ends.insert(0, end)
        for cut in ends:
            text = prompt[known.chars : cut]
            extra = tuple(client.tokenize(text, add_special=False, deadline=deadline))
            project = known.tokens + extra
            if extra and len(project) < len(tokens) and tokens[: len(project)] == project:
                return project, text
        return (), ""

    def _base(
        self,
        client: SlotClient,
        prompt: str,
        project: tuple[int, ...],
        known: _KnownHead,
        end_text: str,
        *,
        deadline: Deadline | None,
    ) -> tuple[tuple[int, ...], str]:
        """The project head's shorter level: the project head's tokens as far as they cover the
        prompt up to the end of ``end_text``. Where the next part's first characters merge with that
        end into one token (Claude Code joins its reminders without a separator: ``><`` is one
        token), the level ends one token before, so it is a strict token prefix of the project head
        whatever follows: the tokens of that text alone and the project head's agree up to there.
        Its key text is that text and the token count. Each level's tokens are remembered (LRU), so
        a later session of the project tokenizes nothing more for it. () when nothing beyond the
        head is left."""
        tail = end_text.rstrip()[-200:]
        at = prompt.find(tail, known.chars) if tail else -1
        if at < 0:
            return (), ""
        text = prompt[known.chars : at + len(tail)]
        rest = project[len(known.tokens) :]
        key = xxhash.xxh64_hexdigest(f"{known.text_digest}\x00{text}".encode())
        with self._guard:
            extra = self._bases.get(key)
        if extra is None or rest[: len(extra)] != extra:
            alone = client.tokenize(text, add_special=False, deadline=deadline)
            n = next(
                (i for i, (a, b) in enumerate(zip(alone, rest, strict=False)) if a != b), min(len(alone), len(rest))
            )
            extra = tuple(rest[:n])
            with self._guard:
                self._bases[key] = extra
                while len(self._bases) > self._max:
                    self._bases.popitem(last=False)
        if not extra or len(extra) >= len(rest):
            return (), ""
        return known.tokens + extra, f"{text}\x00{len(extra)}"

    def distrust(self, fingerprint: str) -> None:
        """A real request missed a head planned from split tokenization: tokenize whole from now on."""
        with self._guard:
            known = self._heads.get(fingerprint)
            if known is not None and known.splittable:
                self._heads[fingerprint] = replace(known, splittable=False)

    def _learn(
        self, client: SlotClient, prompt: str, offset: int, *, deadline: Deadline | None
    ) -> tuple[_KnownHead, tuple[int, ...]]:
        pieces = client.tokenize_pieces(prompt, deadline=deadline)
        n = len(tokens_before(pieces, len(prompt[:offset].encode())))
        used = sum(len(raw) for _, raw in pieces[:n])
        if n == 0:
            raise OcpcError("the head is empty after rendering; nothing to cache")
        tokens = tuple(t for t, _ in pieces)
        chars = len(prompt.encode()[:used].decode(errors="ignore"))
        tail = client.tokenize(prompt[chars:], add_special=False, deadline=deadline)
        return _KnownHead(
            tokens[:n],
            chars,
            splittable=tuple(tail) == tokens[n:],
            text_digest=xxhash.xxh64_hexdigest(prompt[:chars].encode()),
        ), tokens

    def tokens_of(
        self, client: SlotClient, body: dict[str, object], *, head: str, deadline: Deadline | None = None
    ) -> tuple[int, ...]:
        return self.rendered(client, body, head=head, deadline=deadline)[1]

    def rendered(
        self, client: SlotClient, body: dict[str, object], *, head: str, deadline: Deadline | None = None
    ) -> tuple[str, tuple[int, ...]]:
        """``body`` rendered (as given: e.g. without its generation prompt) and tokenized,
        reusing the tokens of its head ``head`` when known and splittable: a long conversation
        then costs the tokenization of its tail only."""
        prompt = client.apply_template(body, deadline=deadline)
        known = self._known(head)
        if (
            known is not None
            and known.splittable
            and known.text_digest == xxhash.xxh64_hexdigest(prompt[: known.chars].encode())
        ):
            tail = client.tokenize(prompt[known.chars :], add_special=False, deadline=deadline)
            return prompt, known.tokens + tuple(tail)
        return prompt, tuple(client.tokenize(prompt, add_special=True, deadline=deadline))

    def text_of(
        self, client: SlotClient, prompt: str, tokens: tuple[int, ...], *, head: str, deadline: Deadline | None = None
    ) -> KnownPrefix | None:
        """``tokens`` (a prefix of ``prompt``'s tokens) as a ``KnownPrefix``: the known head's
        text plus the detokenized rest, checked to be where ``prompt`` starts."""
        known = self._known(head)
        if known is None or tokens[: len(known.tokens)] != known.tokens:
            return None
        text = prompt[: known.chars] + client.detokenize(list(tokens[len(known.tokens) :]), deadline=deadline)
        if not prompt.startswith(text):
            return None
        return KnownPrefix(chars=len(text), text_xxh64=xxhash.xxh64_hexdigest(text.encode()), tokens=tokens)

    def _known(self, fp: str) -> _KnownHead | None:
        with self._guard:
            known = self._heads.get(fp)
            if known is not None:
                self._heads.move_to_end(fp)
            return known

    def _remember(self, fp: str, known: _KnownHead) -> None:
        with self._guard:
            self._heads[fp] = known
            self._heads.move_to_end(fp)
            while len(self._heads) > self._max:
                self._heads.popitem(last=False)


def _starts_with(prompt: str, prefix: KnownPrefix) -> bool:
    return len(prompt) > prefix.chars and xxhash.xxh64_hexdigest(prompt[: prefix.chars].encode()) == prefix.text_xxh64


def first_tool_name(body: dict[str, object]) -> str:
    tools = body.get("tools")
    first = tools[0] if isinstance(tools, list) and tools and isinstance(tools[0], dict) else {}
    function = first.get("function") if isinstance(first.get("function"), dict) else first
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else "\x00"
