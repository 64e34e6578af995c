"""Exceptions the engine raises for input a user can fix."""


class EngineError(Exception):
    """Base class for errors the engine reports to its caller."""


class InvalidRequestError(EngineError, ValueError):
    """The request or its parameters are malformed (empty prompt, bad sampling values)."""


class GrammarRejected(InvalidRequestError):
    """A token the request's structured-output grammar does not allow (a token replayed from
    another engine or from before a migration)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) exceeds max_model_len."""


class CapacityError(EngineError):
    """Admission control: the request can never fit in the KV cache of this engine."""


class NoFreeBlocksError(CapacityError):
    """The request fits this engine, but not now: too few KV blocks are free at the moment
    (running requests hold them). Worth retrying once some finish."""


class ModelNotFoundError(EngineError, FileNotFoundError):
    """The model name or path does not resolve to a checkpoint."""
