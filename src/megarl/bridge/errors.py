"""The one exception type for a checkpoint or config the bridge cannot convert exactly."""


class ConversionError(ValueError):
    """A config, checkpoint or layout that cannot be converted exactly. The message is complete:
    it names the file, tensor or config field at fault. The conversion tools print it and exit
    with status 2, without a stack trace."""
