"""The plugin's exception types: what went wrong is named by the type, how to fix it by the message."""


class ConfigError(ValueError):
    """A setting of the elastic-moe plugin is invalid. The message names field, value, and fix.

    Attributes:
        field: the setting the error is about (an ``ElasticConfig`` field name), when there is one.
        fixes: the changes the message suggests, each a ``{field: value}`` mapping that passes the
            same validation when applied to the refused settings (tests hold every message to it).
    """

    def __init__(self, message: str, *, field: str | None = None, fixes: tuple[dict, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.fixes = tuple(fixes)


class UnsupportedFrameworkError(RuntimeError):
    """The installed framework, or an option of the model, cannot be routed elastically."""


class UnsupportedMegatronError(UnsupportedFrameworkError):
    """The installed megatron-core, or a model option, cannot be routed elastically."""


class UnsupportedTransformersError(UnsupportedFrameworkError):
    """The installed transformers, or a covered family's code in it, cannot be routed elastically."""
