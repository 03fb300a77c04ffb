"""Secrets out of what is printed or stored: the credentials, query values and fragments of URLs.

Tokens travel in URLs as `user:password@`, as query values (`?token=...`, `?sig=...`) and in
fragments; any of them in a log line, a failure record or provenance.json is a leaked secret. Parameter
names stay, so a reader still sees which parameters a URL carried.
"""

from __future__ import annotations

import re

# A URL runs to the next space or quote; anything after it that looks like part of it is redacted too.
_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"<>]+")
# Greedy to the last "@" before the path: a password may itself hold "@".
_USERINFO = re.compile(r"(?i)^([a-z][a-z0-9+.-]*://)[^/?#]*@")


def _redact_url(url: str) -> str:
    url, hash_sign, fragment = url.partition("#")
    url, question, query = url.partition("?")
    url = _USERINFO.sub(r"\1***@", url)
    if question:
        fields = re.split(r"([&;])", query)
        query = "".join(f if f in "&;" else (f.split("=", 1)[0] + "=***" if "=" in f else "***") for f in fields)
    return url + question + query + (hash_sign + "***" if hash_sign else "")


def redact_urls(text: str) -> str:
    """Every URL in `text` with `user:password@` as `***@`, each query value and the fragment as `***`."""
    return _URL.sub(lambda m: _redact_url(m.group(0)), text)
