"""What an option's text may be, parsed and checked, and how a refused value is shown with its
secrets masked.

Apart from ``sidecar.config``, which holds what the options are (the ``OPTIONS`` table, ``Config``,
the parser and the checks across options): these parsers and formatters know nothing of any
option, only of a kind of value (seconds, a receiver URL, a secret's file, NAME=VALUE pairs), so
they are read and tested as one thing, and the table reads as a table. Like the configuration,
they import nothing of the package above its foundations (tests/test_layout.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from urllib.parse import SplitResult, urlsplit

from sidecar import protocol
from sidecar.urls import effective_port


def seconds(low: float, high: float) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or not low <= value <= high:
            raise ValueError(f"must be between {low} and {high} seconds")
        return value

    return parse


def positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number")
    return value


def choice(*allowed: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in allowed:
            raise ValueError(f"must be one of {', '.join(allowed)}")
        return text

    return parse


def gpus(text: str) -> str:
    text = text.strip()
    if text in ("announced", "visible"):
        return text
    uuids = [u.strip() for u in text.split(",") if u.strip()]
    if not uuids:
        raise ValueError("give 'announced', 'visible' or a comma-separated list of GPU UUIDs")
    for u in uuids:
        if not protocol.UUID_RE.match(u):
            raise ValueError(f"{u!r} is not a GPU UUID (GPU-... or MIG-..., see nvidia-smi -L)")
    return ",".join(uuids)


_SUN_PATH_MAX = 107  # bytes of a Unix socket path (sockaddr_un.sun_path, less its NUL)


def socket_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    if len(text.encode()) > _SUN_PATH_MAX:
        raise ValueError(f"is longer than the {_SUN_PATH_MAX} bytes a Unix socket path may have")
    return text


def socket_path_like(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("must be an absolute path")
    return text


def gpu_count(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 16:
        raise ValueError("must be between 1 and 16")
    return value


def boolean(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be true or false")


def urls(text: str) -> tuple[str, ...]:
    """Comma-separated receiver URLs, each valid, no receiver twice."""
    found = tuple(u.strip() for u in text.split(",") if u.strip())
    if not found:
        raise ValueError("give at least one URL")
    for n, u in enumerate(found, 1):
        try:
            url(u)
        except ValueError as exc:
            raise ValueError(f"URL {n} of {len(found)} {exc}" if len(found) > 1 else str(exc)) from None
    _refuse_repeats(found)
    return found


def engine_urls(text: str) -> tuple[str, ...]:
    """Engine endpoints: URLs like the receivers', but with no credentials (none is ever sent to
    an engine, and a URL's user-info would be)."""
    try:
        found = urls(text)
    except ValueError as exc:
        if "names the receiver of URL" not in str(exc):
            raise
        raise ValueError(str(exc).split(" (", 1)[0].replace("receiver", "endpoint")
                         + ": the engine would be read, and its requests counted, twice; give "
                         "each endpoint once") from None
    for n, u in enumerate(found, 1):
        if "@" in urlsplit(u).netloc:
            raise ValueError(f"URL {n} of {len(found)} holds credentials (user@): the agent sends "
                             "none to an engine; expose its metrics without authentication on "
                             "localhost" if len(found) > 1 else "holds credentials (user@): the "
                             "agent sends none to an engine; expose its metrics without "
                             "authentication on localhost")
    return found


def url(text: str) -> str:
    """An http(s) URL with a host and a valid port, if any.

    The messages never quote ``text``: it may hold a password (build() shows it masked). urlsplit's
    own errors quote parts of it, so they are replaced."""
    try:
        parts = urlsplit(text)
        host = parts.hostname
    except ValueError:
        raise ValueError("cannot be read as a URL: write http[s]://HOST[:PORT]/PATH (percent-encode "
                         "'@', '/', '?', '#', '[' and ']' inside a user name or password)") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError("does not start with http:// or https://")
    port = _port(parts)
    if not host:
        raise ValueError("has no host: write http[s]://HOST[:PORT]/PATH")
    if not parts.netloc.rpartition("@")[2].startswith("[") and not _HOST.fullmatch(host):
        raise ValueError("has a host with characters a host name cannot hold (letters, digits, "
                         "'.', '-', '_'; an IPv6 address goes in [brackets])")
    if port == 0:
        raise ValueError("has port 0: give a port from 1 to 65535, or none for the default")
    if "@" in parts.path + parts.query + parts.fragment:
        raise ValueError("has an '@' after the host, which a password with an unencoded '/', '?' or "
                         "'#' leaves behind: percent-encode those (%2F, %3F, %23), or better, give "
                         "the password with --basic-auth-password-file")
    return text


