"""`python -m flare`: the same CLI as the `flare` script, from a checkout or an install."""

from flare.cli import main

main()
