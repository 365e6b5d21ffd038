"""The one exception type for a user's configuration mistake."""


class ConfigError(ValueError):
    """A user's config mistake. The message is complete and names the key path; entry points
    print it and exit with status 2, without a stack trace."""
