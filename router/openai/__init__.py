"""The OpenAI-compatible HTTP API over the router (`--http-port`); reading order in README.md."""
