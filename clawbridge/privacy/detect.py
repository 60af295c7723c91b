"""Finding secrets and personal data in text: the `PrivacyFilter` seam, its detectors and a fake.

Detectors (`DETECTORS`, chosen by `privacy_detectors`), each from a maintained library where one
exists (docs/privacy.md says why these and not presidio-analyzer):
- `keys`: every regex plugin of detect-secrets (AWS, GitHub, GitLab, Slack, OpenAI, Stripe,
  JWT, npm, PyPI, SendGrid, Twilio, Discord, Telegram, basic-auth URLs, private keys, ...) except
  its public-IP plugin (version strings look like IPs), plus key shapes it lacks (Anthropic,
  GitHub fine-grained, Hugging Face, Google API keys `AIza` + 35 characters), and AWS secret
  access keys beside their name however they are written (detect-secrets needs quotes). A match is
  extended to the end of its token (detect-secrets' JWT pattern stops before the signature). A private key header extends to its END
  line (or the end of the text when it has none).
- `phone`: phonenumbers' `PhoneNumberMatcher` (leniency STRICT_GROUPING: valid numbers whose digit
  groups follow the country's format, so `INV-2024-000123` is not a phone number) for each of `privacy_phone_regions`;
  numbers written with a +country code are found whatever the region.
- `card`: 13-19 digits (spaces or dashes between) with a known card-network prefix that pass the
  Luhn check (python-stdnum's `luhn`).
- `iban`: a country code, two check digits and 11-30 letters or digits (groups of 4 allowed) that
  python-stdnum's `iban` validates (country length, format and mod-97 checksum).
- `email`: local@domain.tld (the one pattern without a library check: a syntactically valid address
  is personal data whether or not it is deliverable).
- user patterns (`privacy_patterns`): regular expressions, found as kind `custom`.

Invariants:
- `find` returns findings sorted, non-overlapping (overlaps merged, the earlier finding's kind
  kept) and non-empty, as character offsets into the text it was given.
- A finding's text is never logged or stored by this package: only kinds and counts leave it.
- Pure and thread-safe: nothing is cached between calls, and no detector touches the network.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

DETECTORS: tuple[str, ...] = ("keys", "email", "phone", "card", "iban")
"""Detector names `privacy_detectors` accepts."""

PLACEHOLDERS: dict[str, str] = {
    "secret": "[SECRET]", "email": "[EMAIL]", "phone": "[PHONE]", "card": "[CARD]", "iban": "[IBAN]",
    "custom": "[REDACTED]",
}
"""What replaces a finding of each kind in the text (and tokens) that leave the machine."""

_EMAIL = re.compile(r"(?<![\w.+%-])[\w.+%-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,24}(?![\w-])")
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}")
_EXTRA_SECRETS: tuple[re.Pattern[str], ...] = (
    re.compile(r"sk-ant-[a-z]+\d{2}-[A-Za-z0-9_-]{80,}"),  # Anthropic API and admin keys
    re.compile(r"github_pat_[A-Za-z0-9_]{60,}"),  # GitHub fine-grained tokens
    re.compile(r"hf_[A-Za-z0-9]{34,}"),  # Hugging Face tokens
    re.compile(r"(?<![A-Za-z0-9_-])AIza[A-Za-z0-9_-]{35}(?![A-Za-z0-9_-])"),  # Google API keys (Maps, Gemini, Firebase)
)
"""Key shapes agents' users hold that detect-secrets 1.5 has no plugin for (docs/privacy.md)."""
_NAMED_SECRETS: tuple[re.Pattern[str], ...] = (
    # An AWS secret access key: 40 base64 characters with no prefix of their own, so found beside
    # its name (aws_secret_access_key, AWS_SECRET_ACCESS_KEY, SecretAccessKey, secret_key, "AWS
    # secret key"), on its line or the next (a `value:` under a `name:`), quoted or not. detect-
    # secrets finds it only quoted right after a name starting with "aws".
    re.compile(r"(?i:aws[\w .-]{0,20}?secret[\w .-]{0,20}?key|secret[_. -]?access[_. -]?key|secret[_-]?key)"
               r"[^\n]{0,40}?(?:\n[^\n]{0,40}?)?(?<![A-Za-z0-9/+])([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])"),
)
"""Secrets known only by the name beside them: group 1 is the secret, found when it mixes upper and
lower case letters and digits, as a random key does (a path or a word of 40 letters does not)."""
_TOKEN_CHAR = re.compile(r"[A-Za-z0-9_+/=.-]")
_TOKEN_TAIL = re.compile(r"[A-Za-z0-9_+/=-]*(?:\.[A-Za-z0-9_+/=-]+)*")
_PRIVATE_KEY_END = re.compile(r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----")

# Card networks by leading digits (IIN ranges): Visa, Mastercard, Amex, Discover, JCB, Diners,
# UnionPay, Maestro. A Luhn-valid number outside them is an order or account number, not a card.
_CARD_PREFIXES: tuple[tuple[int, int, int], ...] = (
    (1, 4, 4), (2, 51, 55), (4, 2221, 2720), (2, 34, 34), (2, 37, 37), (4, 6011, 6011), (2, 65, 65),
    (3, 644, 649), (4, 3528, 3589), (2, 36, 36), (2, 38, 39), (3, 300, 305), (2, 62, 62), (2, 50, 50),
    (2, 56, 58), (2, 67, 67),
)


@dataclass(frozen=True, order=True)
class Finding:
    """One span of text that must not leave the machine: characters [start, end) of `kind`."""

    start: int
    end: int
    kind: str
    """A key of `PLACEHOLDERS`: secret, email, phone, card, iban or custom."""


@runtime_checkable
class PrivacyFilter(Protocol):
    """Finds what must not leave the machine in a text (module invariants).

    Fake: `FakePrivacyFilter` below. Tested by tests/test_privacy.py."""

    def find(self, text: str) -> list[Finding]: ...


class FakePrivacyFilter:
    """A `PrivacyFilter` for tests: finds each given literal string (as its kind) wherever it occurs."""

    def __init__(self, needles: dict[str, str]) -> None:
        """`needles`: literal text -> kind."""
        self.needles = dict(needles)
        self.calls = 0

    def find(self, text: str) -> list[Finding]:
        self.calls += 1
        found = []
        for needle, kind in self.needles.items():
            start = text.find(needle)
            while needle and start >= 0:
                found.append(Finding(start, start + len(needle), kind))
                start = text.find(needle, start + 1)
        return merge_findings(found)


def merge_findings(findings: Iterable[Finding]) -> list[Finding]:
    """Sorted, overlapping findings merged (the earlier one's kind kept), empty ones left out."""
    out: list[Finding] = []
    for f in sorted(f for f in findings if f.end > f.start):
        if out and f.start < out[-1].end:
            last = out[-1]
            out[-1] = Finding(last.start, max(last.end, f.end), last.kind)
        else:
            out.append(f)
    return out


def mask_text(text: str, findings: Sequence[Finding]) -> str:
    """`text` with each (merged, sorted) finding replaced by its placeholder."""
    parts: list[str] = []
    pos = 0
    for f in findings:
        parts += [text[pos:f.start], PLACEHOLDERS[f.kind]]
        pos = f.end
    parts.append(text[pos:])
    return "".join(parts)


def count_kinds(findings: Iterable[Finding]) -> Counter[str]:
    return Counter(f.kind for f in findings)


def check_option(name: str, value: list[str]) -> list[str]:
    """Validate a privacy setting (`Settings` field validator): unknown detectors or regions and
    patterns that do not compile are refused, naming the bad entry."""
    if name == "privacy_detectors":
        bad = [d for d in value if d not in DETECTORS]
        if bad:
            raise ValueError(f"unknown privacy detector(s) {', '.join(bad)}; known: {', '.join(DETECTORS)}")
    elif name == "privacy_patterns":
        for i, pattern in enumerate(value):
            try:
                compiled = re.compile(pattern)
            except re.error as e:
                raise ValueError(f"privacy_patterns[{i}] is not a regular expression: {e}") from None
            if compiled.match(""):
                raise ValueError(f"privacy_patterns[{i}] matches the empty string")
    elif name == "privacy_phone_regions":
        import phonenumbers

        bad = [r for r in value if r.upper() not in phonenumbers.SUPPORTED_REGIONS]
        if bad:
            raise ValueError(f"unknown phone region(s) {', '.join(bad)}: use ISO 3166 codes such as US, GB, DE")
        return [r.upper() for r in value]
    return value


class DetectorFilter:
    """The real `PrivacyFilter`: the detectors of the module docstring."""

    def __init__(self, detectors: Sequence[str] = DETECTORS, patterns: Sequence[str] = (),
                 phone_regions: Sequence[str] = ("US",)) -> None:
        unknown = set(detectors) - set(DETECTORS)
        if unknown:
            raise ValueError(f"unknown privacy detector(s): {', '.join(sorted(unknown))}")
        self.detectors = tuple(detectors)
        self.patterns = tuple(re.compile(p) for p in patterns)
        self.phone_regions = tuple(phone_regions) or (None,)
        self._secret_regexes: list[tuple[re.Pattern[str], bool]] = _secret_regexes() if "keys" in detectors else []

    def find(self, text: str) -> list[Finding]:
        found: list[Finding] = []
        for name in self.detectors:
            found.extend(getattr(self, f"_{name}")(text))
        found.extend(Finding(m.start(), m.end(), "custom") for p in self.patterns for m in p.finditer(text))
        return merge_findings(found)

    def _keys(self, text: str) -> Iterator[Finding]:
        for regex in _NAMED_SECRETS:
            for m in regex.finditer(text):
                value = m.group(1)
                if any(c.islower() for c in value) and any(c.isupper() for c in value) \
                        and any(c.isdigit() for c in value):
                    yield Finding(m.start(1), m.end(1), "secret")
        for regex, private_key in self._secret_regexes:
            for m in regex.finditer(text):  # the whole match: a plugin's group may be only a prefix
                start, end = m.span()
                if _TOKEN_CHAR.fullmatch(text[end - 1:end]):  # a lazy pattern (JWT) may stop mid-token
                    end = _TOKEN_TAIL.match(text, end).end()  # type: ignore[union-attr]
                if private_key:
                    tail = _PRIVATE_KEY_END.search(text, end)
                    end = tail.end() if tail else len(text)
                    start -= 5 if text[max(0, start - 5):start] == "-----" else 0
                yield Finding(start, end, "secret")

    def _email(self, text: str) -> Iterator[Finding]:
        for m in _EMAIL.finditer(text):
            yield Finding(m.start(), m.end(), "email")

    def _phone(self, text: str) -> Iterator[Finding]:
        import phonenumbers

        for region in self.phone_regions:
            for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.STRICT_GROUPING):
                yield Finding(m.start, m.end, "phone")

    def _card(self, text: str) -> Iterator[Finding]:
        from stdnum import luhn

        for m in _CARD.finditer(text):
            digits = re.sub(r"[ -]", "", m.group())
            if 13 <= len(digits) <= 19 and _card_network(digits) and luhn.is_valid(digits):
                yield Finding(m.start(), m.end(), "card")

    def _iban(self, text: str) -> Iterator[Finding]:
        from stdnum import iban

        for m in _IBAN.finditer(text):
            candidate = m.group()
            # the pattern may run into a following capitalised word or number: shorten to the longest valid
            for end in range(len(candidate), 14, -1):
                if candidate[end - 1] != " " and iban.is_valid(candidate[:end]):
                    yield Finding(m.start(), m.start() + end, "iban")
                    break


def _card_network(digits: str) -> bool:
    return any(lo <= int(digits[:n]) <= hi for n, lo, hi in _CARD_PREFIXES)


def _secret_regexes() -> list[tuple[re.Pattern[str], bool]]:
    """Every regex of detect-secrets' regex plugins but the public-IP one, with whether it marks a
    private key header."""
    import importlib
    import inspect
    import pkgutil

    import detect_secrets.plugins as plugins
    from detect_secrets.plugins.base import RegexBasedDetector

    out: list[tuple[re.Pattern[str], bool]] = []
    for info in pkgutil.iter_modules(plugins.__path__):
        if info.name in ("base", "ip_public"):
            continue
        module = importlib.import_module(f"{plugins.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ != module.__name__ or not issubclass(cls, RegexBasedDetector):
                continue
            denylist: Any = cls.denylist
            out.extend((regex, info.name == "private_key") for regex in denylist)
    return out + [(regex, False) for regex in _EXTRA_SECRETS]
