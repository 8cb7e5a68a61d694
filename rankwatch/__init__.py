"""The `rankwatch` command line."""
