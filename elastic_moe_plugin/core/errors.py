"""The plugin's exception types: what went wrong is named by the type, how to fix it by the message."""


class ConfigError(ValueError):
    """A setting of the elastic-moe plugin is invalid. The message names field, value, and fix."""


class UnsupportedFrameworkError(RuntimeError):
    """The installed framework, or an option of the model, cannot be routed elastically."""


class UnsupportedMegatronError(UnsupportedFrameworkError):
    """The installed megatron-core, or a model option, cannot be routed elastically."""


class UnsupportedTransformersError(UnsupportedFrameworkError):
    """The installed transformers, or a covered family's code in it, cannot be routed elastically."""
