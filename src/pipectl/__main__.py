"""`python -m pipectl`: the same command line as `pipectl`."""

from pipectl.cli.main import run

run()
