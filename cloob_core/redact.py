"""Credentials never leave the process: URLs as the stages record them, and every error line a command prints.

A manifest URL may carry credentials: user info (``https://user:secret@host/…``) or a token in its query
(``?token=…``, a pre-signed S3 URL's ``X-Amz-Signature``). The fetch uses the URL as given; every record and log
line the stages write (failure files, the per-sample ``.json`` in the tars, the data gate's report, warnings)
carries it with the user info removed and the values of sensitive query parameters replaced. Sample keys and the
URL dedup are computed from the rows and the full URLs, so redaction changes neither.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_plus, urlsplit, urlunsplit

REDACTED = "REDACTED"
# Query parameters that carry credentials in the URLs of common stores and CDNs: bearer tokens, API keys, S3 / GCS /
# Azure / CloudFront signatures and session credentials.
SECRET_QUERY_PARAMS = ("token", "access_token", "id_token", "refresh_token", "auth", "authorization", "sig",
                       "signature", "x-amz-signature", "x-amz-credential", "x-amz-security-token",
                       "x-goog-signature", "x-goog-credential", "key", "api_key", "apikey", "api-key", "password",
                       "passwd", "secret", "client_secret", "policy", "key-pair-id", "session", "sessionid", "jwt")
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"<>\]\)]+")
_USERINFO = re.compile(r"(?<=://)[^/@\s'\"]+@")


@dataclass(frozen=True)
class Redactor:
    """Redacts the query parameters named in ``names`` (case-insensitive) and any user info."""

    names: frozenset[str]

    @classmethod
    def of(cls, names: Iterable[str]) -> Redactor:
        return cls(frozenset(name.lower() for name in names))

    @property
    def _assignment(self) -> re.Pattern[str] | None:
        if not self.names:
            return None
        alternatives = "|".join(sorted((re.escape(name) for name in self.names), key=len, reverse=True))
        return re.compile(rf"(?i)(?<![\w.\-])({alternatives})=([^&\s'\"#]*)")

    def url(self, url: str) -> str:
        """``url`` without user info and with the sensitive query values replaced; other parts byte for byte."""
        try:
            parts = urlsplit(url)
        except ValueError:
            return self.text(url)
        netloc = parts.netloc.rpartition("@")[2]
        query = "&".join(self._query_item(item) for item in parts.query.split("&")) if parts.query else ""
        if (netloc, query) == (parts.netloc, parts.query):
            return url  # nothing to hide: the URL as given, byte for byte
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))

    def _query_item(self, item: str) -> str:
        name, equals, _value = item.partition("=")
        return f"{name}={REDACTED}" if equals and unquote_plus(name).lower() in self.names else item

    def text(self, text: str) -> str:
        """A message that may quote URLs, or only their path and query (as urllib3's errors do)."""
        text = _URL.sub(lambda match: self.url(match.group(0)), text)
        text = _USERINFO.sub("", text)
        assignment = self._assignment
        return assignment.sub(rf"\1={REDACTED}", text) if assignment else text

    def value(self, value: Any) -> Any:
        """Every string inside a JSON-like value redacted (a report's examples, a whole result)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        return value


def redacted(text: str) -> str:
    """``text`` with the user info of its URLs removed and the values of their :data:`SECRET_QUERY_PARAMS`
    replaced: what a refusal or failure line may print, whatever it quotes. Unlike :meth:`Redactor.text`, a bare
    ``key=value`` outside a URL is left alone (a line may quote a flag's ``KEY=VALUE`` form)."""
    return _USERINFO.sub("", _URL.sub(lambda match: _DEFAULT.url(match.group(0)), text))


_DEFAULT = Redactor.of(SECRET_QUERY_PARAMS)