def _port(parts: SplitResult) -> int | None:
    """urlsplit's port, which raises for a port that is not a number from 0 to 65535."""
    try:
        return parts.port
    except ValueError:
        raise ValueError("has a port that is not a number from 1 to 65535") from None


def _receiver(url: str) -> tuple[str, str, int, str, str]:
    """What identifies a receiver: credentials, case of scheme and host, a default port and an
    empty path make no difference."""
    parts = urlsplit(url)
    return parts.scheme, parts.hostname or "", effective_port(parts), parts.path or "/", parts.query


def _refuse_repeats(urls: tuple[str, ...]) -> None:
    """The same receiver twice would get every sample twice (two sinks, one spool directory)."""
    first: dict[tuple[str, str, int, str, str], int] = {}
    for n, url in enumerate(urls, 1):
        m = first.setdefault(_receiver(url), n)
        if m != n:
            raise ValueError(f"URL {n} names the receiver of URL {m} again ({shown_url(url)}; URLs "
                             "that differ only in credentials, letter case or a default port are "
                             "the same receiver): every sample would be pushed to it twice; give "
                             "each receiver once")


def shown_url(text: str) -> str:
    """``text`` fit for an error message: no user-info, query values and fragment masked, a port
    that is not a number masked.

    Done by hand, not with urlsplit: the URL is shown because it is broken, and a broken one is
    where urlsplit raises (a bad port) or files part of an unencoded password under host, port or
    path. Cutting at the last '@' anywhere removes user-info however it was mangled."""
    scheme, sep, rest = text.strip().partition("://")
    if not sep:
        scheme, rest = "", text.strip()
    userinfo = ""
    if "@" in rest:
        userinfo, rest = "***@", rest.rpartition("@")[2]
    rest, hash_sign, _ = rest.partition("#")
    rest, question, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    shown = f"{scheme}{sep}{userinfo}{_masked_port(authority)}{slash}{path}"
    if question:
        shown += "?" + "&".join(f"{k}=***" if eq else "***"
                                for k, eq, _ in (p.partition("=") for p in query.split("&")))
    return shown + ("#***" if hash_sign else "")


def _masked_port(authority: str) -> str:
    """``host:port`` with a port that is not digits masked: it may be the start of a password
    whose '@' was lost (an unencoded ',' splits the URL list there)."""
    host, colon, port = authority.rpartition(":")
    if not colon or "]" in port or port.isdigit() or not port:
        return authority
    return f"{host}:***"


def shown_urls(text: str) -> str:
    """A comma-separated list as the URL parser splits it, each URL masked."""
    return repr(", ".join(shown_url(u) for u in text.split(",") if u.strip()))


def shown_one_url(text: str) -> str:
    return repr(shown_url(text))


def readable_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise ValueError("is not a readable file")
    return text


def secret_file(text: str) -> str:
    """A file holding a secret. A value that is not an absolute path is often the secret itself,
    pasted where its file belongs; the error says so instead of quoting it."""
    try:
        return readable_file(text)
    except ValueError:
        if text.startswith("/"):
            raise
        raise ValueError("is not a readable file; give the absolute path of a file holding the "
                         "secret (e.g. a mounted Kubernetes Secret), not the secret itself (the "
                         "value is not shown: it is not an absolute path, so it may be the secret)") from None


def shown_secret_path(text: str) -> str | None:
    """Absolute paths are shown; anything else may be the secret itself (see secret_file)."""
    return repr(text) if text.startswith("/") else None


def basic_auth_user(text: str) -> str:
    """RFC 7617 ends the user name at the first ':', so one in it is a password given here."""
    if ":" in text:
        raise ValueError("contains ':', which basic auth does not allow in a user name (it is not "
                         "shown: the rest may be a password); give the password with "
                         "--basic-auth-password-file")
    return text


def hidden(text: str) -> None:
    """For options whose refused value is not quoted at all."""
    return None


