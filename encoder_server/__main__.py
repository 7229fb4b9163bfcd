"""`python -m encoder_server`: the same as the `encoder-server` command."""

from .cli import main

main()
