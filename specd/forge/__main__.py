"""``python -m specd.forge OUT_DIR --preset test|demo``: the forge without the specd CLI."""

import argparse
import sys

from . import add_arguments, run

parser = argparse.ArgumentParser(prog="python -m specd.forge", description=__doc__)
add_arguments(parser)
sys.exit(run(parser.parse_args()))
