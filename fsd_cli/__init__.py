"""The ``fsd`` command line: thin argument parsing and printing over decoder/, policies/, sim/, controller/.

``fsd_cli.main.main`` is the entry point; each command is ``fsd_cli/<command>.py`` with
``register(subparsers)``. Library logic does not live here: benchmarks and tests import the libraries.
"""
