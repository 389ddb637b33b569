"""Errors a person reads: a message, the context, and a hint (pip's DiagnosticPipError).

Every specops error carries the exit code it maps to, so ``main`` never has to guess.
"""
from __future__ import annotations

from specops.exit_codes import ExitCode


class SpecopsError(Exception):
    """Base class: ``message`` says what is wrong, ``hint`` says what to do about it."""

    code: ExitCode = ExitCode.FAILED
    #: kebab-case reference, stable across releases, for searching docs and issues.
    reference = "specops-error"

    def __init__(self, message: str, hint: str | None = None, *, host: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.host = host

    def __str__(self) -> str:
        prefix = f"[{self.host}] " if self.host else ""
        text = f"{prefix}{self.message}"
        if self.hint:
            text += f"\n  hint: {self.hint}"
        return text


class UsageError(SpecopsError):
    """Bad flags or arguments; nothing was run."""

    code = ExitCode.USAGE
    reference = "usage-error"


class InventoryError(UsageError):
    """The inventory file is unreadable or does not validate."""

    reference = "inventory-invalid"


class TaskInterrupted(SpecopsError):
    """Ctrl-C stopped a foreground task; the message says what was stopped on the host."""

    code = ExitCode.INTERRUPTED
    reference = "interrupted"


class UnreachableError(SpecopsError):
    """The host could not be reached (DNS, refused, timeout, auth)."""

    code = ExitCode.UNREACHABLE
    reference = "host-unreachable"


class HostKeyError(UnreachableError):
    """The host presented a key that is unknown or differs from known_hosts."""

    reference = "host-key-refused"

    def __init__(self, message: str, hint: str | None = None, *, host: str | None = None,
                 fingerprint: str | None = None):
        super().__init__(message, hint, host=host)
        self.fingerprint = fingerprint


class HostSetupError(SpecopsError):
    """The host answers, but cannot run specops as the inventory sets it up (its python, its work_dir)."""

    reference = "host-setup"


class PythonTooOldError(HostSetupError):
    """The inventory's ``python`` is older than the host code needs (found by the entry script)."""

    reference = "remote-python-too-old"

    def __init__(self, message: str, hint: str | None = None, *, host: str | None = None,
                 found: str = "", needed: str = ""):
        super().__init__(message, hint, host=host)
        self.found, self.needed = found, needed


class WorkDirError(HostSetupError):
    """``work_dir`` (where scripts and bundles go) cannot be created or written on the host."""

    reference = "work-dir-unusable"

    def __init__(self, message: str, hint: str | None = None, *, host: str | None = None, path: str = ""):
        super().__init__(message, hint, host=host)
        self.path = path


class RemoteError(SpecopsError):
    """The remote script ran but did not return a result we can read."""

    reference = "remote-no-result"

    def __init__(self, message: str, hint: str | None = None, *, host: str | None = None,
                 exited: int | None = None, output_tail: str = ""):
        super().__init__(message, hint, host=host)
        self.exited = exited
        self.output_tail = output_tail

    def __str__(self) -> str:
        text = super().__str__()
        if self.output_tail:
            text += "\n  last output:\n    " + "\n    ".join(self.output_tail.splitlines()[-10:])
        return text
