"""One module per `flare` subcommand; each exposes `register(app)`."""
