"""The config's one error type."""

class ConfigError(ValueError):
    """A config file is missing, unreadable, or holds an unknown key or a wrongly typed value."""
