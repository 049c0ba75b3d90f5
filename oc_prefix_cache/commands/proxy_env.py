"""Whether the agents would send their requests to a proxy from the environment instead of to ocpc.

ocpc's own calls ignore ``HTTP_PROXY`` and its kin (loopback.py). The agents do not: each
honours them on its way to ocpc's proxy, its daemon or llama-server, all on 127.0.0.1, and
only ``NO_PROXY`` keeps 127.0.0.1 out. Without it the agent's requests, prompts included, go to
that proxy, which cannot reach this machine's 127.0.0.1 (or reaches its own): the agent fails,
and the prompt has left the machine. ``ocpc doctor`` and ``ocpc install`` say so, and what to set.

What counts as covered is what every agent's HTTP stack agrees on: the exact address
(``127.0.0.1``) or ``*``. The others are not safe for every agent:

- ``localhost`` does not cover ``127.0.0.1``: clients compare the URL's host as written, and
  ocpc's URLs say ``127.0.0.1`` (the two entries are needed for the two spellings);
- a CIDR range (``127.0.0.0/8``) is honoured by some stacks (Rust's reqwest, which Codex uses;
  Python's requests) and not by others (httpx, under the Python agents' OpenAI client; Node's
  undici ``EnvHttpProxyAgent``, which pi installs): measured for httpx, documented for the rest;
- a glob (``127.*``) is read by almost none.

Both spellings matter: Node's undici reads ``no_proxy`` first, reqwest ``NO_PROXY`` first, so
when both are set each must cover 127.0.0.1.

Measured with the real agents (tests/e2e/test_e2e_*.py behind tests/proxy_stub.py, 2026-12-06): pi and
Codex CLI send their requests for 127.0.0.1 to ``HTTP_PROXY`` with ``NO_PROXY=localhost``, and go
directly with ``NO_PROXY=127.0.0.1,localhost``; every agent's end-to-end test passes with the latter.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

PROXY_VARS = ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")
LOOPBACK = "127.0.0.1"
WANTED = ("127.0.0.1", "localhost")  # what to add: the address ocpc's URLs use, and the name

AGENT_NAMES = {
    "opencode": "OpenCode",
    "claude-code": "Claude Code",
    "pi": "pi",
    "kilo-code": "Kilo Code",
    "codex": "Codex CLI",
    "aider": "Aider",
    "qwen-code": "Qwen Code",
    "cline": "Cline",
}


def _entries(value: str) -> list[str]:
    return [e.strip().lower().strip("[]") for e in re.split(r"[,\s]+", value) if e.strip()]


def covers(value: str, host: str) -> bool:
    """Whether a ``NO_PROXY`` value keeps ``host`` off the proxy for every agent: ``*``, the
    host itself, or (for a name, not an address) a domain it is in."""
    host = host.lower().strip("[]")
    try:
        ipaddress.ip_address(host)
        is_address = True
    except ValueError:
        is_address = False
    for entry in _entries(value):
        if entry in ("*", host):
            return True
        if not is_address and host.endswith("." + entry.lstrip(".")):
            return True
    return False


def _notes(value: str, host: str) -> list[str]:
    """Why the entries that look like they cover ``host`` do not, for every agent."""
    notes = []
    for entry in _entries(value):
        if "/" in entry:
            try:
                if ipaddress.ip_address(host) in ipaddress.ip_network(entry, strict=False):
                    notes.append(
                        f"{entry} is a CIDR range: Codex (reqwest) and Python's requests honour it, "
                        "httpx (under the Python agents' OpenAI client) and Node's undici (pi) do not"
                    )
            except ValueError:
                pass
        elif "*" in entry and entry != "*":
            notes.append(f"{entry} is a glob, which most HTTP clients do not read")
        elif entry == "localhost" and host != "localhost":
            notes.append(f"localhost does not cover {host}: clients compare the host as the URL writes it")
    return notes


@dataclass(frozen=True)
class ProxyGap:
    """Proxy variables are set and ``NO_PROXY`` leaves some of ocpc's loopback hosts to them."""

    proxies: tuple[str, ...]  # the proxy variables set (names only: a value may hold a password)
    no_proxy: Mapping[str, str]  # the NO_PROXY spellings set, and their values
    lacking: tuple[str, ...]  # those of them that leave a host out (empty: neither is set)
    hosts: tuple[str, ...]  # ocpc's hosts they do not cover
    notes: tuple[str, ...]  # why a near miss does not count

    @property
    def https_only(self) -> bool:
        """Only HTTPS_PROXY is set: most clients use it for https:// URLs alone (ocpc's are
        http://), but not every agent keeps to that."""
        return all(name.lower() == "https_proxy" for name in self.proxies)

    @property
    def value(self) -> str:
        """The NO_PROXY value to set: what is there now, plus what is missing."""
        kept: dict[str, str] = {}  # lower-case -> as written, in order
        for value in self.no_proxy.values():
            for entry in re.split(r"[,\s]+", value):
                if entry.strip():
                    kept.setdefault(entry.strip().lower(), entry.strip())
        for wanted in (*WANTED, *self.hosts):
            kept.setdefault(wanted, wanted)
        return ",".join(kept.values())

    @property
    def fix(self) -> str:
        value = shlex.quote(self.value)
        return f"export NO_PROXY={value} no_proxy={value} (where the agents start: shell, service, IDE)"

    def detail(self, who: str, where: str) -> str:
        """What happens to ``who`` (the agents, in words) on its way to ``where``."""
        no = (
            "; ".join(f"{k}={self.no_proxy[k]!r}" for k in self.lacking) + " does not list "
            if self.lacking
            else "NO_PROXY is not set, so nothing keeps out "
        )
        text = (
            f"{', '.join(self.proxies)} set and {no}{', '.join(self.hosts)}: {who} would send the requests "
            f"meant for {where}, prompts included, to that proxy instead"
        )
        if self.https_only:
            text += " if it sends http:// requests through HTTPS_PROXY too (most clients use it for https:// only)"
        text += " (ocpc's own calls ignore proxy variables)"
        return text + "".join(f"; {note}" for note in self.notes)


def loopback_hosts(urls: Sequence[str]) -> tuple[str, ...]:
    """The hosts of ``urls`` that are this machine (ocpc's doors, a local llama-server)."""
    hosts: list[str] = []
    for url in urls:
        host = (urlsplit(url).hostname or "").lower()
        try:
            local = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            local = False
        if local and host not in hosts:
            hosts.append(host)
    return tuple(hosts)


def proxy_gap(environ: Mapping[str, str], urls: Sequence[str]) -> ProxyGap | None:
    """The gap, or None when no proxy variable is set or ``NO_PROXY`` covers every loopback
    host of ``urls`` (ocpc's proxy, daemon, a local llama-server) in every spelling set."""
    proxies = tuple(name for name in PROXY_VARS if environ.get(name, "").strip())
    if not proxies:
        return None
    no_proxy = {name: environ[name] for name in NO_PROXY_VARS if environ.get(name, "").strip()}
    hosts = loopback_hosts(urls) or (LOOPBACK,)
    missing = tuple(h for h in hosts if not no_proxy or not all(covers(v, h) for v in no_proxy.values()))
    if not missing:
        return None
    lacking = tuple(k for k, v in no_proxy.items() if not all(covers(v, h) for h in missing))
    notes = tuple(dict.fromkeys(n for h in missing for k in lacking for n in _notes(no_proxy[k], h)))
    return ProxyGap(proxies, no_proxy, lacking, missing, notes)
