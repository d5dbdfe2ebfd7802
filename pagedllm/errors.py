"""Errors a caller can act on. InvalidRequestError is the client's fault (HTTP 400); any other error is ours."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot be served as sent: bad parameters, a prompt too long, an unknown id."""
