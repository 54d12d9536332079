"""The one exception type for a user's mistake in settings, paths or folders."""


class ConfigError(ValueError):
    """A setting is missing, misspelt, of the wrong type or invalid, or a folder may not be used; the
    message names it. The scripts print the message and exit with status 2 instead of a traceback
    (:func:`mhla_gen.commands.cli.run`)."""
