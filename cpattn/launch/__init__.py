"""The ``cpattn`` command: serve, status, stop, submit, bench, demo.

``cli.main`` parses arguments only; each subcommand's module imports Ray and the service lazily,
so ``cpattn --help`` stays fast.
"""
