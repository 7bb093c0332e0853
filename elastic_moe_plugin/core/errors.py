"""The plugin's exception types: what went wrong is named by the type, how to fix it by the message."""


class ConfigError(ValueError):
    """A setting of the elastic-moe plugin is invalid. The message names field, value, and fix.

    Attributes:
        field: the setting the error is about (an ``ElasticConfig`` field name), when there is one.
        fixes: the changes the message suggests, each a ``{field: value}`` mapping, spelled in the
            message as the user wrote the setting. Each was validated before it was printed: applied to
            the refused settings it is accepted, by the model when the entry point knew it
            (``tests/core/test_fix_round_trip.py`` holds every entry point to it).
        renames: for an unknown key or variable, ``{what was typed: the setting it most likely
            meant}``; apply a fix there by renaming first.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        fixes: tuple[dict, ...] = (),
        renames: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.fixes = tuple(fixes)
        self.renames = dict(renames or {})


class UnsupportedFrameworkError(RuntimeError):
    """The installed framework, or an option of the model, cannot be routed elastically."""


class UnsupportedMegatronError(UnsupportedFrameworkError):
    """The installed megatron-core, or a model option, cannot be routed elastically."""


class UnsupportedTransformersError(UnsupportedFrameworkError):
    """The installed transformers, or a covered family's code in it, cannot be routed elastically."""


class UnsupportedTorchtitanError(UnsupportedFrameworkError):
    """The installed torchtitan, or a training option its trainer was given, cannot be routed elastically."""


class NoMoERouterError(UnsupportedFrameworkError):
    """The model has no mixture-of-experts router the plugin covers (a dense model, or an uncovered
    family): elastic routing would silently change nothing, so the run stops instead."""
