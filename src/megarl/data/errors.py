"""The one exception type for unusable input data."""
from megarl.config.errors import ConfigError


class DataError(ConfigError):
    """A dataset the run cannot use: a missing file or column, a row of the wrong type, a prompt
    too long for `data.max_prompt_length`. The message names the file, the row and the column.
    It is a ConfigError, so entry points print it without a stack trace and exit with status 2."""
