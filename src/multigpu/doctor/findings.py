"""The unit every doctor check returns: a ``Finding`` (ok / warning / problem).

Checks are plain functions from fabricated or collected inputs to findings,
so every rule can be tested without the hardware it talks about.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

OK, WARNING, PROBLEM = "ok", "warning", "problem"
STATUSES = (OK, WARNING, PROBLEM)


@dataclass(frozen=True)
class Finding:
    """One line of the doctor's report.

    ``status`` is ``"ok"``, ``"warning"`` or ``"problem"``; ``what`` says what
    was found, ``fix`` what to do about it (empty when nothing), ``check`` the
    group it belongs to and ``source`` the documentation a rule rests on.

    >>> Finding("problem", "NCCL_P2P_DISABLE=1 on a machine with NVLink", "unset NCCL_P2P_DISABLE")
    """

    status: str
    what: str
    fix: str = ""
    check: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status

    def to_dict(self) -> dict:
        return asdict(self)


def worst(findings) -> str:
    """The worst status among ``findings`` (``"ok"`` for none)."""
    statuses = {f.status for f in findings}
    return PROBLEM if PROBLEM in statuses else WARNING if WARNING in statuses else OK


# Names that hold credentials; their values are never printed.
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSW|PASSWD|CREDENTIAL|AUTH|PRIVATE|COOKIE|SESSION)", re.I)
# Values that look like credentials whatever the variable is called
# (OpenAI/Anthropic sk-, Hugging Face hf_, GitHub ghp_/gho_/github_pat_, AWS AKIA, Slack xox*, JWTs).
_SECRET_VALUE = re.compile(
    r"(sk-[A-Za-z0-9_-]{12,}|hf_[A-Za-z0-9]{12,}|gh[pousr]_[A-Za-z0-9]{12,}|github_pat_[A-Za-z0-9_]{12,}"
    r"|AKIA[0-9A-Z]{12,}|xox[abprs]-[A-Za-z0-9-]{8,}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,})"
)
REDACTED = "<redacted>"


def is_secret(name: str, value: str = "") -> bool:
    """True when a variable's name or value looks like a credential."""
    return bool(_SECRET_NAME.search(name) or _SECRET_VALUE.search(value or ""))


def redact(name: str, value: str) -> str:
    """``value`` as it may be printed: credentials become ``<redacted>``.

    >>> redact("WANDB_API_KEY", "abc"), redact("NCCL_DEBUG", "INFO")
    ('<redacted>', 'INFO')
    """
    if _SECRET_NAME.search(name):
        return REDACTED
    return _SECRET_VALUE.sub(REDACTED, value)
