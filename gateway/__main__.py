"""`python -m gateway`: the same as the `encoder-gateway` command."""

from .cli import main

main()