def pairs(kind: str, example: str, rule: str,
           check_key: Callable[[str], bool]) -> Callable[[str], tuple[tuple[str, str], ...]]:
    """Comma-separated NAME=VALUE items. Errors name the item by position, never by text: a
    malformed item is often a header with its value (``Authorization: Bearer ...``)."""

    def parse(text: str) -> tuple[tuple[str, str], ...]:
        out = []
        items = [i.strip() for i in text.split(",") if i.strip()]
        for n, item in enumerate(items, 1):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"item {n} has no '=': write NAME=VALUE, e.g. {example}, not "
                                 "NAME: VALUE (the item is not shown: it may hold a secret)")
            if not check_key(key.strip()):
                raise ValueError(f"item {n} has no valid {kind} name before its '=' ({rule}; "
                                 "the item is not shown: it may hold a secret)")
            out.append((key.strip(), value.strip()))
        return tuple(out)

    return parse


def shown_pairs(text: str) -> str:
    """NAME=*** for the items that have a name, ``<item N>`` for the others; values never."""
    shown = []
    for n, item in enumerate((i.strip() for i in text.split(",") if i.strip()), 1):
        key, sep, _ = item.partition("=")
        shown.append(f"{key.strip()}=***" if sep and HEADER_NAME.match(key.strip()) else f"<item {n}>")
    return "[" + ", ".join(shown) + "]"


def positive_int(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}")
        return value

    return parse


LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
_HOST = re.compile(r"[\w.-]+")  # \w: internationalised names too


def label(text: str) -> str:
    if len(text) > 253 or not re.fullmatch(r"[A-Za-z0-9._\-]*", text):
        raise ValueError("must be a Kubernetes name (letters, digits, '.', '-', '_')")
    return text


def listen_address(text: str) -> str:
    """HOST:PORT to listen on: an IPv4 address, [IPv6], a host name, or empty for every
    address; the port 1..65535."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT with a port from 1 to 65535, e.g. 0.0.0.0:9400")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if bare and not (_HOST.fullmatch(bare) or (":" in bare and host.startswith("["))):
        raise ValueError("has a host that is no address or host name (an IPv6 address goes "
                         "in [brackets])")
    return text


def job_name(text: str) -> str:
    """A Job's name as the label batch.kubernetes.io/job-name carries it: it becomes a path
    segment of the Pushgateway's grouping URL, where '.' or '..' would be normalised away."""
    if text and (len(text) > 63 or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", text)):
        raise ValueError("must be a Kubernetes Job name: at most 63 lowercase letters, digits, "
                         "'-' or '.', starting and ending with a letter or digit")
    return text


def completion_index(text: str) -> str:
    if text and not re.fullmatch(r"0|[1-9][0-9]{0,8}", text):
        raise ValueError("must be a Job completion index: a whole number from 0, or empty")
    return text


_SELECT = re.compile(r"^([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)(.*)$")


def selectors(text: str) -> tuple[tuple[str, str, str], ...]:
    """Comma-separated label matchers, PromQL's four operators; a regex must compile."""
    out = []
    for n, item in enumerate((i.strip() for i in text.split(",") if i.strip()), 1):
        m = _SELECT.match(item)
        if m is None or m.group(1).startswith("__"):
            raise ValueError(f"item {n} is not LABEL=VALUE (or LABEL!=VALUE, LABEL=~REGEX, "
                             "LABEL!~REGEX; a label name is letters, digits and '_', not "
                             "starting with a digit or '__'), e.g. namespace=prod")
        label, op, value = m.group(1), m.group(2), m.group(3).strip()
        if "~" in op:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"item {n} has a regular expression that does not compile "
                                 f"({exc})") from None
        out.append((label, op, value))
    return tuple(out)


_RELATIVE = re.compile(r"^(?:now)?\s*-\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def instant(text: str, now: float) -> float:
    """Unix seconds of an --at value: 'now', relative to ``now`` (-6h), Unix seconds, or an
    RFC 3339 time with its zone (a time without one would depend on the machine's zone)."""
    import datetime

    text = text.strip()
    if text == "now":
        return now
    if m := _RELATIVE.match(text):
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    try:
        when = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError("is neither 'now', a relative time (-6h, -90m, -30s, -2d), Unix seconds "
                         "nor an RFC 3339 time (2025-01-31T03:00:00Z)") from None
    if when.tzinfo is None:
        raise ValueError("has no time zone: add one (Z for UTC, or +02:00), the machine's own "
                         "zone is not assumed")
    return when.timestamp()


def instant_text(text: str) -> str:
    instant(text, 0.0)
    return text.strip()
