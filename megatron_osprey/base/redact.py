"""Secrets out of what is printed or stored: the credentials, query values and fragments of URLs.

Tokens travel in URLs as `user:password@`, as query values (`?token=...`, `?sig=...`) and in
fragments; any of them in a log line, a failure record or provenance.json is a leaked secret. Parameter
names stay, so a reader still sees which parameters a URL carried.
"""

from __future__ import annotations

import logging
import re
import sys

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


# An HTTP bearer or basic credential as a header line prints it: `Authorization: Bearer KEY`.
_AUTHORIZATION = re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+")
# Libraries that log every request URL at INFO (httpx) or headers at DEBUG (httpcore).
_HTTP_LOGGERS = ("httpx", "httpcore")


class RedactingFormatter(logging.Formatter):
    """Formats a record, then redacts the whole text (message, traceback, stack): URL secrets, authorization
    credentials and the given `secrets` (API keys) become `***`, whichever logger, ours or a library's, wrote it."""

    def __init__(self, fmt: str | None = None, secrets: tuple[str, ...] = ()):
        super().__init__(fmt)
        self._secrets = tuple(sorted({s for s in secrets if s}, key=len, reverse=True))

    def format(self, record: logging.LogRecord) -> str:
        text = _AUTHORIZATION.sub(r"\1 ***", redact_urls(super().format(record)))
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text


def configure_redacted_logging(level: int = logging.INFO, secrets: tuple[str, ...] = (), stream=None) -> None:
    """An entry point's logging: one stderr handler whose lines carry no URL secret or key (RedactingFormatter),
    and the HTTP libraries' per-request lines kept at WARNING. As logging.basicConfig, it leaves a program that
    configured the root logger itself as it is."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(message)s", secrets))
    logging.basicConfig(level=level, handlers=[handler])
    for name in _HTTP_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
