"""Awex's errors: every error a package of Awex raises on purpose derives from :class:`AwexError` (``except
AwexError`` catches them all); a value Awex was given that it cannot use raises :class:`AwexValueError` (also a
``ValueError``). Then the MetaServer client's errors (mirrored by the server's HTTP status codes); the other packages
define theirs beside the code that raises them, on these bases."""

from __future__ import annotations


class AwexError(Exception):
    """Base class of every error Awex raises on purpose."""


class AwexValueError(AwexError, ValueError):
    """A value Awex was given (an option, a layout, a model, a request) that it cannot use: said before any byte
    moves where it can be known then."""


class MetaServerError(AwexError, RuntimeError):
    """Base class: the MetaServer could not do what was asked."""


class MetaTimeoutError(MetaServerError, TimeoutError):
    """A wait (for a key, an event or an agreement) reached its deadline."""


class MetaBusyError(MetaTimeoutError):
    """The server asked this client to retry (HTTP 503 ``busy`` or ``overloaded``: too many requests waiting or
    connections open) until the deadline passed."""


class MetaAuthError(MetaServerError):
    """The server requires a token and the one given is missing or wrong (HTTP 401)."""


class MetaPayloadError(MetaServerError):
    """The server rejected a request as malformed or too large (HTTP 400 / 413)."""


class MetaConflictError(MetaServerError):
    """A write conflicted with the server's state (HTTP 409), e.g. a create-only key that already exists."""


class MetaFencedError(MetaConflictError):
    """A newer writer of the same identity took over (HTTP 409 ``fenced``): this writer's writes are refused; it
    must stop."""


class MetaNotRegisteredError(MetaServerError):
    """A participant named in a request is not registered in the job (HTTP 404), e.g. after a server restart
    before its owner registered it again."""


class MetaConnectionError(MetaServerError, ConnectionError):
    """The server could not be reached before the deadline."""


class AgreementError(MetaServerError):
    """Participants of an agreement reported different values (e.g. ranks computed different plans)."""


class AgreementAbortedError(MetaServerError):
    """A participant gave the agreement up (it failed before it could contribute): ``by`` names it, ``cause`` says
    why."""

    def __init__(self, message: str, by: str = "", cause: str = ""):
        super().__init__(message)
        self.by, self.cause = by, cause


class MetaRestartError(MetaServerError):
    """The MetaServer restarted while this client waited on it: its state (event numbers included) began again,
    so what was awaited may never come; the caller decides whether to wait again from the start."""
